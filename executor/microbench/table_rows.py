"""Run a worker on each layout of a stored layout table: the row selection and per-row launch that
the layout-table benches (bench/layout_trace_gpu.py, bench/host_probe_gpu.py) share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from executor.launch_local import LaunchResult, launch
from spec.parallel_config import ParallelConfig

#: seconds one layout's ranks may take (start-up, warm-up and the measured steps) before they are stopped
ROW_TIMEOUT_S = 240


def matching_rows(table: dict, match: str, ok_only: bool = False) -> list[dict]:
    """The table's rows whose layout label contains one of ``match``'s comma-separated substrings (all rows when
    it names none); with ``ok_only`` only the rows that measured."""
    wanted = [m.strip() for m in match.split(",") if m.strip()]
    return [r for r in table["rows"] if (r.get("ok") or not ok_only)
            and (not wanted or any(m in r["layout"] for m in wanted))]


def launch_rows(rows: Iterable[dict], worker: Callable, args_of: Callable[[ParallelConfig], tuple],
                results: list[dict]) -> Iterator[tuple[dict, ParallelConfig, LaunchResult]]:
    """Launch ``worker(rank, world, *args_of(config))`` on each row's layout; yield (row, config, result) of the
    runs that succeeded. A failed run is printed and appended to ``results`` as {'layout', 'failure'}."""
    for row in rows:
        config = ParallelConfig.from_dict(row["config"])
        launched = launch(worker, config.world_size, args_of(config), timeout_s=ROW_TIMEOUT_S)
        if not launched.ok:
            print(f"   {row['layout']}: failed: {launched.failure_reason}", flush=True)
            results.append({"layout": row["layout"], "failure": launched.failure_reason})
            continue
        yield row, config, launched
