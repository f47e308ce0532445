"""How fast fp8 could make the Mixtral-shaped proxy step of bench/fp8_step.py with the GEMM kernels torch
has: an upper bound on the fp8 / bf16 tokens/s quotient (issue 19's bar is >= 1.25).

Only the GEMMs change with the precision; the optimizer, the fp32 main-gradient accumulation, attention's
SDPA, the norms, the permutation and the loss run the same bytes in both. So, for a bf16 step of T seconds
whose GEMMs fp8 would replace, fp8 steps in at least

    T - sum over the step's GEMMs of (bf16 seconds - fp8 seconds)

with the fp8 seconds of each GEMM as its kernel runs on operands already quantised: quantisation counted
free, no cast, pad or copy. The bench times every GEMM of the step at its own shape (one micro-batch of
seq 4096, top-2 routing spread evenly over the 8 experts: each expert gets 1024 of the 8192 routed rows),
in bf16 (``torch._grouped_mm``, ``torch.mm``) and in fp8 (``torch._scaled_grouped_mm``, ``torch._scaled_mm``
with per-row scales, as :mod:`executor.kernels.fp8.gemm` calls them), each as device time with the host
ahead (:func:`executor.microbench.timing.time_host_ahead`).

Three bounds, each ``T / (T - saving)``:

- ``torch_kernels``: every GEMM of the step in fp8 (the expert forward, dgrad and wgrad, the attention
  projections, and the LM head, which the executor keeps in bf16 as Megatron does) with torch's kernels;
- ``executor_choices``: what the executor runs in fp8 (the LM head bf16; the expert wgrad in whichever
  precision times faster here: bf16 by default, FOLDTUNE_FP8_WGRAD=fp8);
- ``grouped_at_dense_rate``: as ``torch_kernels``, with each grouped GEMM's fp8 time replaced by a dense
  ``torch._scaled_mm`` of the same FLOPs (the rows of all experts against one weight): what a grouped
  kernel as good as cuBLAS's dense fp8 GEMM would give, which torch does not have.

T is the bf16 step's median from a ``bench.fp8_step`` report (``--step-json``; run it first in the same
device call). Because the step's grouped GEMMs run slower than here (uneven groups from the random router,
the card at its power cap), each grouped saving is also scaled by the step's profiled grouped-GEMM time over
this bench's (``scaled`` bounds; the larger of the two is the one to quote as the bound).

Usage (GPU, sm90): python3 -m bench.fp8_step --runs bf16,fp8 --out $OUT/fp8_step.json &&
    python3 -m bench.fp8_bound --step-json $OUT/fp8_step.json --out $OUT/fp8_bound.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass

import torch

from executor.kernels.fp8 import padded_groups, quantize_groups_colwise, quantize_rowwise
from executor.microbench.timing import time_host_ahead
from spec.catalog import get_model
from spec.model_spec import ModelSpec

BAR_SPEEDUP = 1.25
SEQ, LAYERS, MICRO_BATCHES = 4096, 2, 4  # bench/fp8_step.py's proxy: seq 4096, micro-batch 1, 4 micro-batches


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the step: out [m, n] = a [m, k] · b [n, k]ᵀ, ``groups`` > 1 for a grouped GEMM (``rows``:
    m is split evenly over the groups for the 2D×3D forms; ``wgrad``: the 2D×2D form, k split over the
    groups and one [n, k] output per group), ``per_step`` calls a step, ``in_fp8``: whether the executor runs
    it in fp8 (the LM head does not; the expert wgrad is decided from the timings)."""

    name: str
    m: int
    n: int
    k: int
    per_step: int
    groups: int = 1
    wgrad: bool = False
    in_fp8: bool = True

    @property
    def flops(self) -> int:
        """FLOPs of one call (2·m·n·k; a 2D×2D wgrad's k is all groups' rows, m·n per group: the same sum)."""
        return 2 * self.m * self.n * self.k


def step_gemms(spec: ModelSpec, seq: int = SEQ, layers: int = LAYERS, micro_batches: int = MICRO_BATCHES) -> list[Gemm]:
    """The GEMMs of one step of the single-GPU proxy (micro-batch 1), as the executor issues them: per layer
    and micro-batch the Q, K and V projections (three GEMMs in fp8: each weight has its own cached quantised
    form), the output projection and the experts' fc1 (gate and up, one grouped GEMM) and fc2, each with its
    dgrad and wgrad; the LM head once a micro-batch. The router's [tokens, experts] GEMM is left out (8 columns:
    no tensor-core GEMM)."""
    h, f, e = spec.hidden_size, spec.moe_ffn_hidden_size, spec.num_experts
    d = spec.kv_channels or h // spec.num_attention_heads
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    rows = seq * spec.moe_router_topk  # routed rows a layer and micro-batch
    vocab = spec.padded_vocab_size()
    lm = layers * micro_batches
    out: list[Gemm] = []
    for name, n, k in (("wq", q, h), ("wk", kv, h), ("wv", kv, h), ("wo", h, q)):
        out += [Gemm(f"{name} fwd", seq, n, k, lm), Gemm(f"{name} dgrad", seq, k, n, lm),
                Gemm(f"{name} wgrad", n, k, seq, lm)]
    for name, n, k in (("fc1", 2 * f, h), ("fc2", h, f)):
        out += [Gemm(f"{name} fwd", rows, n, k, lm, groups=e), Gemm(f"{name} dgrad", rows, k, n, lm, groups=e),
                Gemm(f"{name} wgrad", n, k, rows, lm, groups=e, wgrad=True)]
    out += [Gemm(f"lm_head {p}", m, n, k, micro_batches, in_fp8=False)
            for p, m, n, k in (("fwd", seq, vocab, h), ("dgrad", seq, h, vocab), ("wgrad", vocab, h, seq))]
    return out


# ---- the kernels, on operands made once ------------------------------------------------------------------

def _offsets(total: int, groups: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (total // groups)


def _e4m3(shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random operand as the executor's quantisation leaves it (e4m3 bytes, per-row fp32 scales)."""
    return quantize_rowwise(torch.randn(*shape, device=device, dtype=torch.bfloat16))


def bf16_op(g: Gemm, device: torch.device):
    """A zero-argument call running ``g`` once in bf16, as the bf16 step does."""
    bf = dict(device=device, dtype=torch.bfloat16)
    if g.groups == 1:
        a, b = torch.randn(g.m, g.k, **bf), torch.randn(g.n, g.k, **bf)
        return lambda: torch.mm(a, b.t())
    if g.wgrad:  # dyᵀ [n, rows] · x [rows, k] per group, rows along the contraction
        dy, x = torch.randn(g.k, g.m, **bf), torch.randn(g.k, g.n, **bf)
        offs = _offsets(g.k, g.groups, device)
        return lambda: torch._grouped_mm(dy.t(), x, offs=offs)
    a, w = torch.randn(g.m, g.k, **bf), torch.randn(g.groups, g.n, g.k, **bf)
    offs = _offsets(g.m, g.groups, device)
    return lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def fp8_op(g: Gemm, device: torch.device, grouped_as_dense: bool = False):
    """A zero-argument call running ``g`` once in fp8 on operands quantised beforehand (per row along the
    contraction; the wgrad per (group, column)); ``grouped_as_dense``: a grouped GEMM as one dense
    ``torch._scaled_mm`` of the same FLOPs."""
    out = torch.bfloat16
    if g.groups == 1 or grouped_as_dense:  # out [m, n], contraction k: a wgrad's too (its k is all rows)
        (qa, sa), (qb, sb) = _e4m3((g.m, g.k), device), _e4m3((g.n, g.k), device)
        return lambda: torch._scaled_mm(qa, qb.t(), sa.unsqueeze(1), sb.unsqueeze(0), out_dtype=out)
    if g.wgrad:  # as executor.kernels.fp8.gemm.scaled_grouped_wgrad calls the kernel: dy, x per (group, column)
        bf = dict(device=device, dtype=torch.bfloat16)
        dy, x = torch.randn(g.k, g.m, **bf), torch.randn(g.k, g.n, **bf)
        groups = padded_groups(_offsets(g.k, g.groups, device), g.k)
        (qa, sa), (qb, sb) = quantize_groups_colwise(dy, groups), quantize_groups_colwise(x, groups)
        return lambda: torch._scaled_grouped_mm(qa, qb.t(), sa.flatten(), sb.flatten(), offs=groups.offs_G,
                                                out_dtype=out)
    (qa, sa), (qw, sw) = _e4m3((g.m, g.k), device), _e4m3((g.groups, g.n, g.k), device)
    offs = _offsets(g.m, g.groups, device)
    return lambda: torch._scaled_grouped_mm(qa, qw.transpose(-2, -1), sa, sw, offs=offs, out_dtype=out)


def _seconds(op, device: torch.device) -> float:
    return time_host_ahead(op, device, calls=8, windows=5).seconds


def measure(gemms: list[Gemm], device: torch.device, progress=print) -> list[dict]:
    """Per GEMM: one call's device seconds in bf16, in fp8 and (grouped GEMMs) in fp8 as one dense GEMM."""
    rows = []
    for g in gemms:
        row = asdict(g) | {"bf16_s": _seconds(bf16_op(g, device), device),
                           "fp8_s": _seconds(fp8_op(g, device), device)}
        row["fp8_dense_s"] = _seconds(fp8_op(g, device, True), device) if g.groups > 1 else row["fp8_s"]
        for key in ("bf16", "fp8", "fp8_dense"):
            row[f"{key}_tflops"] = g.flops / row[f"{key}_s"] / 1e12
        progress(f"  {g.name:14s} bf16 {row['bf16_tflops']:6.0f}  fp8 {row['fp8_tflops']:6.0f}  "
                 f"fp8 as dense {row['fp8_dense_tflops']:6.0f} TFLOP/s")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


# ---- the bounds ------------------------------------------------------------------------------------------

def bounds(rows: list[dict], bf16_step_s: float, grouped_scale: float = 1.0) -> dict[str, dict]:
    """The fp8 / bf16 tokens/s upper bounds of the module doc from per-GEMM seconds (``rows`` as
    :func:`measure` gives them) and the bf16 step's seconds; ``grouped_scale`` multiplies each grouped GEMM's
    saving (the step's profiled grouped-GEMM time over this bench's). Returns per bound its saving and fp8
    step (seconds a step) and the quotient."""
    def saving(row: dict, fp8_key: str, executor: bool) -> float:
        if executor and not row["in_fp8"]:
            return 0.0
        best_fp8 = row[fp8_key]
        if executor and row["wgrad"]:  # the executor's expert wgrad runs in the faster precision
            best_fp8 = min(best_fp8, row["bf16_s"])
        gain = (row["bf16_s"] - best_fp8) * row["per_step"]
        return gain * (grouped_scale if row["groups"] > 1 else 1.0)

    out = {}
    for name, key, executor in (("torch_kernels", "fp8_s", False), ("executor_choices", "fp8_s", True),
                                ("grouped_at_dense_rate", "fp8_dense_s", False)):
        saved = sum(saving(r, key, executor) for r in rows)
        fp8_step = bf16_step_s - saved
        out[name] = {"saving_s": saved, "fp8_step_s": fp8_step, "speedup": bf16_step_s / fp8_step,
                     "reaches_bar": bf16_step_s / fp8_step >= BAR_SPEEDUP}
    return out


def grouped_seconds(rows: list[dict]) -> float:
    """bf16 seconds a step of the grouped GEMMs at this bench's (even) group sizes."""
    return sum(r["bf16_s"] * r["per_step"] for r in rows if r["groups"] > 1)


def profiled_grouped_seconds(step: dict) -> float | None:
    """bf16 seconds a step of the grouped GEMM kernels in a ``bench.fp8_step`` report's profile (its top
    kernels whose name is a CUTLASS sm90 kernel: ``torch._grouped_mm``'s; cuBLAS's dense GEMMs are nvjet
    kernels), or None if the report has no bf16 profile."""
    kernels = step.get("bf16", {}).get("top_kernels_per_step")
    if not kernels:
        return None
    return sum(k["ms"] for k in kernels if "cutlass" in k["name"] and "sm9x" in k["name"]) / 1e3


def table(rows: list[dict], results: dict) -> str:
    lines = ["| GEMM | calls a step | bf16 TFLOP/s | fp8 TFLOP/s | fp8 / bf16 | fp8 as one dense GEMM |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        dense = f"{r['fp8_dense_tflops']:.0f}" if r["groups"] > 1 else ""
        lines.append(f"| {r['name']}{'' if r['in_fp8'] else ' (bf16 in the executor)'} | {r['per_step']} | "
                     f"{r['bf16_tflops']:.0f} | {r['fp8_tflops']:.0f} | {r['bf16_s'] / r['fp8_s']:.2f} | {dense} |")
    lines += ["", "| bound | GEMM saving a step | fp8 step | fp8 / bf16 (bar 1.25) |", "|---|---:|---:|---:|"]
    for kind in ("plain", "scaled"):
        for name, b in results.get(kind, {}).items():
            lines.append(f"| {name} ({kind}) | {b['saving_s'] * 1e3:.1f} ms | {b['fp8_step_s'] * 1e3:.1f} ms | "
                         f"{b['speedup']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-json", required=True, help="a bench.fp8_step report with a bf16 run")
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        with open(args.step_json) as fh:
            step = json.load(fh)
        bf16_step_s = float(step["bf16"]["median_step_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"fp8_bound: --step-json {args.step_json!r} is not a bench.fp8_step report with a bf16 run "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("fp8_bound: needs a CUDA GPU of compute capability 9.0 or later (torch._scaled_mm, "
              "torch._scaled_grouped_mm); none here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gemms = step_gemms(get_model(args.model))
    print(f"fp8_bound: {len(gemms)} GEMMs of the {args.model} 2-layer proxy step on {torch.cuda.get_device_name()}")
    rows = measure(gemms, device)
    results = {"plain": bounds(rows, bf16_step_s)}
    profiled = profiled_grouped_seconds(step)
    scale = None
    if profiled:
        scale = max(1.0, profiled / grouped_seconds(rows))
        results["scaled"] = bounds(rows, bf16_step_s, scale)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "command": " ".join(["python3 -m bench.fp8_bound", *(argv if argv is not None else sys.argv[1:])]),
              "bf16_step_s": bf16_step_s, "step_json": args.step_json,
              "grouped_bench_s": grouped_seconds(rows), "grouped_profiled_s": profiled, "grouped_scale": scale,
              "gemms": rows, "bounds": results}
    print(table(rows, results))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
