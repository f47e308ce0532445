"""EP all-to-all overlap on 2 GPUs (issue 19): how much of the all-to-all time the overlap hides.

Runs full training steps of the Mixtral-8x7B-shaped proxy (``--layers`` decoder layers, seq ``--seq``, mbs 1,
``--micro`` micro-batches per rank) at EP2 (tp1, dp2, ep2: each GPU holds 4 of the 8 experts) twice, with
``overlap_moe_expert_parallel_comm`` off and on (executor/ep_overlap.py), through ``executor.profile`` (a
local 2-process NCCL world per run, ``--warmup`` then ``--steps`` timed steps, median step). Off and on
alternate for ``--rounds`` rounds (the card's clock drifts over seconds); each mode's step is the median
over rounds.

Reported (a table, and JSON in ``--out``, default $OUT/ep_overlap_gpu.json):
  step_off, step_on   step time without and with the overlap
  exposed_a2a_off     the step's ``ep_alltoall`` phase without the overlap: the EP all-to-all time it exposes
                      (dispatch and combine, forward and backward, the split-size exchange included)
  a2a_phase_on        the ``ep_alltoall`` phase with the overlap: what the step still waits for at the
                      exchanges (the unpaired first forward's and last backward's included); a diagnosis,
                      not the bar (with the overlap the phase boundaries fall inside the partner's compute)
  hidden_fraction     (step_off − step_on) / exposed_a2a_off; bar ≥ 0.60 (the first forward's and the last
                      backward's all-to-alls have no partner: at most (micro − 1) / micro of it can hide)
  loss_rel_diff       the largest relative difference of the timed steps' losses between the two modes (the
                      overlap must compute the same step)

With ``--trace`` it then profiles one more step of each mode per rank (torch.profiler, after ``--warmup``
steps; bench/layout_trace_gpu.py's worker) and reports the all-to-all kernels' time and how much of it ran
beside compute kernels (``a2a_under_compute_ms``; a NCCL kernel's time includes waiting for the peer): the
direct evidence of whether the exchanges run under the partner's compute.

Routing is forced round-robin by default (Megatron's --moe-router-force-load-balancing: both EP ranks send
and receive the same rows, the all-to-all's size is the layout's, not an untrained router's skew);
``--routing random`` keeps the router's own choices.

Usage: python -m bench.ep_overlap_gpu [--layers 2] [--seq 4096] [--micro 8] [--rounds 2] [--trace]
       python -m bench.ep_overlap_gpu --device cpu --tiny      (CPU smoke run: gloo, tiny-moe, seq 64, fp32)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

from bench.layout_trace_gpu import trace_worker
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.profile import profile_layout
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

BAR = 0.60


def _config(overlap: bool) -> ParallelConfig:
    return ParallelConfig.parse("ep2", world_size=2).replace(overlap_moe_expert_parallel_comm=overlap)


def run_mode(model, training: TrainingSpec, overlap: bool, options: ExecutorOptions, device: str,
             warmup: int, steps: int) -> dict:
    """One EP2 run (a fresh 2-process world) with the overlap ``overlap``: its Measurement as a dict."""
    config = _config(overlap)
    m = profile_layout(model, training, config, options, warmup_steps=warmup, timed_steps=steps,
                       timeout_s=900, device=device)
    return m.to_dict()


def summarize(runs: dict[str, list[dict]], micro: int) -> dict:
    """Step times, the exposed all-to-all, the hidden fraction and the loss agreement of the runs."""
    if not all(r["ok"] for mode in runs.values() for r in mode):
        failed = [r.get("failure_reason") for mode in runs.values() for r in mode if not r["ok"]]
        return {"ok": False, "failures": failed}
    step = {mode: statistics.median(r["step_time"] for r in rs) for mode, rs in runs.items()}
    exposed = statistics.median(r["phases"].get("ep_alltoall", 0.0) for r in runs["off"])
    phase_on = statistics.median(r["phases"].get("ep_alltoall", 0.0) for r in runs["on"])
    hidden = (step["off"] - step["on"]) / exposed if exposed > 0 else None
    diffs = [abs(a - b) / max(abs(a), 1e-12) for r_off, r_on in zip(runs["off"], runs["on"])
             for a, b in zip(r_off["losses"], r_on["losses"])]
    return {"ok": True, "step_off": step["off"], "step_on": step["on"], "exposed_a2a_off": exposed,
            "a2a_phase_on": phase_on, "hidden_fraction": hidden, "bar": BAR,
            "passes": hidden is not None and hidden >= BAR,
            "max_hideable_fraction": (micro - 1) / micro, "loss_rel_diff": max(diffs) if diffs else None}


def trace_mode(model, training: TrainingSpec, overlap: bool, options: ExecutorOptions, warmup: int) -> list[dict]:
    """One profiled step per rank with the overlap ``overlap`` (a fresh 2-process world): wall, busy and
    all-to-all kernel times, and the all-to-all time beside compute (ms), per rank."""
    launched = launch(trace_worker, 2, (model, training, _config(overlap), warmup, 10, options), timeout_s=600)
    if not launched.ok:
        return [{"failure": launched.failure_reason}]
    keys = ("rank", "wall_ms", "busy_ms", "busy_without_nccl_ms", "a2a_ms", "a2a_under_compute_ms")
    return [{k: r[k] for k in keys} for r in launched.results]


def trace_table(traces: dict[str, list[dict]]) -> str:
    lines = ["profiled step (ms)  mode rank   wall   busy  compute  all-to-all  beside compute"]
    for mode, ranks in traces.items():
        for r in ranks:
            if "failure" in r:
                lines.append(f"  {mode}: failed: {r['failure']}")
                continue
            lines.append(f"{'':19} {mode:>4} {r['rank']:>4} {r['wall_ms']:6.1f} {r['busy_ms']:6.1f} "
                         f"{r['busy_without_nccl_ms']:8.1f} {r['a2a_ms']:11.2f} {r['a2a_under_compute_ms']:15.2f}")
    return "\n".join(lines)


def table(summary: dict, device: str) -> str:
    if not summary["ok"]:
        return f"{device}: a run failed: {summary['failures']}"
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    rows = [("step time, overlap off", ms(summary["step_off"]), ""),
            ("step time, overlap on", ms(summary["step_on"]), ""),
            ("EP all-to-all exposed (off)", ms(summary["exposed_a2a_off"]), ""),
            ("EP all-to-all phase (on)", ms(summary["a2a_phase_on"]), ""),
            ("hidden fraction", f"{summary['hidden_fraction']:.3f}" if summary["hidden_fraction"] is not None
             else "n/a", f">= {BAR:.2f}  {'yes' if summary['passes'] else 'NO'}"),
            ("  at most (micro-1)/micro", f"{summary['max_hideable_fraction']:.3f}", ""),
            ("loss rel. difference off/on", f"{summary['loss_rel_diff']:.2e}", "")]
    return "\n".join([device] + [f"{a:<32}{b:>14}  {c}" for a, b, c in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Mixtral proxy")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per rank per step (mbs 1)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs of runs")
    parser.add_argument("--routing", choices=("balanced", "random"), default="balanced")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny-moe at seq 64 (CPU smoke runs)")
    parser.add_argument("--trace", action="store_true",
                        help="also profile one step per mode: all-to-all kernel time beside compute")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_overlap_gpu.json"))
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error("needs 2 GPUs (or --device cpu)")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # one hardware queue: the waits on the
        print("warning: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises streams; the overlap may not show", flush=True)
    cuda = args.device == "cuda"
    model = get_model("tiny-moe") if args.tiny else get_model("mixtral-8x7b").with_layers(args.layers)
    seq = 64 if args.tiny else args.seq
    # dp2: each of the 2 ranks takes ``micro`` sequences of the global batch
    training = TrainingSpec(seq_length=seq, global_batch_size=2 * args.micro, precision="bf16" if cuda else "fp32")
    options = ExecutorOptions(moe_router_force_load_balancing=args.routing == "balanced")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            runs[mode].append(run_mode(model, training, mode == "on", options, args.device, args.warmup, args.steps))
            r = runs[mode][-1]
            print(f"[{mode}] " + (f"step {r['step_time'] * 1e3:.2f} ms, ep_alltoall "
                                  f"{r['phases'].get('ep_alltoall', 0.0) * 1e3:.2f} ms" if r["ok"] else
                                  f"failed: {r.get('failure_reason')}"), flush=True)
    summary = summarize(runs, args.micro)
    traces = {mode: trace_mode(model, training, mode == "on", options, args.warmup) for mode in ("off", "on")} \
        if args.trace else None
    device = runs["off"][0].get("device", args.device) if runs["off"] else args.device
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
              "device": device, "model": model.name, "seq": seq, "micro_per_rank": args.micro,
              "routing": args.routing, "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
              **summary, "runs": runs, **({"trace": traces} if traces else {})}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(summary, f"{device} x2, {model.name}, seq {seq}, {args.micro} micro-batches/rank, EP2"))
    if traces:
        print(trace_table(traces))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
