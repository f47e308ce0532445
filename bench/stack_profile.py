"""Profile of the Mixtral-shaped decoder stack fwd+bwd, each issue-19 switch on and off, in one run.

The stack is bench/executor_gpu.py's "stack" part: ``--layers`` Mixtral-8x7B decoder layers (GQA 32/8, MoE
8 experts top-2 with its random-weight router), seq 4096, micro-batch 1, bf16, one GPU, fwd+bwd of the layers
alone (no embedding, LM head or loss; a fixed output gradient). Its FLOPs are Megatron's for those layers
(spec.flops, less the logits), and the bar divides the achieved FLOP/s by the dense bf16 GEMM's (8192³)
measured in the same run.

Variants (``--variants``; each one ExecutorOptions plus how the gradients are handled):
  before      fused_qkv, fused_rope, fused_rms_norm off; parameter ``.grad`` kept and accumulated in place every step, as
              executor_gpu's stack part timed it up to issue 19 (the 0.64)
  grads_none  the same kernels, gradients set to None before each fwd+bwd, as a training step's first
              micro-batch and executor_gpu's MoE part do (the weight-gradient GEMMs write fresh tensors)
  qkv         grads_none + fused_qkv (one Q/K/V GEMM)
  rope        qkv + fused_rope (one Triton launch for q and k)
  after       rope + fused_rms_norm (the defaults)
  cudnn       after + attention_backend 'cudnn' (SDPA's cuDNN kernel first)
  graphs      after + cuda_graphs (the attention half replayed from CUDA graphs)
  cudnn_graphs  both
  after_balanced  after with the router's load balancing forced (experts round-robin, as the MoE-layer bar
              runs): what the random-weight router's uneven expert groups cost the stack (diagnostic)
Every variant runs on the same parameter tensors. Timing: ``isolated_s`` is executor_gpu's method (sync
before each fwd+bwd, median of 8); ``steady_s`` the median over ``--rounds`` alternated windows of ``--iters``
back-to-back steps (every variant sees the same card clock; bench/power_probe.py); ``host_s`` the host's time
to issue one step. ``ratio`` = stack FLOP/s (steady) / GEMM FLOP/s, ``ratio_isolated`` the same isolated.
The GEMM (8192³, ``gemm``) is timed in short bursts from an idle card, as the bar's denominator always was; the
same GEMM is also timed as one more entry of the alternated steady windows (``gemm_steady``: back-to-back
products about one stack step long, at the power-capped clock the stack runs at), and ``ratio_steady_gemm``
divides by that: how far the stack is from the GEMM at equal clock (a diagnostic beside the bar).
``top_kernels``: torch.profiler over ``--profile-steps`` steps, the 15 device kernels with the largest total
time: name, calls per step, ms per step, % of the step's kernel time; on a GPU also ``timeline``: the
profiled steps' span, busy and idle device time per step, the longest idle gaps with the host events across
them, and the calls of one step that make the host wait for the device (torch's sync debug mode).
``graphs_by_seq``: 'after' and 'graphs' at micro-batch 1 and shorter sequences (``--graph-seqs``), where the
host's launch rate, not the GPU, limits the step: step seconds with and without the graphs.

Usage (one GPU):  python -m bench.stack_profile --layers 2 --out $OUT/stack_profile.json
CPU smoke run:    python -m bench.stack_profile --device cpu --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import traceback

import torch

from executor.kernels import triton_rms_norm, triton_rope
from executor.microbench.device_timeline import format_timeline
from executor.microbench.stack_variants import (VARIANTS, GemmLoop, Stack, build_stack, gemm_tflops, stack_flops,
                                                time_variants, top_kernels)
from executor.microbench.sync_debug import synchronizing_calls
from spec.catalog import get_model
from spec.errors import SpecError

def format_kernels(name: str, rows: list[dict]) -> str:
    lines = [f"top kernels, {name}:", f"  {'kernel':<90}{'calls':>7}{'ms':>9}{'%':>7}"]
    lines += [f"  {r['name'][:88]:<90}{r['calls']:>7.1f}{r['ms']:>9.3f}{r['pct']:>7.1f}" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", default="before,grads_none,after,cudnn",
                        help="variants whose top kernels are profiled")
    parser.add_argument("--graph-seqs", default="1024,256", help="shorter sequences for graphs on/off ('' skips)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny-moe layers, seq 64, fp32 (CPU smoke run)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "stack_profile.json"))
    args = parser.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        spec, seq, n_gemm = get_model("tiny-moe").with_layers(args.layers), 64, 256
    else:
        spec, seq, n_gemm = get_model("mixtral-8x7b").with_layers(args.layers), args.seq, 8192
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "model": spec.name,
              "layers": args.layers, "seq": seq, "mbs": args.mbs, "dtype": str(dtype).replace("torch.", ""),
              "flops": stack_flops(spec, seq, args.mbs), "variants": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    report["gemm"] = gemm_tflops(dev, dtype, n_gemm)
    gemm = report["gemm"]["tflops"]
    stacks: list[Stack] = []
    base = None
    for name in args.variants.split(","):
        try:
            stack = build_stack(name, spec, seq, args.mbs, dev, dtype, base)
            stack.step()  # first use: captures, compiles, checks
        except SpecError as exc:
            report["variants"][name] = {"refused": str(exc)}
            print(f"[{name}] refused: {exc}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001  (one failing variant must not lose the others)
            traceback.print_exc()
            report["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        base = base if base is not None else stack.layers
        stacks.append(stack)
        report["variants"][name] = {"options": dataclasses.asdict(stack.options), "grads": stack.grads}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the same GEMM in the alternated windows, ~35 ms a step on a GPU (a Mixtral stack step's length)
    loop = GemmLoop("dense_gemm_steady", torch.randn(n_gemm, n_gemm, device=dev, dtype=dtype),
                    torch.randn(n_gemm, n_gemm, device=dev, dtype=dtype),
                    max(1, round(0.035 / report["gemm"]["seconds"])) if cuda else 2)
    timings = time_variants([*stacks, loop], dev, args.rounds, args.iters)
    steady_gemm = loop.tflops(timings.pop(loop.name)["steady_s"])
    report["gemm_steady"] = {"reps": loop.reps, "tflops": steady_gemm}
    del loop
    for name, timing in timings.items():
        v = report["variants"][name]
        v.update(timing)
        v["tflops"] = report["flops"] / v["steady_s"] / 1e12
        v["ratio"] = v["tflops"] / gemm
        v["ratio_isolated"] = report["flops"] / v["isolated_s"] / 1e12 / gemm
        v["ratio_steady_gemm"] = v["tflops"] / steady_gemm
    if cuda:
        report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    # first-use self-checks of the fused kernels (key -> passed): a False means that variant ran torch's path
    report["fused_checks"] = {str(k): ok for cache in (triton_rope._CHECKED, triton_rms_norm._CHECKED)
                              for k, ok in cache.items()}
    save()
    # CUDA graphs where the host limits: shorter sequences, micro-batch 1
    report["graphs_by_seq"] = {}
    names = [n for n in ("after", "graphs") if n in {s.name for s in stacks}]
    for short in [int(s) for s in args.graph_seqs.split(",") if s] if len(names) == 2 else []:
        try:
            short_stacks = [build_stack(n, spec, short, 1, dev, dtype, base) for n in names]
            for stack in short_stacks:
                stack.step()
            timing = time_variants(short_stacks, dev, args.rounds, max(args.iters, 20))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            report["graphs_by_seq"][str(short)] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        entry = {n: {k: timing[n][k] for k in ("steady_s", "isolated_s", "host_s")} for n in names}
        entry["graphs_speedup_steady"] = timing["after"]["steady_s"] / timing["graphs"]["steady_s"]
        report["graphs_by_seq"][str(short)] = entry
        del short_stacks
        save()

    print(f"\n{report['device']}  torch {report['torch']}  {report['model']} x{args.layers} layers, seq {seq}, "
          f"mbs {args.mbs}, {report['dtype']}; GEMM {gemm:.0f} TFLOP/s (in the steady windows "
          f"{report['gemm_steady']['tflops']:.0f})")
    print(f"{'variant':<14}{'steady ms':>10}{'isolated ms':>12}{'host ms':>9}{'TFLOP/s':>9}{'ratio':>7}{'ratio iso':>10}"
          f"{'vs steady GEMM':>15}")
    for name, v in report["variants"].items():
        if "steady_s" in v:
            print(f"{name:<14}{v['steady_s'] * 1e3:>10.2f}{v['isolated_s'] * 1e3:>12.2f}{v['host_s'] * 1e3:>9.2f}"
                  f"{v['tflops']:>9.1f}{v['ratio']:>7.3f}{v['ratio_isolated']:>10.3f}{v['ratio_steady_gemm']:>15.3f}")
        else:
            print(f"{name:<14}{v.get('refused') or v.get('error')}")
    for short, entry in report["graphs_by_seq"].items():
        if "error" in entry:
            print(f"seq {short}: {entry['error']}")
            continue
        print(f"seq {short}: after {entry['after']['steady_s'] * 1e3:.3f} ms (host {entry['after']['host_s'] * 1e3:.3f}), "
              f"graphs {entry['graphs']['steady_s'] * 1e3:.3f} ms (host {entry['graphs']['host_s'] * 1e3:.3f}): "
              f"x{entry['graphs_speedup_steady']:.3f}")
    save()
    # profiles last: a profiler failure (CUPTI) loses no timing
    for stack in stacks:
        if stack.name in args.profile.split(","):
            try:
                rows, timeline = top_kernels(stack, dev, args.profile_steps)
                report["variants"][stack.name]["top_kernels"] = rows
                print(format_kernels(stack.name, rows), flush=True)
                if timeline is not None:
                    timeline["synchronizing_calls"] = synchronizing_calls(stack.step)
                    report["variants"][stack.name]["timeline"] = timeline
                    print(format_timeline(timeline), flush=True)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                report["variants"][stack.name]["top_kernels_error"] = f"{type(exc).__name__}: {exc}"
    save()

    return 0


if __name__ == "__main__":
    sys.exit(main())
