"""An upper bound on what fp8 GEMMs can gain a training step: the step's GEMM inventory and the saving
arithmetic (``bench/fp8_bound.py`` times the GEMMs and prints the bounds).

Only the GEMMs change with the precision; the optimizer, the fp32 main-gradient accumulation, attention,
the norms, the permutation and the loss move the same bytes in both. So a bf16 step of T seconds whose GEMMs
fp8 would replace takes at least T - Σ (bf16 seconds - fp8 seconds) over its GEMMs in fp8, with each fp8
time measured on operands already quantised (quantisation counted free). Three bounds, each T / (that):

- ``torch_kernels``: every GEMM of the step in fp8, the LM head included (the executor keeps it in bf16);
- ``executor_choices``: what the executor runs in fp8 (the LM head bf16; the expert wgrad in whichever
  precision timed faster);
- ``grouped_at_dense_rate``: as ``torch_kernels`` with each grouped GEMM's fp8 time replaced by a dense
  fp8 GEMM of the same FLOPs: what a grouped kernel as good as the dense one would give.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.model_spec import ModelSpec

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


def bounds(rows: list[dict], bf16_step_s: float, bar: float, grouped_scale: float = 1.0) -> dict[str, dict]:
    """The fp8 / bf16 tokens/s upper bounds of the module doc from per-GEMM seconds (``rows`` as
    ``executor.microbench.fp8_gemms.time_gemms`` gives them) and the bf16 step's seconds; ``grouped_scale``
    multiplies each grouped GEMM's saving (the step's profiled grouped-GEMM time over the timed one's). Returns
    per bound its saving and fp8 step (seconds a step), the quotient and whether it reaches ``bar``."""
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
                     "reaches_bar": bf16_step_s / fp8_step >= bar}
    return out


def grouped_seconds(rows: list[dict]) -> float:
    """bf16 seconds a step of the grouped GEMMs of ``rows`` (as timed: even group sizes)."""
    return sum(r["bf16_s"] * r["per_step"] for r in rows if r["groups"] > 1)


def profiled_grouped_seconds(step: dict) -> float | None:
    """bf16 seconds a step of the grouped GEMM kernels in a ``bench.fp8_step`` report's profile (its top
    kernels whose name is a CUTLASS sm90 kernel: ``torch._grouped_mm``'s; cuBLAS's dense GEMMs are nvjet
    kernels), or None if the report has no bf16 profile."""
    kernels = step.get("bf16", {}).get("top_kernels_per_step")
    if not kernels:
        return None
    return sum(k["ms"] for k in kernels if "cutlass" in k["name"] and "sm9x" in k["name"]) / 1e3
