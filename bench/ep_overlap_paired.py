"""EP all-to-all overlap measured in paired steps of one 2-process world (issue 19's bar, without run-to-run noise).

bench/ep_overlap_gpu.py compares the overlap on and off in separate 2-process worlds. Between such worlds the
off step of the same code moved 421-436 ms and its exposed all-to-all 16-27 ms (2 x H200, 2026-11-27), as
large as the effect measured, so its hidden fraction came out 0.38-0.67 over five runs. Here one world builds
the EP2 Mixtral proxy once, with the overlap's layout (its EP group on a high-priority NCCL stream), and
switches the schedule between steps (``Trainer.ep_overlap``): steps alternate off/on in pairs, each pair's
order reversed from the last (ABBA: a drift of the card's clock over the pairs cancels), all on the same
weights, rank processes, communicators and allocator.

Per pair i (rank 0's wall time; every step ends with a loss all-reduced over both ranks):
  saved_i   = step_off_i - step_on_i
  exposed_i = the off step's ``ep_alltoall`` phase (dispatch and combine, forward and backward)
and ``hidden_fraction`` = median(saved) / median(exposed), the bar's quotient (>= 0.60) on steps measured side
by side; ``exposed`` is the phase of the rank where it is least (:func:`summarize` says why). The off steps run
with the EP stream's high priority, which a layout without the overlap would not
have; there no compute runs beside the all-to-all on that rank, so the priority has nothing to reorder.
Losses are not compared here (consecutive steps train on different batches): bench/ep_overlap_gpu.py and
tests/executor/test_ep_overlap.py check that the overlap computes the same step.

Usage: python -m bench.ep_overlap_paired [--layers 2] [--seq 4096] [--micro 8] [--pairs 12] [--warmup 2]
                                         [--transport auto|nccl|copy_engine]
       python -m bench.ep_overlap_paired --device cpu --tiny --pairs 2      (CPU smoke run: gloo, tiny-moe)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from executor.data import global_batch, micro_batches
from executor.launch_local import launch
from executor.microbench.script_args import add_start_method_argument, check_start_method
from executor.microbench.ep_overlap_bar import pair_orders, summarize_pairs
from executor.model import MoEGPT
from executor.options import EP_OVERLAP_TRANSPORTS, ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.profile import DTYPES, options_for_precision
from executor.timing import PhaseTimer
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

def paired_worker(rank: int, world_size: int, model, training: TrainingSpec, config: ParallelConfig,
                  options: ExecutorOptions, warmup_pairs: int, pairs: int) -> dict:
    """One rank: build the overlap layout, warm both schedules, then time ``pairs`` ABBA pairs. Returns per
    mode ('off', 'on') the step seconds, ``ep_alltoall`` phase seconds and losses in pair order (the losses are
    kept for the record, not compared: consecutive steps train on different batches)."""
    cuda = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    options = options_for_precision(options, training.precision)
    state = build_parallel_state(config, rank)
    timer = PhaseTimer(enabled=False, device=device)
    net = MoEGPT(model, state, options, training.seq_length, device, DTYPES[training.precision], timer)
    trainer = Trainer(net)
    dp = state.dp
    out = {"off": {"step_s": [], "ep_alltoall_s": [], "losses": [], "peak_bytes": []},
           "on": {"step_s": [], "ep_alltoall_s": [], "losses": [], "peak_bytes": []}}
    step = 0
    for index, order in enumerate(pair_orders(warmup_pairs + pairs)):
        timed = index >= warmup_pairs
        for overlap in order:
            batch = global_batch(model.vocab_size, training.seq_length, training.global_batch_size, options.seed,
                                 step)
            micro = micro_batches(batch, dp.size, dp.rank, config.micro_batch_size, device)
            trainer.ep_overlap = overlap
            timer.enabled = timed
            if cuda:
                torch.cuda.current_stream(device).synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            torch.distributed.barrier()
            timer.start_step()
            start = time.perf_counter()
            result = trainer.step(micro)  # ends with a host read of the all-reduced loss
            if cuda:
                torch.cuda.current_stream(device).synchronize()
            elapsed = time.perf_counter() - start
            phases = timer.end_step()
            step += 1
            if timed:
                mode = out["on" if overlap else "off"]
                mode["step_s"].append(elapsed)
                mode["ep_alltoall_s"].append(phases.get("ep_alltoall", 0.0))
                mode["losses"].append(result.loss)
                if cuda:
                    mode["peak_bytes"].append(torch.cuda.max_memory_allocated(device))
    trainer.finish_param_gather()
    if cuda:
        out["device"] = torch.cuda.get_device_name(device)
    return out


def table(summary: dict, head: str) -> str:
    ms = 1e3
    rows = [head,
            f"step time, overlap off (median)     {summary['step_off'] * ms:9.2f} ms",
            f"step time, overlap on (median)      {summary['step_on'] * ms:9.2f} ms",
            f"saved per pair (median; min, max)   {summary['saved_per_pair'] * ms:9.2f} ms  "
            f"({summary['saved_min'] * ms:.2f}, {summary['saved_max'] * ms:.2f}; {summary['pairs_saving']} of "
            f"{summary['pairs']} pairs save)",
            f"EP all-to-all exposed (off)         {summary['exposed_a2a_off'] * ms:9.2f} ms  (least over ranks; "
            f"rank 0 {summary['exposed_a2a_off_rank0'] * ms:.2f})",
            f"EP all-to-all phase (on)            {summary['a2a_phase_on'] * ms:9.2f} ms",
            f"hidden fraction                     {summary['hidden_fraction']:9.3f}  >= {summary['bar']:.2f}  "
            f"{'yes' if summary['passes'] else 'NO'}",
            f"  at most (micro-1)/micro           {summary['max_hideable_fraction']:9.3f}",
            f"peak allocated, rank 0 (off / on)   {summary['peak_bytes_off'] / 2**30:9.2f} / "
            f"{summary['peak_bytes_on'] / 2**30:.2f} GiB"]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Mixtral proxy")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per rank per step (mbs 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs (both schedules warmed)")
    parser.add_argument("--pairs", type=int, default=12, help="timed off/on pairs")
    parser.add_argument("--routing", choices=("balanced", "random"), default="balanced")
    parser.add_argument("--transport", choices=EP_OVERLAP_TRANSPORTS, default="auto",
                        help="what moves the overlapped all-to-alls (ExecutorOptions.ep_overlap_transport)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny-moe at seq 64 (CPU smoke runs)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_overlap_paired.json"))
    add_start_method_argument(parser, "--device cpu")
    args = parser.parse_args()
    if args.pairs < 1 or args.warmup < 0 or args.micro < 2:
        parser.error("--pairs must be >= 1, --warmup >= 0 and --micro >= 2 (the overlap pairs micro-batches)")
    check_start_method(parser, args.start_method, args.device == "cpu", "--device cpu")
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        parser.error("needs 2 GPUs (or --device cpu)")
    model = get_model("tiny-moe") if args.tiny else get_model("mixtral-8x7b").with_layers(args.layers)
    seq = 64 if args.tiny else args.seq
    training = TrainingSpec(seq_length=seq, global_batch_size=2 * args.micro, precision="bf16" if cuda else "fp32")
    config = ParallelConfig.parse("ep2", world_size=2).replace(overlap_moe_expert_parallel_comm=True)
    options = ExecutorOptions(moe_router_force_load_balancing=args.routing == "balanced",
                              ep_overlap_transport=args.transport)
    print(f"{model.name}, seq {seq}, {args.micro} micro-batches/rank, EP2: {args.warmup} warm-up and {args.pairs} "
          f"timed off/on pairs in one world ...", flush=True)
    launched = launch(paired_worker, 2, (model, training, config, options, args.warmup, args.pairs),
                      backend="nccl" if cuda else "gloo", timeout_s=900, start_method=args.start_method)
    if not launched.ok:
        print(f"failed: {launched.failure_reason}", file=sys.stderr)
        return 1
    report = launched.results[0]
    summary = summarize_pairs(launched.results, args.micro)
    device = report.get("device", "cpu")
    with open(args.out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
                   "device": device, "model": model.name, "seq": seq, "micro_per_rank": args.micro,
                   "routing": args.routing, "transport": args.transport, "warmup_pairs": args.warmup, **summary,
                   "ranks": launched.results},
                  f, indent=1)
    print(table(summary, f"{device} x2, {model.name}, seq {seq}, {args.micro} micro-batches/rank, EP2, paired, "
                         f"overlap over {args.transport}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
