"""GPU benchmark of the executor against ceilings measured in the same run on the same GPU.

Parts (each prints a row; everything lands in $OUT/executor_gpu.json, or --out):
  gemm      dense bf16 GEMM 8192³ TFLOP/s (the ceiling of the stack bar)
  moe       MoE layer fwd+bwd (router, dispatch, grouped experts, combine, shared expert) vs the ideal expert
            FFN (three separate grouped GEMMs — gate, up, down — + SwiGLU, fwd+bwd, on pre-permuted, perfectly
            balanced tokens; the layer fuses gate and up into one GEMM, the ideal keeps three; with a shared
            expert the ideal adds its three dense GEMMs + SwiGLU fwd+bwd on the same tokens), one row per
            MOE_SHAPES entry (--shapes picks some), seq 4096, bf16:
              mixtral        h4096, ffn 14336, 8 experts, top-2, softmax                          bar ≥ 0.95
              qwen3-30b-a3b  h2048, ffn 768, 128 experts, top-8, softmax (Qwen3's normalised top-k)  bar ≥ 0.90
              deepseek-v3    h7168, ffn 2048, 32 of its 256 experts, top-8, sigmoid scores with group-limited
                             top-k (8 groups of 4 experts, best 4 groups), top-k scaling 2.5, expert bias, shared
                             expert ffn 2048                                                     bar ≥ 0.90
            (the keys moe_finegrained* of earlier results are the qwen3-30b-a3b shape, then with bar 0.85;
            executor/microbench/moe_bar.py says why 32 experts on one GPU stand for one EP8 rank of the real model).
            The headline ``ratio`` is the layer with its
            router's load balancing forced (scores and probabilities computed, experts assigned round-robin:
            Megatron's --moe-router-force-load-balancing, as its published MoE-layer baselines run), so the
            layer and the ideal do the same GEMM work and the ratio is what routing and permutation cost. It
            is timed in steady state (20 fwd+bwd back to back between two events, as inside a training step,
            where the host runs ahead and the router's launch latency hides behind the previous layer's
            kernels), layer and ideal in 6 alternated windows (the card's power-limited clock drifts by several
            % over seconds, see bench/power_probe.py; alternating gives both the same clock), the median of
            the rounds' ratios. ``random_ratio``: the random-weight router's own choices, whose uneven expert
            groups also slow the grouped GEMM itself (``uneven_ideal_over_ideal``; ``random_vs_uneven_ideal``
            compares the layer with the ideal on those groups). ``sequential_ratio`` is the earlier timing
            (layer's windows, then the ideal's); ``isolated_ratio`` times each fwd+bwd from an idle device
            (sync per iteration, launch latency exposed); ``host_issue_s`` shows when the host is the limit.
            Also at 8192 tokens (mbs 2 x seq 4096: keys moe_<shape>_mbs2; no bar)
  stack     Mixtral-8x7B-shaped decoder layers (GQA 32/8) fwd+bwd TFLOP/s vs the dense GEMM, bar ≥ 0.70 (issue 19),
            with peak memory; gradients set to None before each fwd+bwd as part_moe does (a training step's first
            micro-batch), and beside it the earlier timing that accumulated into .grad in place
            (tflops_grads_accumulated). bench/stack_profile.py profiles it, each speed switch on and off
  check     NCCL equivalence: EP2 and TP2 on 2 GPUs (fp32) vs the CPU single-process reference
  ep2       full training step (proxy with --layers layers) on 1 GPU vs EP2 on 2 GPUs:
            per-GPU tokens/s ratio, bar ≥ 0.90
  moe_breakdown (not in the default list) each MoE shape cut into router / permute / grouped GEMMs (gate+up
            fused, down) / SwiGLU / combine and their backward, each timed alone on the device and inline in a step,
            random vs round-robin routing, plus the ideal on the random routing's uneven group sizes
            (executor/microbench/moe_stages.py); prints a table per shape. moe_breakdown_unfused: the same with
            FOLDTUNE_FUSED_ROUTER/PERMUTE/SWIGLU=0 (the torch paths), for an A/B per stage
Usage: python -m bench.executor_gpu [--parts gemm,moe,stack,check,ep2] [--layers 2]
                                   [--shapes mixtral,qwen3-30b-a3b,deepseek-v3]
       python -m bench.executor_gpu --device cpu --tiny --parts moe,moe_breakdown   (CPU smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

from executor.attention import rope_tables
from executor.dispatcher import permute, slot_rows, unpermute
from executor.kernels import get_backend
from executor.launch_local import launch
from executor.microbench.moe_bar import MOE_SHAPES, SEQ, TINY_MOE_SHAPES, TINY_SEQ, MoEShape, bar_inputs, moe_bar
from executor.microbench.moe_stages import breakdown, format_table
from executor.microbench.timing import time_device
from executor.model import DecoderLayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.profile import profile_layout
from executor.scoped_env import scoped_env
from executor.timing import NULL_TIMER
from executor.verify import Scenario, compare, layout_worker, reference
from spec.catalog import get_model
from spec.flops import flops_per_token
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

DEV = torch.device("cuda", 0)  # --device cpu (smoke runs) replaces it, and BF16 by fp32
BF16 = torch.bfloat16


STEADY_ITERS = 20
STACK_BAR = 0.70  # issue 19: decoder stack fwd+bwd FLOP/s / dense GEMM FLOP/s
PAIRED_ROUNDS = 6


def timeit(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn`` over ``iters`` runs timed with CUDA events, after ``warmup`` runs."""
    return time_device(fn, DEV, warmup, iters)


FUSED_SWITCHES = ("FOLDTUNE_FUSED_PERMUTE", "FOLDTUNE_FUSED_ROUTER", "FOLDTUNE_FUSED_SWIGLU")


@contextlib.contextmanager
def torch_paths():
    """Inside: the torch router, permutation and SwiGLU paths instead of the fused Triton kernels (A/B)."""
    with scoped_env({name: "0" for name in FUSED_SWITCHES}):
        yield


def part_gemm() -> dict:
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=BF16)
    b = torch.randn(n, n, device=DEV, dtype=BF16)
    t = timeit(lambda: a @ b, 5, 20)
    return {"shape": [n, n, n], "seconds": t, "tflops": 2 * n**3 / t / 1e12}


def part_moe(shape: MoEShape, seq: int = SEQ, mbs: int = 1) -> dict:
    """The MoE bar of ``shape`` on ``seq·mbs`` tokens (:func:`executor.microbench.moe_bar.moe_bar`)."""
    return moe_bar(shape, seq, mbs, DEV, BF16, steady_iters=STEADY_ITERS, paired_rounds=PAIRED_ROUNDS)


def part_moe_breakdown(shape: MoEShape) -> dict:
    """Each MoE sub-step fwd and bwd timed alone and inline, random vs balanced routing, the ideal on the
    random routing's uneven group sizes (executor/microbench/moe_stages.py)."""
    result = breakdown(shape.spec, tokens=SEQ, dev=DEV, dtype=BF16, options=shape.options())
    print(format_table(f"moe_breakdown {shape.spec.name}", result), flush=True)
    return result


def part_trace(shape: MoEShape, tokens: int = 4096) -> dict:
    """Top CUDA kernels of one MoE layer fwd+bwd (torch.profiler), to see where the overhead goes."""
    bar = bar_inputs(shape.spec, tokens, 1, DEV, BF16, shape.options())
    layer, x, gy = bar.layer, bar.x, bar.gy
    for _ in range(3):
        layer(x)[0].backward(gy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            layer(x)[0].backward(gy)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(table)
    return {"top_kernels": table.splitlines()[:30]}


def part_router_gemm(tokens: int = 4096) -> dict:
    """Router logits [tokens, experts] = x·Wᵀ: cuBLAS picks a GEMV-like kernel for few experts; compare forms."""
    out = {}
    for h, e in ((4096, 8), (2048, 128)):
        x = torch.randn(tokens, h, device=DEV, dtype=BF16)
        w = torch.randn(e, h, device=DEV, dtype=BF16)
        wt = w.t().contiguous()
        pad = torch.zeros(max(e, 64), h, device=DEV, dtype=BF16)
        pad[:e] = w
        forms = {
            "linear_us": lambda x=x, w=w: torch.nn.functional.linear(x, w),
            "w_xt_us": lambda x=x, w=w: (w @ x.t()).t(),
            "x_wt_us": lambda x=x, wt=wt: x @ wt,
            "padded64_us": lambda x=x, pad=pad, e=e: torch.nn.functional.linear(x, pad)[:, :e],
        }
        out[f"h{h}_e{e}"] = {name: timeit(fn, 5, 50) * 1e6 for name, fn in forms.items()}
    return out


def part_fused_check() -> dict:
    """Fused (Triton) vs torch unpermute/permute-backward on random data with dropped slots: max abs error."""
    out = {}
    for n, k, h, e in ((4096, 8, 2048, 128), (4096, 2, 4096, 8)):
        x = torch.randn(n, h, device=DEV, dtype=BF16, requires_grad=True)
        experts = torch.randint(0, e + 1, (n, k), device=DEV)  # id e = dropped
        probs = torch.rand(n, k, device=DEV, requires_grad=True)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        slots = order[: int((flat < e).sum())]
        rows = slot_rows(slots, n, k)
        g = torch.randn(n, h, device=DEV, dtype=BF16)
        results = []
        for flag in ("0", "1"):
            os.environ["FOLDTUNE_FUSED_PERMUTE"] = flag
            y = permute(x, slots, rows, k) * 1.5
            o = unpermute(y, probs, slots, rows)
            results.append((o,) + torch.autograd.grad(o, (x, probs), g))
        os.environ.pop("FOLDTUNE_FUSED_PERMUTE")
        out[f"n{n}_k{k}_h{h}"] = [float((a.detach().float() - b.detach().float()).abs().max() / (b.detach().float().abs().max() + 1e-12))
                                  for a, b in zip(results[1], results[0])]
    return out


def part_stack(layers: int, seq: int = 4096) -> dict:
    spec = get_model("mixtral-8x7b").with_layers(layers)
    state = single_process_state()
    opts = ExecutorOptions()
    kernels = get_backend("torch")
    stack = torch.nn.ModuleList(DecoderLayer(spec, opts, state, i, True, kernels, DEV, BF16, NULL_TIMER)
                                for i in range(layers))
    rope = rope_tables(seq, spec.rotary_head_dim, opts.rotary_base, DEV)
    x = torch.randn(seq, 1, spec.hidden_size, device=DEV, dtype=BF16, requires_grad=True)
    gy = torch.randn_like(x)

    def step(set_none: bool = True):
        if set_none:  # as a training step's first micro-batch and part_moe: the wgrad GEMMs write fresh grads
            for p in stack.parameters():
                p.grad = None
            x.grad = None
        y = x
        for layer in stack:
            y, _ = layer(y, rope)
        y.backward(gy)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = timeit(step, 2, 8)
    peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    # up to issue 19 the stack kept every .grad and accumulated into it in place (2.8 GB of expert
    # gradients per layer read twice and written once per step): reported beside, not the bar
    t_accumulated = timeit(lambda: step(False), 2, 8)
    per_token = flops_per_token(spec, seq) - 3 * 2 * spec.hidden_size * spec.padded_vocab_size()
    flops = per_token * seq
    result = {"layers": layers, "seq": seq, "seconds": t, "tflops": flops / t / 1e12,
              "seconds_grads_accumulated": t_accumulated, "tflops_grads_accumulated": flops / t_accumulated / 1e12,
              "options": {k: getattr(opts, k) for k in ("fused_qkv", "fused_rope", "attention_backend",
                                                        "cuda_graphs")},
              "peak_allocated_bytes": peak[0], "peak_reserved_bytes": peak[1]}
    return result


def part_check() -> dict:
    spec = get_model("tiny-moe")
    out = {}
    for label, world in (("ep2", 2), ("tp2", 2), ("etp2", 2)):
        config = ParallelConfig.parse(label, world_size=world)
        scenario = Scenario("gpu", spec, ExecutorOptions(moe_aux_loss_coeff=1e-2), device="cuda", steps=2)
        launched = launch(layout_worker, world, ([(config, scenario)],), backend="nccl", timeout_s=180)
        if not launched.ok:
            out[label] = {"ok": False, "reason": launched.failure_reason}
            continue
        got = launched.results[0]["results"][0]
        ref = reference(config, scenario)
        # GPU fp32 vs CPU fp32: different reduction orders and kernels; params after Adam are left out.
        problems = [p for p in compare(ref, got, rtol=2e-3, atol=1e-5) if not p.startswith("params")]
        out[label] = {"ok": not problems, "problems": problems[:5], "loss": got["loss"], "ref_loss": ref["loss"]}
    return out


def part_ep2(layers: int, seq: int = 4096, balanced: bool = False) -> dict:
    """Full training steps of the Mixtral proxy: 1 GPU vs EP2 (dp2) on 2 GPUs, same tokens per GPU."""
    spec = get_model("mixtral-8x7b").with_layers(layers)
    options = ExecutorOptions(moe_router_force_load_balancing=balanced)
    runs = {}
    for label, world in (("ep1", 1), ("ep2", 2)):
        config = ParallelConfig.parse(label, world_size=world)
        training = TrainingSpec(seq_length=seq, global_batch_size=world, precision="bf16")
        m = profile_layout(spec, training, config, options, warmup_steps=2, timed_steps=5,
                           timeout_s=400, device="cuda")
        runs[label] = m.to_dict()
    ok = runs["ep1"]["ok"] and runs["ep2"]["ok"]
    ratio = runs["ep2"]["tokens_per_s_per_gpu"] / runs["ep1"]["tokens_per_s_per_gpu"] if ok else None
    return {"ratio": ratio, "balanced_routing": balanced, "runs": runs}


def moe_rows(key: str, r: dict, bar: float | None) -> list[tuple[str, str, str, str]]:
    """Summary rows of one part_moe result: the bar's ratio (forced-balance routing, alternated steady
    windows) against ``bar`` (None: no bar), the random router's ratios, the earlier timing methods, and layer
    milliseconds steady / isolated / host issue."""
    if "ratio" not in r:
        return []
    tokens = r["shape"]["tokens"]
    judged = ("", "") if bar is None else (f"{bar:.2f}", "yes" if r["ratio"] >= bar else "NO")
    ms = f"{r['layer_s'] * 1e3:.2f}/{r['isolated_layer_s'] * 1e3:.2f}/{r['host_issue_s'] * 1e3:.2f}"
    return [(f"{key} ({tokens} tok) layer/ideal, balanced routing", f"{r['ratio']:.3f}", *judged),
            (f"  random router (max/mean {r['imbalance_max_over_mean']:.3f}) / vs ideal on its groups",
             f"{r['random_ratio']:.3f} / {r['random_vs_uneven_ideal']:.3f}", "", ""),
            ("  ideal's time: random groups / balanced", f"{r['uneven_ideal_over_ideal']:.3f}", "", ""),
            ("  sequential steady / isolated (balanced routing)", f"{r['sequential_ratio']:.3f} / "
             f"{r['isolated_ratio']:.3f}", "", ""),
            ("  layer ms steady/isolated/host issue", ms, "", "")]


def main() -> int:
    global DEV, BF16, SEQ, MOE_SHAPES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="gemm,moe,stack,check,ep2")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Mixtral proxy")
    parser.add_argument("--shapes", default=None,
                        help=f"comma list of the MoE parts' shapes (default all: {','.join(MOE_SHAPES)})")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "executor_gpu.json"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: smoke run of the moe and moe_breakdown parts in fp32 (use with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny MoE shapes and seq 64 (CPU smoke runs)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if args.device == "cpu":
        DEV, BF16 = torch.device("cpu"), torch.float32
    if args.tiny:
        SEQ, MOE_SHAPES = TINY_SEQ, TINY_MOE_SHAPES
    if args.shapes:
        unknown = sorted(set(args.shapes.split(",")) - set(MOE_SHAPES))
        if unknown:
            parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(MOE_SHAPES)}")
        MOE_SHAPES = {name: MOE_SHAPES[name] for name in args.shapes.split(",")}
    cuda = DEV.type == "cuda"
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "dtype": str(BF16).replace("torch.", ""), "seq": SEQ}
    rows = []

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def run(name, fn, *a):
        t0 = time.time()
        try:
            report[name] = fn(*a)
        except Exception as exc:  # noqa: BLE001  (one failing part must not lose the others' numbers)

            traceback.print_exc()
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if cuda:
            torch.cuda.empty_cache()
        print(f"[{name}] {time.time() - t0:.1f} s: {json.dumps(report[name])[:600]}", flush=True)
        save()

    if "gemm" in parts:
        run("gemm", part_gemm)
    if "fused" in parts:
        run("fused_check", part_fused_check)
    if "unfused" in parts:  # A/B: the torch router and permutation paths
        with torch_paths():
            for name, shape in MOE_SHAPES.items():
                run(f"moe_{name}_unfused", part_moe, shape, SEQ)
    if "moe" in parts:
        for name, shape in MOE_SHAPES.items():
            run(f"moe_{name}", part_moe, shape, SEQ)
        for name, shape in MOE_SHAPES.items():  # 8192 tokens: mbs 2 x seq 4096 (no bar)
            run(f"moe_{name}_mbs2", part_moe, shape, SEQ, 2)
    if "moe_breakdown" in parts:
        for name, shape in MOE_SHAPES.items():
            run(f"moe_breakdown_{name}", part_moe_breakdown, shape)
    if "moe_breakdown_unfused" in parts:  # the same stages on the torch router and permutation paths
        with torch_paths():
            for name, shape in MOE_SHAPES.items():
                run(f"moe_breakdown_{name}_unfused", part_moe_breakdown, shape)
    if "router" in parts:
        run("router_gemm", part_router_gemm)
    if "trace" in parts:
        for name, shape in MOE_SHAPES.items():
            run(f"trace_{name}", part_trace, shape)
    if "stack" in parts:
        run("stack", part_stack, args.layers)
    if "check" in parts and torch.cuda.device_count() >= 2:
        run("check", part_check)
    if "ep2" in parts and torch.cuda.device_count() >= 2:
        run("ep2", part_ep2, args.layers)
        run("ep2_balanced", part_ep2, args.layers, 4096, True)

    gemm = report.get("gemm", {}).get("tflops")
    print(f"\n{report['device']}  x{report['gpus']}  torch {report['torch']}  {report['date']}")
    print(f"{'measure':<54}{'value':>22}{'bar':>8}  pass")
    if gemm:
        rows.append(("dense bf16 GEMM 8192^3 TFLOP/s", f"{gemm:.0f}", "", ""))
    for suffix, barred in (("_unfused", True), ("", True), ("_mbs2", False)):
        for name, shape in MOE_SHAPES.items():
            rows.extend(moe_rows(f"moe_{name}{suffix}", report.get(f"moe_{name}{suffix}", {}),
                                 shape.bar if barred else None))
    for name in MOE_SHAPES:
        r = report.get(f"moe_breakdown_{name}", {})
        if "random" in r:  # diagnostics, no bar: the layer against the ideal on its own uneven groups
            rows.append((f"{name} layer/uneven ideal, steady", f"{r['random']['ratio_vs_uneven_ideal']:.3f}", "", ""))
            rows.append(("  uneven ideal / ideal, steady", f"{r['uneven_ideal_over_ideal']:.3f}", "", ""))
    st = report.get("stack", {})
    if "tflops" in st and gemm:
        ratio = st["tflops"] / gemm
        rows.append((f"stack {st['layers']}L TFLOP/s / GEMM", f"{ratio:.3f}", f"{STACK_BAR:.2f}",
                     "yes" if ratio >= STACK_BAR else "NO"))
        rows.append(("  same, .grad accumulated in place (pre-issue-19 timing)",
                     f"{st['tflops_grads_accumulated'] / gemm:.3f}", "", ""))
        rows.append(("stack peak allocated GiB", f"{st['peak_allocated_bytes'] / 2**30:.1f}", "", ""))
    for key, text in (("ep2", "EP2 per-GPU tokens/s / 1 GPU"), ("ep2_balanced", "  same, forced balanced routing")):
        ep = report.get(key, {})
        if ep.get("ratio") is not None:
            rows.append((text, f"{ep['ratio']:.3f}", "0.90", "yes" if ep["ratio"] >= 0.9 else "NO"))
    for k, v in report.get("check", {}).items():
        rows.append((f"NCCL equivalence {k}", "ok" if v.get("ok") else "FAIL", "", ""))
    for row in rows:
        print(f"{row[0]:<54}{row[1]:>22}{row[2]:>8}  {row[3]}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
