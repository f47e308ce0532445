"""The seeds' headline figures, priced by the cost model from their published layouts (no GPU: cost model only).

The Megatron-Core MoE report (arXiv 2603.07685) reaches 1,233 / 1,048 TFLOPS/GPU for DeepSeek-V3 on GB300 /
GB200 and 974 / 919 for Qwen3-235B; the MoE Parallel Folding paper (arXiv 2504.14960) 49.3 % / 39.0 % MFU for
Mixtral-8x22B / Qwen2-57B-A14B on H100. Each run's layout and recipe (costmodel/published_runs.py, with their
sources) is priced on the catalog's datasheet profile of its GPU, with the switches that price Megatron-Core's
implementation. For each run the table gives the published and predicted figures, the step time the published
figure implies for the FLOPs foldtune counts, and every exposed term of the predicted step with the factor that
term alone would need to close the miss; then the recipe's features foldtune does not price, and the predicted
memory against the GPU's. Nothing in the cost model is fitted to these figures.

    python3 -m bench.headline_figures [--no-write]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from bench.report import RESULTS, ROOT, replace_section, save_json, utc_now
from costmodel.estimate import estimate
from costmodel.published_runs import HEADLINE_RUNS, closing_factors, implied_step_seconds

HEADING = "## The seeds' headline figures, priced by the cost model"
GIB = 2**30


def commit() -> str:
    """The commit the predictions are made at (short hash, '+dirty' with uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def price(run) -> dict:
    """The run priced: figures, implied step, terms with closing factors, memory."""
    model, training, cluster, config = run.specs()
    e = estimate(model, training, cluster, config)
    t = e.time
    implied = implied_step_seconds(run, t.tflops_per_gpu, t.mfu, t.step_time)
    metric = "tflops_per_gpu" if run.figure("tflops_per_gpu") else "mfu"
    predicted = t.tflops_per_gpu if metric == "tflops_per_gpu" else t.mfu
    return {"key": run.key, "model": run.model, "gpu": run.gpu, "gpus": run.gpus, "layout": config.label(),
            "precision": training.precision + (f" ({training.fp8_recipe})" if training.transformer_engine_fp8 else ""),
            "metric": metric, "published": run.figure(metric), "predicted": predicted,
            "error": predicted / run.figure(metric) - 1, "step_s": t.step_time, "implied_step_s": implied,
            "terms": [{"term": name, "seconds": s, "closing_factor": f}
                      for name, s, f in closing_factors(t.terms, t.step_time, implied)],
            "memory_gib": e.memory.total / GIB, "usable_gib": cluster.usable_hbm_bytes / GIB, "fits": e.fits,
            "unpriced": list(run.unpriced), "source": run.source}


def _figure(metric: str, value: float) -> str:
    return f"{value:,.0f} TFLOPS" if metric == "tflops_per_gpu" else f"{value:.1%} MFU"


def _reading(r: dict) -> str:
    """One line on where the miss can sit: the terms that alone could close it within a factor of two, the
    recipe's unpriced features and the memory."""
    slower = r["step_s"] > r["implied_step_s"]
    plausible = [f"{x['term']} ×{x['closing_factor']:.2f}" for x in sorted(r["terms"], key=lambda x: -x["seconds"])
                 if x["closing_factor"] is not None and 0.5 <= x["closing_factor"] <= 2.0]
    text = (f"predicted {'slower' if slower else 'faster'} than published by "
            f"{abs(r['step_s'] / r['implied_step_s'] - 1):.0%} of the published step; ")
    text += ("one term alone closes it within ×2: " + ", ".join(plausible) if plausible
             else "no single term closes it within ×2")
    if r["unpriced"]:
        text += "; not priced: " + ", ".join(r["unpriced"])
    if not r["fits"]:
        text += (f"; predicted memory {r['memory_gib']:.0f} GiB over the {r['usable_gib']:.0f} GiB usable "
                 "(the run offloaded what foldtune does not price)")
    return text


def _summary(rows: list[dict]) -> str:
    """The runs grouped by what their misses say: within 5 %; closable by one term within ×2 (its largest such
    term named); or not closable by any one term (several terms are off together)."""
    close, one, several = [], [], []
    for r in rows:
        miss = abs(r["step_s"] / r["implied_step_s"] - 1)
        terms = [x for x in sorted(r["terms"], key=lambda x: -x["seconds"])
                 if x["closing_factor"] is not None and 0.5 <= x["closing_factor"] <= 2.0]
        if miss <= 0.05:
            close.append(r["key"])
        elif terms:
            one.append(f"{r['key']} (e.g. {terms[0]['term']} ×{terms[0]['closing_factor']:.2f})")
        else:
            several.append(r["key"])
    parts = []
    if close:
        parts.append("Within 5 % of the published step: " + ", ".join(close) + ".")
    if one:
        parts.append("A miss one term could carry within a factor of two: " + "; ".join(one) + ".")
    if several:
        parts.append("A miss no single term carries within a factor of two, so several are off together (on "
                     "GPUs without a calibration every compute and HBM efficiency is a default): "
                     + ", ".join(several) + ".")
    return " ".join(parts)


def render(rows: list[dict], command: str, at: str) -> str:
    lines = [HEADING, "", f"Cost-model predictions at commit `{at}` ({utc_now()}, `{command}`; no GPU run): each "
             "published layout and recipe (`costmodel/published_runs.py`, with its sources) priced on the catalog's "
             "datasheet profile of its GPU (`gb300`, `gb200`, `h100-sxm`: no calibration of these GPUs), with the "
             "switches that price Megatron-Core's implementation. The implied step is the step time the published "
             "figure means for the FLOPs foldtune counts. Nothing is fitted to these figures.", "",
             "| run | GPUs | layout | precision | published | predicted | error | step (s) predicted / implied "
             "| memory (GiB) / usable |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        layout = r["layout"].replace("|", "\\|")  # a pipe inside a table cell, even in code, splits it
        lines.append(f"| {r['key']} | {r['gpus']} {r['gpu']} | `{layout}` | {r['precision']} | "
                     f"{_figure(r['metric'], r['published'])} | {_figure(r['metric'], r['predicted'])} | "
                     f"{r['error']:+.1%} | {r['step_s']:.2f} / {r['implied_step_s']:.2f} | "
                     f"{r['memory_gib']:.0f} / {r['usable_gib']:.0f} |")
    lines += ["", _summary(rows), "", "### Each miss by term", "",
              "Exposed seconds of every term of the predicted step, and the factor that term alone would need for "
              "the predicted step to equal the implied one (— : no factor on it can).", ""]
    for r in rows:
        lines += [f"**{r['key']}** ({r['source']}): {_reading(r)}.", "",
                  "| term | predicted s | share | factor to close |", "| --- | ---: | ---: | ---: |"]
        for x in sorted(r["terms"], key=lambda x: -x["seconds"]):
            factor = "—" if x["closing_factor"] is None else f"×{x['closing_factor']:.2f}"
            lines.append(f"| {x['term']} | {x['seconds']:.3f} | {x['seconds'] / r['step_s']:.0%} | {factor} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true",
                        help="print only: do not update docs/benchmarks.md nor bench/results")
    args = parser.parse_args(argv)
    rows = [price(run) for run in HEADLINE_RUNS]
    at = commit()
    command = "python3 -m bench.headline_figures" + "".join(f" {a}" for a in (argv if argv is not None
                                                                              else sys.argv[1:]))
    text = render(rows, command, at)
    print(text)
    if not args.no_write:
        save_json({"commit": at, "rows": rows}, "headline_figures.json", RESULTS)
        replace_section(HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
