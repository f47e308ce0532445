"""fp8 against bf16 for whole training steps (issue 19's bar): the Mixtral-shaped 2-layer proxy on one GPU.

Each precision trains the same proxy (mixtral-8x7b with 2 layers, seq 4096, global batch 4 of micro-batch 1:
four micro-batches a step) from the same initial weights (the executor's seeded init) on the same token
batches for ``--steps`` steps (50 by default), then profiles two more steps with ``torch.profiler``.

Runs (``--runs``; the first three are the default): ``bf16``, ``fp8``, ``fp8_fast_accum`` (fp8 with
FOLDTUNE_FP8_FAST_ACCUM=1: the forward GEMMs' fast accumulation, Transformer Engine's recipe; off by default
until this run shows its losses within the bar), ``fp8_fp8_wgrad`` (fp8 with FOLDTUNE_FP8_WGRAD=fp8: the
expert wgrad in fp8 too, with its two per-expert quantisations; the default runs it in bf16), and two controls for a loss drift: ``fp8_emulated`` (the
CPU path on the GPU: torch quantisation, GEMMs dequantised to fp32; no speed claim), against which each
fp8 run's losses are also compared (a kernel fault shows as fp8 drifting from it; e4m3 rounding itself as
the two agreeing), and ``bf16_torch_ce`` (bf16 with the unfused torch cross-entropy: only the fp32
summation order differs), the noise floor: its difference from bf16 is what a rounding change alone does
to the trajectory; ``bf16_again`` (bf16 once more, the same code, weights and batches in a process of its own):
its difference from bf16 is the run-to-run spread of the GPU's non-deterministic kernels (0 on the CPU);
``fp8_gg_rowwise`` and ``fp8_gg_blockwise`` (fp8 with the experts' forward, dgrad and wgrad on foldtune's
grouped fp8 kernels, rowwise or DeepSeek-V3 blockwise scaling: ``ExecutorOptions.fp8_expert_gemm``), and
``fp8_gg_auto`` (its 'auto': rowwise, forward and dgrad on the faster per shape of foldtune's and torch's kernel). ``--lr`` sets Adam's learning rate (1e-3, the Trainer's default).

Reported per precision: tokens/s (global batch · seq over the median step time of the steps after
``--warmup``), the losses, peak memory, how the fp8 GEMMs ran and the top-10 kernels by device time; then
fp8's speed-up over bf16 (tokens/s ratio; the bar is >= 1.25), the largest relative loss difference over
all the steps (the bar is <= 1 %) and ``bf16_max_rise``: the largest relative rise of bf16's loss above
its lowest earlier value (a reference that spikes is in a regime where any rounding change moves the
trajectory about as much, so the loss bar then says little about fp8; on random tokens it also holds the
batch-to-batch spread, small at 4 × 4096 tokens, large in ``--tiny``). Each precision runs in a process
of its own (``executor.launch_local``), one after the other.

``--tiny``: tiny-moe at seq 64 on the CPU (fp8 emulated), 6 steps: a smoke test of the script, no timing
claim. On an H100 the default run should take about 2-3 minutes (three builds, 3 × 52 steps of about 0.3 s).

Usage (GPU): python3 -m bench.fp8_step --out $OUT/fp8_step.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

from executor.data import global_batch, micro_batches
from executor.kernels import fp8
from executor.kernels.fp8 import expert_pick, gemm, grouped_gemm, quantize
from executor.launch_local import launch
from executor.microbench.script_args import add_start_method_argument, check_start_method
from executor.microbench.fp8_step_bar import BAR_LOSS, BAR_SPEEDUP, compare, max_rel_diff
from executor.microbench.timing import synchronize
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.profile import DTYPES, options_for_precision
from executor.scoped_env import scoped_env
from executor.timing import PhaseTimer
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

# runs: label -> (precision, environment of its process); each fp8 run is compared with bf16
# bf16_torch_ce: bf16 with the torch cross-entropy instead of the fused kernel (the same math up to fp32
# summation order): how far a rounding change alone moves the losses — the noise floor of the loss bar.
# fp8_emulated: the torch quantisation and the fp32 emulation of the GEMMs (the CPU path) on the GPU — the
# control that tells a kernel fault (fp8 drifts from fp8_emulated) from e4m3 rounding itself (they agree)
RUNS = {"bf16": ("bf16", {}), "fp8": ("fp8", {}),
        "fp8_fast_accum": ("fp8", {"FOLDTUNE_FP8_FAST_ACCUM": "1"}),
        "fp8_fp8_wgrad": ("fp8", {"FOLDTUNE_FP8_WGRAD": "fp8"}),
        "fp8_emulated": ("fp8", {"FOLDTUNE_FP8_KERNELS": "0", "FOLDTUNE_FP8_TRITON": "0"}),
        "bf16_torch_ce": ("bf16", {"FOLDTUNE_FUSED_CROSS_ENTROPY": "0"}),
        "bf16_again": ("bf16", {}),
        "fp8_gg_rowwise": ("fp8", {}), "fp8_gg_blockwise": ("fp8", {}), "fp8_gg_auto": ("fp8", {}),
        "fp8_fastest": ("fp8", {})}
# runs with executor options of their own: foldtune's grouped fp8 GEMM for the experts (ExecutorOptions.fp8_expert_gemm)
# 'fp8' and its variants keep torch's kernel for every expert GEMM (their meaning before 'fastest' became the
# default); 'fp8_fastest' runs each expert shape in fp8 or bf16, whichever timed faster
RUN_OPTIONS = {**{run: {"fp8_expert_gemm": "torch"}
                  for run in ("fp8", "fp8_fast_accum", "fp8_fp8_wgrad", "fp8_emulated")},
               "fp8_fastest": {"fp8_expert_gemm": "fastest"},
               "fp8_gg_rowwise": {"fp8_expert_gemm": "foldtune-rowwise"},
               "fp8_gg_blockwise": {"fp8_expert_gemm": "foldtune-blockwise"},
               "fp8_gg_auto": {"fp8_expert_gemm": "auto"}}
EMULATED_TIMEOUT_S = 600  # the emulation dequantises every weight to fp32 per GEMM: several times slower
TOP_KERNELS = 10


def _top_kernels(prof, device: torch.device, n: int = TOP_KERNELS) -> list[dict]:
    """The ``n`` events with the most self device time (CPU time on the CPU), per profiled step, in ms."""
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if device.type == "cuda":  # the kernels themselves, not also the CPU ops that launched them
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        events = kernels or events
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    return [{"name": e.key[:90], "ms": getattr(e, attr) / 1e3, "calls": e.count, "share": getattr(e, attr) / total}
            for e in events[:n]]


def step_worker(rank: int, world_size: int, model_name: str, layers: int, training: TrainingSpec, steps: int,
                warmup: int, profile_steps: int, use_cuda: bool, lr: float = 1e-3, top: int = TOP_KERNELS,
                recompute: str = "none", option_overrides: dict | None = None, micro_batch_size: int = 1) -> dict:
    """One precision's run on one device: ``steps`` timed-and-logged steps, then ``profile_steps`` profiled;
    the ``top`` kernels by device time are reported; ``recompute``: the layout's recompute granularity;
    ``option_overrides``: ExecutorOptions fields of the run; ``micro_batch_size``: sequences a micro-batch."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    spec = get_model(model_name)
    spec = spec.with_layers(layers) if layers else spec
    config = ParallelConfig(world_size=1, recompute_granularity=recompute, micro_batch_size=micro_batch_size)
    options = options_for_precision(ExecutorOptions.for_training(training, model=spec, **(option_overrides or {})),
                                    training.precision)
    state = build_parallel_state(config, rank)
    net = MoEGPT(spec, state, options, training.seq_length, device, DTYPES[training.precision],
                 PhaseTimer(enabled=False, device=device))
    trainer = Trainer(net, lr=lr)

    def run_step(step: int) -> tuple[float, float]:
        batch = global_batch(spec.vocab_size, training.seq_length, training.global_batch_size, options.seed, step)
        micro = micro_batches(batch, 1, 0, config.micro_batch_size, device)
        synchronize(device)
        start = time.perf_counter()
        loss = trainer.step(micro).loss  # ends with a host read of the loss
        synchronize(device)
        return time.perf_counter() - start, loss

    times, losses = [], []
    for step in range(steps):
        elapsed, loss = run_step(step)
        times.append(elapsed)
        losses.append(loss)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + ([torch.profiler.ProfilerActivity.CUDA] if use_cuda else [])) as prof:
        for step in range(steps, steps + profile_steps):
            run_step(step)
    top = _top_kernels(prof, device, top)
    for row in top:
        row["ms"] /= max(profile_steps, 1)
    timed = times[warmup:] or times
    step_s = statistics.median(timed)
    report = {"precision": training.precision, "kernel_backend": options.kernel_backend, "layout": config.label(),
              "step_times": times,
              "losses": losses, "median_step_s": step_s,
              "tokens_per_s": training.global_batch_size * training.seq_length / step_s,
              "top_kernels_per_step": top}
    if training.precision == "fp8":
        # the first-use checks' verdicts (True: the path ran; False: it failed its check and the fallback ran)
        checks = {" ".join(map(str, k)): v for k, v in {**quantize._CHECKED, **gemm._CHECKED,
                                                         **grouped_gemm._CHECKED}.items()}
        report["fp8"] = {"emulated_because": fp8.emulation_reason(device), "gemm_calls": fp8.gemm_counts(),
                         "grouped_gemm_calls": grouped_gemm.counts(), "expert_gemm": options.fp8_expert_gemm,
                         "expert_gemm_shapes": expert_pick.report(),
                         "weight_quantisations": fp8.weight_counts(), "first_use_checks": checks}
    if use_cuda:
        report.update(peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                      device_name=torch.cuda.get_device_name(device))
    return report


def table(res: dict) -> str:
    lines = [f"{res['model']} ({res['layers']} layers), seq {res['seq']}, global batch {res['global_batch']} "
             f"(micro-batch 1), {res['steps']} steps, device {res['device']}"]
    for label in RUNS:
        r = res.get(label)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"  {label}: FAILED {r['error'][:300]}")
            continue
        mem = f"  peak {r['peak_allocated_gib']:.1f} GiB" if "peak_allocated_gib" in r else ""
        lines.append(f"  {label}: {r['tokens_per_s']:.0f} tokens/s, step {r['median_step_s'] * 1e3:.1f} ms{mem}, "
                     f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
        if "fp8" in r:
            lines.append(f"    fp8: emulated because {r['fp8']['emulated_because']}; GEMMs {r['fp8']['gemm_calls']}; "
                         f"experts on {r['fp8'].get('expert_gemm')}, grouped {r['fp8'].get('grouped_gemm_calls')}; "
                         f"weights {r['fp8']['weight_quantisations']}; checks {r['fp8']['first_use_checks']}")
        lines.append(f"    top {TOP_KERNELS} kernels, ms per step (share of device time):")
        lines.extend(f"      {k['ms']:8.2f}  {k['share']:6.1%}  x{k['calls']:<5} {k['name']}"
                     for k in r["top_kernels_per_step"][:TOP_KERNELS])
    for label, cmp in res.get("compare", {}).items():
        lines.append(f"{label} / bf16 tokens/s: {cmp['speedup']:.3f} (bar {BAR_SPEEDUP}: "
                     f"{'met' if cmp['speedup_ok'] else 'NOT met'}); max relative loss difference "
                     f"{cmp['max_rel_loss_diff']:.2e} (bar {BAR_LOSS}: {'met' if cmp['loss_ok'] else 'NOT met'}); "
                     f"bf16's loss rose up to {cmp['bf16_max_rise']:.2e} above its earlier low")
    for label, diff in res.get("against_emulated", {}).items():
        lines.append(f"{label} against fp8_emulated: max relative loss difference {diff:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny-moe on the CPU, fp8 emulated (a smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="logged steps per precision (50; tiny 6)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    parser.add_argument("--global-batch", type=int, default=4, help="micro-batches of 1 sequence per step")
    parser.add_argument("--runs", default="bf16,fp8,fp8_fast_accum",
                        help="which runs, in order (bf16 first: the others are compared with it): " + ", ".join(RUNS))
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the Trainer's default)")
    parser.add_argument("--recompute", choices=("none", "full"), default="none",
                        help="recompute granularity of the one-GPU layout (default: none; full re-runs every layer's forward)")
    parser.add_argument("--top", type=int, default=TOP_KERNELS,
                        help=f"kernels kept per run in the JSON, by device time (the table prints {TOP_KERNELS})")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_step.json"))
    add_start_method_argument(parser, "--tiny")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be at least 1, got {args.top}")
    check_start_method(parser, args.start_method, args.tiny, "--tiny")
    use_cuda = not args.tiny
    if use_cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    model_name, layers, seq = ("tiny-moe", 0, 64) if args.tiny else ("mixtral-8x7b", 2, 4096)
    steps = args.steps if args.steps is not None else (6 if args.tiny else 50)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "model": model_name, "layers": layers or "all", "seq": seq,
           "global_batch": args.global_batch, "steps": steps,
           "lr": args.lr, "recompute": args.recompute, "device": torch.cuda.get_device_name(0) if use_cuda else "cpu",
           "command": " ".join(sys.argv)}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown or "bf16" not in runs:
        parser.error(f"--runs must name bf16 and known runs ({', '.join(RUNS)}), got {args.runs}")
    for label in ["bf16"] + [r for r in runs if r != "bf16"]:
        precision, env = RUNS[label]
        training = TrainingSpec(seq_length=seq, global_batch_size=args.global_batch, precision=precision)
        with scoped_env(env):  # the run's process inherits it
            launched = launch(step_worker, 1, (model_name, layers, training, steps, min(args.warmup, steps - 1), 2,
                                               use_cuda, args.lr, args.top, args.recompute, RUN_OPTIONS.get(label)),
                              backend="nccl" if use_cuda else "gloo",
                              timeout_s=EMULATED_TIMEOUT_S if label == "fp8_emulated" else 200,
                              start_method=args.start_method)
        res[label] = launched.results[0] if launched.ok else {"error": launched.failure_reason}
        if label != "bf16" and "error" not in res["bf16"] and "error" not in res[label]:
            res.setdefault("compare", {})[label] = compare(res["bf16"], res[label])
        save()
    emulated = res.get("fp8_emulated", {})
    if "losses" in emulated:
        res["against_emulated"] = {label: max_rel_diff(res[label]["losses"], emulated["losses"])
                                   for label in runs if label != "fp8_emulated" and RUNS[label][0] == "fp8"
                                   and "losses" in res[label]}
        save()
    print(table(res))
    return 0 if len(res.get("compare", {})) == len(runs) - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
