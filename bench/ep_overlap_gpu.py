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

``--variants`` (default ``on``) lists the overlap variants compared with 'off' in the same run, each in
every round after 'off': ``on`` (the overlap as built), ``on_carveN`` (``ExecutorOptions.ep_overlap_sm_carveout``
= N: the compute beside an overlapped all-to-all leaves N SMs free, executor/ep_overlap.py), ``on_nchN``
(``NCCL_MAX_NCHANNELS=N`` in that run's rank processes only: NCCL's kernels use at most N channels, one SM
each, for every collective of the run, the gradient reduction's included), both joined
(``on_carve16_nch8``); each moves the overlapped exchanges as the executor's default does
(``ExecutorOptions.ep_overlap_transport='auto'``: the copy engines on one node), or with the suffix ``_ce``
over the copy engines, with ``_nccl`` over NCCL (``on_nccl``, ``on_carve16_nccl``). Per variant: its step, hidden
fraction and loss difference from 'off' (JSON
``variants``; the top-level ``*_on`` keys, ``hidden_fraction``, ``passes`` and ``loss_rel_diff`` are the
``on`` variant's, or the first listed when ``on`` is not, named by ``primary_variant``). Every run is a
fresh 2-process world (~15-25 s on 2 x H200): a sweep of 'off' and 5 variants takes ~2-3 minutes a round,
so sweep with ``--rounds 1``.

With ``--trace`` it then profiles one more step of 'off' and of each variant per rank (torch.profiler,
after ``--warmup`` steps; bench/layout_trace_gpu.py's worker) and reports the all-to-all kernels' time and
how much of it ran beside compute kernels (``a2a_under_compute_ms``; a NCCL kernel's time includes waiting
for the peer): the direct evidence of whether the exchanges run under the partner's compute.

Routing is forced round-robin by default (Megatron's --moe-router-force-load-balancing: both EP ranks send
and receive the same rows, the all-to-all's size is the layout's, not an untrained router's skew);
``--routing random`` keeps the router's own choices.

``--layout`` / ``--gpus`` run another layout with the overlap (default ``ep2`` on 2 GPUs), e.g. ``"pp2 vpp2
ep2"`` on 4 GPUs with ``--layers 4``: under a pipeline the overlap is the pipeline's combined 1F1B
(executor/pipeline.py), whose warmup forwards and cooldown backwards have no partner; the most it can hide is
the steady share of the least paired rank (``max_hideable_fraction``). ``--micro`` stays per DP rank.

Usage: python -m bench.ep_overlap_gpu [--layers 2] [--seq 4096] [--micro 8] [--rounds 4] [--trace]
       python -m bench.ep_overlap_gpu --layout "pp2 vpp2 ep2" --gpus 4 --layers 4 --rounds 2
       python -m bench.ep_overlap_gpu --rounds 1 --variants on,on_carve8,on_carve16,on_carve32,on_nch8
       python -m bench.ep_overlap_gpu --device cpu --tiny      (CPU smoke run: gloo, tiny-moe, seq 64, fp32)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

from executor.launch_local import launch
from executor.microbench.script_args import add_start_method_argument, check_start_method
from executor.pipeline import rank_stages
from executor.microbench.ep_overlap_bar import BAR, OFF, parse_variant, summarize_runs
from executor.microbench.step_trace import trace_worker
from executor.options import ExecutorOptions
from executor.profile import profile_layout
from executor.scoped_env import scoped_env
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

def _config(layout: ParallelConfig, overlap: bool) -> ParallelConfig:
    return layout.replace(overlap_moe_expert_parallel_comm=overlap)


def hideable_fraction(layout: ParallelConfig, micro: int) -> float:
    """The most of the exposed all-to-all the overlap can hide: the share of a rank's operations that the
    combined 1F1B pairs (its steady stage), on the least paired pipeline rank ((micro - 1) / micro at pp = 1)."""
    total = micro * layout.vpp
    return min(len(rank_stages(layout.pp, layout.vpp, micro, r, combined=True).steady) for r in range(layout.pp)) / total


def run_mode(model, training: TrainingSpec, layout: ParallelConfig, overlap: bool, options: ExecutorOptions,
             device: str, warmup: int, steps: int, env: dict[str, str] | None = None,
             start_method: str = "spawn") -> dict:
    """One run of ``layout`` (a fresh world, ``env`` added to its processes' environment, its ranks started by
    ``start_method``) with the overlap ``overlap``: its Measurement as a dict."""
    config = _config(layout, overlap)
    # spawn is profile_layout's own launch (which also checks the GPU count); fork only starts CPU ranks
    launcher = None if start_method == "spawn" else functools.partial(launch, start_method=start_method)
    with scoped_env(env or {}):
        m = profile_layout(model, training, config, options, warmup_steps=warmup, timed_steps=steps,
                           timeout_s=900, device=device, launcher=launcher)
    return m.to_dict()


def trace_mode(model, training: TrainingSpec, layout: ParallelConfig, overlap: bool, options: ExecutorOptions,
               warmup: int, env: dict[str, str] | None = None, start_method: str = "spawn") -> list[dict]:
    """One profiled step per rank with the overlap ``overlap`` (a fresh world, ``env`` added to its
    environment, its ranks started by ``start_method``): wall, busy and all-to-all kernel times, and the
    all-to-all time beside compute (ms), per rank."""
    with scoped_env(env or {}):
        launched = launch(trace_worker, layout.world_size, (model, training, _config(layout, overlap), warmup, 10,
                                                            options), timeout_s=600, start_method=start_method)
    if not launched.ok:
        return [{"failure": launched.failure_reason}]
    keys = ("rank", "wall_ms", "busy_ms", "busy_without_nccl_ms", "a2a_ms", "a2a_under_compute_ms", "memcpy_ms",
            "memcpy_under_compute_ms")
    return [{k: r[k] for k in keys} for r in launched.results]


def trace_table(traces: dict[str, list[dict]]) -> str:
    width = max(4, *(len(m) for m in traces))
    lines = [f"profiled step (ms)  {'mode':>{width}} rank   wall   busy  compute  all-to-all  beside compute"
             f"  copies  beside compute"]
    for mode, ranks in traces.items():
        for r in ranks:
            if "failure" in r:
                lines.append(f"  {mode}: failed: {r['failure']}")
                continue
            lines.append(f"{'':19} {mode:>{width}} {r['rank']:>4} {r['wall_ms']:6.1f} {r['busy_ms']:6.1f} "
                         f"{r['busy_without_nccl_ms']:8.1f} {r['a2a_ms']:11.2f} {r['a2a_under_compute_ms']:15.2f}"
                         f"{r.get('memcpy_ms', 0.0):8.2f} {r.get('memcpy_under_compute_ms', 0.0):15.2f}")
    return "\n".join(lines)


def table(summary: dict, device: str) -> str:
    if "step_on" not in summary:  # 'off' or the primary variant failed: what the others measured still shows
        failed = f"{device}: a run failed: {summary['failures']}"
        return failed + ("\n" + variant_table(summary) if summary.get("variants") else "")
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    on = summary["primary_variant"]
    rows = [("step time, overlap off", ms(summary["step_off"]), ""),
            (f"step time, overlap {on}", ms(summary["step_on"]), ""),
            ("EP all-to-all exposed (off)", ms(summary["exposed_a2a_off"]), ""),
            ("EP all-to-all phase (on)", ms(summary["a2a_phase_on"]), ""),
            ("hidden fraction", f"{summary['hidden_fraction']:.3f}" if summary["hidden_fraction"] is not None
             else "n/a", f">= {BAR:.2f}  {'yes' if summary['passes'] else 'NO'}"),
            ("  at most (paired share)", f"{summary['max_hideable_fraction']:.3f}", ""),
            ("loss rel. difference off/on", f"{summary['loss_rel_diff']:.2e}", "")]
    lines = [device] + [f"{a:<32}{b:>14}  {c}" for a, b, c in rows]
    if len(summary["variants"]) > 1:
        lines.append(variant_table(summary))
    return "\n".join(lines)


def variant_table(summary: dict) -> str:
    """One line per variant: step, its gain over 'off', hidden fraction (bar), loss difference."""
    lines = [f"{'variant':<18}{'step ms':>9}{'vs off ms':>11}{'hidden':>8}  bar  {'loss diff':>9}"]
    for name, v in summary["variants"].items():
        if not v["ok"]:
            lines.append(f"{name:<18}  failed: {v['failures'][0]}")
            continue
        hidden = f"{v['hidden_fraction']:.3f}" if v["hidden_fraction"] is not None else "n/a"
        diff = f"{v['loss_rel_diff']:.1e}" if v["loss_rel_diff"] is not None else "n/a"
        lines.append(f"{name:<18}{v['step'] * 1e3:9.2f}{(summary['step_off'] - v['step']) * 1e3:11.2f}"
                     f"{hidden:>8}  {'yes' if v['passes'] else 'NO ':<3}  {diff:>9}")
    if summary.get("best_variant"):
        lines.append(f"best: {summary['best_variant']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Mixtral proxy")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per rank per step (mbs 1)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    # 2 rounds gave 0.450 where one round of the same code gave 0.674 (2 × H200, 2026-11-27): the off step
    # varied 421-436 ms and its exposed all-to-all 19-27 ms between runs, so the median takes 4
    parser.add_argument("--rounds", type=int, default=4, help="rounds of runs: off, then each variant")
    parser.add_argument("--variants", default="on",
                        help="overlap variants compared with off, comma-separated: on, on_carveN, on_nchN, "
                             "on_carveN_nchM (module docstring)")
    parser.add_argument("--routing", choices=("balanced", "random"), default="balanced")
    parser.add_argument("--layout", default="ep2", help="the layout measured with and without the overlap")
    parser.add_argument("--gpus", type=int, default=2, help="its world size")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny-moe at seq 64 (CPU smoke runs)")
    parser.add_argument("--trace", action="store_true",
                        help="also profile one step per mode: all-to-all kernel time beside compute")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_overlap_gpu.json"))
    add_start_method_argument(parser, "--device cpu")
    args = parser.parse_args()
    check_start_method(parser, args.start_method, args.device == "cpu", "--device cpu")
    try:
        variants = {v.name: v for v in map(parse_variant, filter(None, args.variants.split(",")))}
    except ValueError as exc:
        parser.error(str(exc))
    if not variants:
        parser.error("--variants names none")
    layout = ParallelConfig.parse(args.layout, world_size=args.gpus)
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        parser.error(f"needs {args.gpus} GPUs (or --device cpu)")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # one hardware queue: the waits on the
        print("warning: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises streams; the overlap may not show", flush=True)
    cuda = args.device == "cuda"
    tiny = get_model("tiny-moe") if layout.pp * layout.vpp <= 2 else get_model("tiny-moe-shared")  # 2 or 4 layers
    model = tiny if args.tiny else get_model("mixtral-8x7b").with_layers(args.layers)
    seq = 64 if args.tiny else args.seq
    # each DP rank takes ``micro`` sequences of the global batch
    training = TrainingSpec(seq_length=seq, global_batch_size=layout.dp * args.micro, precision="bf16" if cuda else "fp32")
    options = ExecutorOptions(moe_router_force_load_balancing=args.routing == "balanced")
    modes = {"off": OFF, **variants}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    head = {"torch": torch.__version__, "model": model.name, "layout": layout.label(), "seq": seq,
            "micro_per_rank": args.micro,
            "routing": args.routing, "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}

    def write(body: dict) -> None:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), **head, **body}, f, indent=1)

    for _ in range(args.rounds):  # off and the variants alternate: the card's clock drifts over seconds
        for mode, v in modes.items():
            runs[mode].append(run_mode(model, training, layout, v.overlap, v.options(options), args.device,
                                       args.warmup, args.steps, v.env(), args.start_method))
            r = runs[mode][-1]
            print(f"[{mode}] " + (f"step {r['step_time'] * 1e3:.2f} ms, ep_alltoall "
                                  f"{r['phases'].get('ep_alltoall', 0.0) * 1e3:.2f} ms" if r["ok"] else
                                  f"failed: {r.get('failure_reason')}"), flush=True)
            write({"partial": True, "runs": runs})  # a sweep cut off by its time limit keeps what it measured
    summary = summarize_runs(runs, args.micro, variants, hideable=hideable_fraction(layout, args.micro))
    traces = {mode: trace_mode(model, training, layout, v.overlap, v.options(options), args.warmup, v.env(),
                               args.start_method)
              for mode, v in modes.items()} if args.trace else None
    device = runs["off"][0].get("device", args.device) if runs["off"] else args.device
    write({"device": device, **summary, "runs": runs, **({"trace": traces} if traces else {})})
    print(table(summary, f"{device} x{layout.world_size}, {model.name}, seq {seq}, {args.micro} micro-batches/rank, "
                         f"{args.layout}"))
    if traces:
        print(trace_table(traces))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
