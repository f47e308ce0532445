"""An upper bound on what fp8 GEMMs can gain a training step: the step's GEMM inventory and the saving
arithmetic (``bench/fp8_bound.py`` times the GEMMs and prints the bounds).

Only the GEMMs change with the precision; the optimizer, the fp32 main-gradient accumulation, attention,
the norms, the permutation and the loss move the same bytes in both. So a bf16 step of T seconds whose GEMMs
fp8 would replace takes at least T - Σ (bf16 seconds - fp8 seconds) over its GEMMs in fp8, with each fp8
time measured on operands already quantised (quantisation counted free). Four bounds, each T / (that):

- ``torch_kernels``: every GEMM of the step in fp8, the LM head included (the executor keeps it in bf16);
- ``executor_choices``: what the executor runs in fp8 (the LM head bf16; the expert wgrad in whichever
  precision timed faster);
- ``grouped_at_dense_rate``: as ``torch_kernels`` with each grouped GEMM's fp8 time replaced by a dense
  fp8 GEMM of the same FLOPs: what a grouped kernel as good as the dense one would give;
- ``bf16_head_at_dense_rate``: the LM head bf16 (the executor's and Megatron's recipe), every other GEMM in
  the faster of bf16 and fp8, each grouped GEMM's fp8 at the dense rate: the most any fp8 kernel can give a
  step that keeps the head in bf16.
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


def _linear(name: str, tokens: int, n: int, k: int, calls: int, in_fp8: bool = True) -> list[Gemm]:
    """A dense linear y [tokens, n] = x [tokens, k] · w [n, k]ᵀ: its forward, dgrad and wgrad."""
    return [Gemm(f"{name} fwd", tokens, n, k, calls, in_fp8=in_fp8),
            Gemm(f"{name} dgrad", tokens, k, n, calls, in_fp8=in_fp8),
            Gemm(f"{name} wgrad", n, k, tokens, calls, in_fp8=in_fp8)]


def attention_projections(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, n, k) of each projection GEMM of one attention layer as the executor issues them: GQA's Q, K, V
    (one GEMM each) and output; MLA's query (or its down and up projections), KV down and up, and output."""
    h, n = spec.hidden_size, spec.num_attention_heads
    if spec.multi_latent_attention:
        qk, rope, v = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
        query = ([("q_proj", n * (qk + rope), h)] if spec.q_lora_rank is None else
                 [("q_down", spec.q_lora_rank, h), ("q_up", n * (qk + rope), spec.q_lora_rank)])
        return query + [("kv_down", spec.kv_lora_rank + rope, h), ("kv_up", n * (qk + v), spec.kv_lora_rank),
                        ("wo", h, n * v)]
    d = spec.kv_channels or h // n
    q, kv = n * d, spec.num_kv_heads * d
    return [("wq", q, h), ("wk", kv, h), ("wv", kv, h), ("wo", h, q)]


def step_gemms(spec: ModelSpec, seq: int = SEQ, layers: int = LAYERS, micro_batches: int = MICRO_BATCHES,
               micro_batch_size: int = 1) -> list[Gemm]:
    """The GEMMs of one step of the single-GPU proxy of ``spec`` cut to ``layers`` layers (its dense-first and
    MoE layers as :meth:`ModelSpec.with_layers` keeps them), ``micro_batches`` micro-batches of
    ``micro_batch_size`` sequences, as the executor issues them. Per layer and micro-batch: the attention
    projections (:func:`attention_projections`); a dense layer's MLP (gate, up and down: three GEMMs); an MoE
    layer's experts, fc1 (gate and up, one grouped GEMM) and fc2, and its shared experts (as a dense MLP); each
    with its dgrad and wgrad. The LM head once a micro-batch, kept bf16 (``in_fp8`` False). The router's
    [tokens, experts] GEMM is left out (a few columns: no tensor-core GEMM)."""
    proxy = spec if layers == spec.num_layers else spec.with_layers(layers)
    pattern = proxy.moe_layer_pattern()
    moe_layers = sum(pattern)
    dense_layers = layers - moe_layers
    h, tokens = spec.hidden_size, seq * micro_batch_size
    out: list[Gemm] = []
    for name, n, k in attention_projections(spec):
        out += _linear(name, tokens, n, k, layers * micro_batches)

    def mlp(prefix: str, ffn: int, calls: int) -> list[Gemm]:
        projections = [("w1", ffn, h)] + ([("w3", ffn, h)] if spec.gated_linear_unit else []) + [("w2", h, ffn)]
        return [g for name, n, k in projections for g in _linear(f"{prefix} {name}", tokens, n, k, calls)]

    if dense_layers:
        out += mlp("mlp", spec.ffn_hidden_size, dense_layers * micro_batches)
    if moe_layers:
        f, e = spec.expert_ffn_hidden_size, spec.num_experts
        fc1 = (2 if spec.gated_linear_unit else 1) * f
        rows = tokens * spec.moe_router_topk  # routed rows a layer and micro-batch
        calls = moe_layers * micro_batches
        for name, n, k in (("fc1", fc1, h), ("fc2", h, f)):
            out += [Gemm(f"{name} fwd", rows, n, k, calls, groups=e),
                    Gemm(f"{name} dgrad", rows, k, n, calls, groups=e),
                    Gemm(f"{name} wgrad", n, k, rows, calls, groups=e, wgrad=True)]
        if spec.shared_expert_ffn_hidden_size:
            out += mlp("shared", spec.shared_expert_ffn_hidden_size, calls)
    out += _linear("lm_head", tokens, spec.padded_vocab_size(), h, micro_batches, in_fp8=False)
    return out


def bounds(rows: list[dict], bf16_step_s: float, bar: float, grouped_scale: float = 1.0) -> dict[str, dict]:
    """The fp8 / bf16 tokens/s upper bounds of the module doc from per-GEMM seconds (``rows`` as
    ``executor.microbench.fp8_gemms.time_gemms`` gives them) and the bf16 step's seconds; ``grouped_scale``
    multiplies each grouped GEMM's saving (the step's profiled grouped-GEMM time over the timed one's). Returns
    per bound its saving and fp8 step (seconds a step), the quotient and whether it reaches ``bar``."""
    def saving(row: dict, fp8_key: str, executor: bool, faster: bool = False) -> float:
        if executor and not row["in_fp8"]:
            return 0.0
        best_fp8 = row[fp8_key]
        # the executor's expert wgrad runs in the faster precision; ``faster``: every GEMM does
        if (executor and row["wgrad"]) or faster:
            best_fp8 = min(best_fp8, row["bf16_s"])
        gain = (row["bf16_s"] - best_fp8) * row["per_step"]
        return gain * (grouped_scale if row["groups"] > 1 else 1.0)

    out = {}
    for name, key, executor, faster in (("torch_kernels", "fp8_s", False, False),
                                        ("executor_choices", "fp8_s", True, False),
                                        ("grouped_at_dense_rate", "fp8_dense_s", False, False),
                                        ("bf16_head_at_dense_rate", "fp8_dense_s", True, True)):
        saved = sum(saving(r, key, executor, faster) for r in rows)
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
