"""The EP all-to-all overlap bar's arithmetic: how much of the all-to-all that an EP step without the overlap
exposes does the overlap hide (``hidden_fraction`` = step seconds saved / exposed all-to-all seconds, bar
:data:`BAR`), from runs of the step with the overlap off and on (``bench/ep_overlap_gpu.py``: separate runs per
variant; ``bench/ep_overlap_paired.py``: off and on steps alternated in pairs inside one run). A pipelined
step of ``micro`` micro-batches can hide at most (micro - 1) / micro of it: the first dispatch has nothing to
run beside. Times are seconds.

A variant name says how the overlapped exchanges run (:func:`parse_variant`): 'on', plus '_carveN' (N SMs
left to the overlapped all-to-all), '_nchN' (NCCL's channels capped at N), '_ce' / '_nccl' (the transport).
"""

from __future__ import annotations

import dataclasses
import re
import statistics

from executor.options import ExecutorOptions

BAR = 0.60  # hidden fraction the overlap must reach
_VARIANT = re.compile(r"on(?:_carve(\d+))?(?:_nch(\d+))?(?:_(ce|nccl))?")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the step: ``overlap`` off or on; with it, ``sm_carveout`` SMs left to the overlapped
    all-to-all (0: none), NCCL's channels capped at ``nccl_channels`` (None: NCCL's choice), and the
    overlapped exchanges moved by ``transport`` (ExecutorOptions.ep_overlap_transport)."""

    name: str
    overlap: bool
    sm_carveout: int = 0
    nccl_channels: int | None = None
    transport: str = "auto"

    def env(self) -> dict[str, str]:
        """Environment the run's rank processes start with, beyond this process's."""
        return {} if self.nccl_channels is None else {"NCCL_MAX_NCHANNELS": str(self.nccl_channels)}

    def options(self, base: ExecutorOptions) -> ExecutorOptions:
        """``base`` with this variant's SM carve-out and transport."""
        return dataclasses.replace(base, ep_overlap_sm_carveout=self.sm_carveout, ep_overlap_transport=self.transport)


OFF = Variant("off", overlap=False)


def parse_variant(name: str) -> Variant:
    """'on', 'on_carveN', 'on_nchN' or 'on_carveN_nchM', each optionally ending in '_ce' or '_nccl' (module
    docstring) as a :class:`Variant`; ValueError otherwise."""
    match = _VARIANT.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown variant {name!r}: on, on_carveN, on_nchN or on_carveN_nchM, "
                         "optionally + _ce or _nccl")
    carve, channels, transport = match.groups()
    if channels is not None and int(channels) < 1:
        raise ValueError(f"{name}: NCCL needs at least one channel")
    return Variant(name, True, int(carve or 0), int(channels) if channels is not None else None,
                   {"ce": "copy_engine", "nccl": "nccl", None: "auto"}[transport])


def _failures(runs: list[dict]) -> list:
    return [r.get("failure_reason") for r in runs if not r["ok"]]


def compare_variant(off: list[dict], runs: list[dict], exposed: float) -> dict:
    """One variant against 'off' (runs of the same rounds, in order): its step, its ``ep_alltoall`` phase,
    the hidden fraction of ``exposed`` (s), the bar, and the largest relative loss difference."""
    if _failures(runs):
        return {"ok": False, "failures": _failures(runs)}
    step_off = statistics.median(r["step_time"] for r in off)
    step = statistics.median(r["step_time"] for r in runs)
    hidden = (step_off - step) / exposed if exposed > 0 else None
    diffs = [abs(a - b) / max(abs(a), 1e-12) for r_off, r in zip(off, runs)
             for a, b in zip(r_off["losses"], r["losses"])]
    phase = statistics.median(r["phases"].get("ep_alltoall", 0.0) for r in runs)
    return {"ok": True, "step": step, "a2a_phase": phase, "hidden_fraction": hidden,
            "passes": hidden is not None and hidden >= BAR, "loss_rel_diff": max(diffs) if diffs else None}


def summarize_runs(runs: dict[str, list[dict]], micro: int, variants: dict[str, Variant] | None = None,
                   hideable: float | None = None) -> dict:
    """Step times, the exposed all-to-all, the hidden fraction and the loss agreement of the runs: 'off'
    against every other key of ``runs`` (a variant name; ``variants`` describe them in the JSON). The
    top-level ``*_on`` keys are variant 'on''s, or the first variant's when 'on' was not run.
    ``hideable``: the most of the all-to-all the schedule can hide (default (micro - 1) / micro, no pipeline)."""
    names = [name for name in runs if name != "off"]
    if _failures(runs["off"]):
        return {"ok": False, "failures": [f for rs in runs.values() for f in _failures(rs)]}
    exposed = statistics.median(r["phases"].get("ep_alltoall", 0.0) for r in runs["off"])
    per = {name: compare_variant(runs["off"], runs[name], exposed) for name in names}
    for name, entry in per.items():
        if variants and name in variants:
            entry.update(sm_carveout=variants[name].sm_carveout, nccl_max_nchannels=variants[name].nccl_channels)
    primary = "on" if "on" in per else names[0]
    step_off = statistics.median(r["step_time"] for r in runs["off"])
    summary = {"ok": all(v["ok"] for v in per.values()), "step_off": step_off, "exposed_a2a_off": exposed,
               "bar": BAR, "max_hideable_fraction": (micro - 1) / micro if hideable is None else hideable,
               "primary_variant": primary,
               "variants": per}
    failures = [f for v in per.values() for f in v.get("failures", [])]
    if failures:
        summary["failures"] = failures
    p = per[primary]
    if p["ok"]:
        summary.update(step_on=p["step"], a2a_phase_on=p["a2a_phase"], hidden_fraction=p["hidden_fraction"],
                       passes=p["passes"], loss_rel_diff=p["loss_rel_diff"])
    passing = [n for n, v in per.items() if v["ok"] and v["hidden_fraction"] is not None]
    summary["best_variant"] = max(passing, key=lambda n: per[n]["hidden_fraction"]) if passing else None
    return summary


def pair_orders(pairs: int) -> list[tuple[bool, bool]]:
    """The overlap flag of each step of ``pairs`` pairs, ABBA: (off, on), (on, off), (off, on), ..."""
    return [(False, True) if i % 2 == 0 else (True, False) for i in range(pairs)]


def summarize_pairs(reports: list[dict] | dict, micro: int) -> dict:
    """The bar's quotient from the ranks' paired reports (``bench/ep_overlap_paired.py``'s worker; rank 0
    first): medians of the off and on steps (rank 0's wall time: every step ends with an all-reduce, so the
    ranks' steps end together), of the per-pair saving, and of the all-to-all the off steps expose (seconds),
    ``hidden_fraction`` and ``passes``.

    The exposed all-to-all of an off step is its ``ep_alltoall`` phase on the rank where it is smallest. A
    rank that reaches an exchange before its peer waits in it for the peer's compute, and its phase counts
    that wait as all-to-all time; the last rank to arrive waits only for the transfer. Where the GPUs differ
    in GEMM speed by a few per cent, rank 0's phase can hold milliseconds of the slower GPU's compute that no
    overlap can hide (docs/benchmarks.md has a measured case). ``exposed_a2a_off_rank0`` keeps rank 0's own
    figure (the quotient of earlier runs)."""
    if isinstance(reports, dict):
        reports = [reports]
    off, on = reports[0]["off"], reports[0]["on"]
    if not off["step_s"] or len(off["step_s"]) != len(on["step_s"]):
        raise ValueError("paired report: the off and on steps must be equal in number and not empty")
    if any(len(r["off"]["ep_alltoall_s"]) != len(off["step_s"]) for r in reports):
        raise ValueError("paired report: every rank must time the same off steps")
    saved = [a - b for a, b in zip(off["step_s"], on["step_s"])]
    exposed = statistics.median([min(r["off"]["ep_alltoall_s"][i] for r in reports) for i in range(len(saved))])
    hidden = statistics.median(saved) / exposed if exposed > 0 else float("nan")
    return {"pairs": len(saved), "step_off": statistics.median(off["step_s"]),
            "step_on": statistics.median(on["step_s"]), "saved_per_pair": statistics.median(saved),
            "saved_min": min(saved), "saved_max": max(saved), "exposed_a2a_off": exposed,
            "exposed_a2a_off_rank0": statistics.median(off["ep_alltoall_s"]),
            "a2a_phase_on": statistics.median(on["ep_alltoall_s"]), "hidden_fraction": hidden,
            "pairs_saving": sum(s > 0 for s in saved), "max_hideable_fraction": (micro - 1) / micro,
            "peak_bytes_off": max(off.get("peak_bytes") or [0]), "peak_bytes_on": max(on.get("peak_bytes") or [0]),
            "bar": BAR, "passes": hidden >= BAR}
