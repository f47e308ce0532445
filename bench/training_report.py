"""A training run's loss curve, throughput and predicted-vs-measured step time, from a service database.

Reads the ``trainings`` and ``training_metrics`` rows that ``foldtune train`` (or the runner) stored, prints
a short table and, unless ``--no-write``, replaces a section of docs/benchmarks.md with it.

    python -m bench.training_report --database-url sqlite:///out/res/foldtune.sqlite3 --training 1 \\
        --device "4x NVIDIA H100 80GB HBM3" --heading "## Training from a tuning job (GPU)"
"""

from __future__ import annotations

import argparse
import statistics

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from bench.report import replace_section
from db.models import Training, TrainingMetric
from spec.parallel_config import ParallelConfig


def load(url: str, training_id: int) -> tuple[dict, list[dict]]:
    """The training row (as a dict) and its metrics in step order."""
    with Session(create_engine(url)) as session:
        training = session.get(Training, training_id)
        if training is None:
            raise SystemExit(f"no training {training_id} in {url}")
        row = {c.name: getattr(training, c.name) for c in Training.__table__.columns}
        metrics = [{c.name: getattr(m, c.name) for c in TrainingMetric.__table__.columns}
                   for m in session.scalars(select(TrainingMetric).where(TrainingMetric.training_id == training_id)
                                            .order_by(TrainingMetric.step))]
    return row, metrics


def summarise(training: dict, metrics: list[dict], every: int) -> tuple[list[str], dict]:
    """Markdown lines (curve table) and the headline numbers."""
    if not metrics:
        raise SystemExit(f"training {training['id']} has no metrics")
    steady = [m for m in metrics if m["step"] > min(10, len(metrics) // 4)]  # skip warm-up steps (compilation)
    step_s = statistics.median(m["step_time_s"] for m in steady if m["step_time_s"])
    tokens = statistics.median(m["tokens_per_s"] for m in steady if m["tokens_per_s"])
    mfu = [m["mfu"] for m in steady if m["mfu"]]
    peak = max((m["peak_memory_bytes"] or 0) for m in metrics)
    head = {"steps": metrics[-1]["step"], "median_step_s": step_s, "median_tokens_per_s": tokens,
            "median_mfu": statistics.median(mfu) if mfu else None, "peak_memory_gib": peak / 2**30,
            "predicted_step_s": training.get("predicted_step_time_s"),
            "first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"]}
    evals = [m for m in metrics if m["eval_loss"] is not None]
    picked = [m for m in metrics if m["step"] == 1 or m["step"] % every == 0 or m is metrics[-1]]
    lines = ["| step | train loss | held-out loss | lr | grad norm | tokens/s | step ms |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in picked:
        ev = next((e["eval_loss"] for e in evals if e["step"] == m["step"]), None)
        lines.append(f"| {m['step']} | {m['loss']:.3f} | {'' if ev is None else f'{ev:.3f}'} | {m['lr']:.2e} | "
                     f"{m['grad_norm']:.2f} | {m['tokens_per_s']:,.0f} | {m['step_time_s'] * 1e3:.1f} |")
    return lines, head


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--training", type=int, default=1)
    parser.add_argument("--every", type=int, default=100, help="table row every N steps (default 100)")
    parser.add_argument("--device", required=True, help="the machine it ran on, in words")
    parser.add_argument("--heading", default="## Training from a tuning job (GPU)")
    parser.add_argument("--preamble", default="", help="text placed under the heading (command, data, date)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    training, metrics = load(args.database_url, args.training)
    lines, head = summarise(training, metrics, args.every)

    layout = ParallelConfig.from_dict(training["config"]).label()
    predicted = head["predicted_step_s"]
    error = f"{predicted / head['median_step_s'] - 1:+.0%}" if predicted else "n/a"
    summary = (f"Training {training['id']} (job {training['job_id']}): `{layout}` on {args.device}; "
               f"{head['steps']} steps, loss {head['first_loss']:.3f} -> {head['last_loss']:.3f}; median step "
               f"{head['median_step_s'] * 1e3:.1f} ms, {head['median_tokens_per_s']:,.0f} tokens/s"
               + (f", MFU {head['median_mfu']:.1%}" if head["median_mfu"] else "")
               + f"; peak memory {head['peak_memory_gib']:.1f} GiB/GPU; the cost model predicted "
               + (f"{predicted * 1e3:.1f} ms ({error})." if predicted else "nothing for this layout."))
    print(summary)
    print("\n".join(lines))
    if not args.no_write:
        body = [args.heading, "", *([args.preamble, ""] if args.preamble else []), summary, "", *lines]
        replace_section(args.heading, "\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
