"""The vision encoder's cost under a multimodal layout, and the step of the whole vision-language model.

The LLM part is priced by the LLM cost model (:func:`costmodel.estimate.estimate` on the LLM's own GPUs); this
module adds the encoder (its GEMMs, bidirectional attention per image and memory-bound kernels at its tp/cp, its
TP, CP and gradient communication), the boundary (the projector's tokens moved from the encoder's ranks to the LLM's, and their
gradients back) and the placement's effect on the step:

- **homogeneous**: the encoder runs on the LLM's first pipeline stage with the LLM's tp and cp. Every
  micro-batch waits for its images there, so the slowest stage grows by one micro-batch's encoder time, and
  the step by ``(micro-batches + pp − 1)`` of them (the steady state and the fill/drain bubbles); its
  memory joins the first stage's;
- **colocated**: its own groups over all the LLM's GPUs, run in turn with the LLM (time-shared), so the step
  grows by the encoder's step time at its own layout plus the boundary all-to-all; its memory joins every GPU's;
- **separate**: its own GPUs, pipelined ahead of the LLM: the step is the slower of the two pipelines plus
  one micro-batch's encoder time and boundary transfer (the first micro-batch's fill), and the LLM runs on
  the GPUs the encoder leaves it.

Seconds and bytes throughout; 16-bit weights and activations, fp32 gradients and Adam state (sharded over the
encoder's dp: the distributed optimizer), activations ~34 bytes per token and hidden unit per block (flash
attention, sequence parallel over tp), held for the micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from costmodel.comm import Placement, all_to_all_time, group_placement, link_rates, p2p_time, ring_time
from costmodel.compute import attention_time, compute_rates, gemm_fwd_bwd, memory_time
from costmodel.estimate import Estimate
from spec.flops import flops_per_step
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs, VisionEncoderSpec, VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec

#: bytes per encoder parameter: 16-bit weight, fp32 gradient; fp32 master weight and two Adam moments
#: (sharded over the encoder's data-parallel ranks)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
#: activation bytes a ViT block keeps per token and hidden unit (flash attention, no recompute; Korthikanti et
#: al.'s 34·s·b·h without the score matrix)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
#: bytes of one element crossing the boundary (the projector's 16-bit tokens, and their gradients)
BOUNDARY_ELEMENT_BYTES = 2
#: HBM traffic of one encoder block's memory-bound kernels, forward + backward, in 16-bit [tokens, hidden] tensors
#: (E) and [tokens, ffn] tensors (F): LayerNorms, the residual and bias adds and the bias gradients replicated
#: over encoder tp (REPLICATED_E); q/k RoPE in fp32 with its casts and the attention's layout copies split over
#: the heads (PER_HEAD_E); GELU and its backward (PER_FFN_F). Counted with a TorchDispatchMode over the executor's
#: VisionBlock (executor/vlm/vision.py, Qwen3-VL's widths, bf16, CPU, torch 2.13): every op but GEMMs, attention
#: and views, bytes of its inputs and outputs; 186.5 E in 50 kernels (21 forward, 29 backward), of which GELU's
#: ~18.7 E scale with the MLP width. The split of the rest into replicated and per-head parts is read off the op
#: list (LayerNorms, residual and bias adds vs RoPE, casts and copies), not counted per part.
ENCODER_BLOCK_REPLICATED_E = 65.0
ENCODER_BLOCK_PER_HEAD_E = 100.0
ENCODER_BLOCK_PER_FFN_F = 6.0
ENCODER_BLOCK_KERNELS = 50


def encoder_params(v: VisionEncoderSpec) -> int:
    """Parameters of the encoder and its projectors (weights and biases)."""
    h, f, m = v.hidden_size, v.ffn_hidden_size, v.merged_hidden_size
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv + proj, MLP, two LayerNorms
    projector = m * m + m + m * v.out_hidden_size + v.out_hidden_size
    norms = 2 * h + len(v.deepstack_layers) * 2 * m
    return (v.patch_dim * h + h + v.num_position_embeddings * h + v.num_layers * block
            + v.num_projectors * projector + norms)


def encoder_flops_per_image(v: VisionEncoderSpec, patches: int) -> float:
    """Model FLOPs (forward + backward: 3x forward) of one image of ``patches`` patches through the encoder and
    its projectors."""
    h, f, m = v.hidden_size, v.ffn_hidden_size, v.merged_hidden_size
    per_layer = 2 * patches * (4 * h * h + 2 * h * f) + 4 * patches * patches * h
    tokens = patches // v.spatial_merge_size ** 2
    projectors = v.num_projectors * 2 * tokens * (m * m + m * v.out_hidden_size)
    return 3.0 * (v.num_layers * per_layer + 2 * patches * v.patch_dim * h + projectors)


@dataclass(frozen=True)
class EncoderCost:
    """One encoder rank's share of a step. ``images_per_microbatch``: images an encoder rank encodes per LLM
    micro-batch; ``microbatch_s``: its forward + backward seconds for them (compute and TP/CP communication);
    ``step_s``: all its micro-batches plus the gradient all-reduce; ``memory_bytes``: what it adds to a GPU
    that holds it; ``boundary_bytes``: bytes one LLM rank receives per micro-batch (forward, the same back)."""

    params: int
    images_per_microbatch: float
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    grad_reduce_s: float
    microbatch_s: float
    step_s: float
    memory_bytes: float
    activation_bytes: float
    boundary_bytes: float


def _intra(size: int, cluster: ClusterSpec) -> Placement:
    """Where a group of ``size`` consecutive ranks sits (encoder tp and cp groups are innermost)."""
    return group_placement(1, size, cluster.hardware.gpus_per_node)


def encoder_cost(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs, layout: MultimodalLayout,
                 cluster: ClusterSpec, in_flight: int) -> EncoderCost:
    """The encoder's cost on one of its ranks under ``layout``; ``in_flight``: micro-batches whose activations
    it holds at once (the LLM's pipeline depth for homogeneous and colocated, one more when separate)."""
    v = vl.vision
    tp, cp, pp, dp = layout.encoder_sizes
    rates, link = compute_rates(cluster.hardware, training.precision), link_rates(cluster.hardware)
    llm = layout.llm
    microbatches = training.global_batch_size // (llm.micro_batch_size * llm.dp)
    images_step = training.global_batch_size * images.images_per_sample
    per_mb = images_step / (dp * microbatches)  # images one encoder rank encodes per LLM micro-batch
    patches = images.patches_per_image(v)
    tokens = int(round(per_mb * patches / cp))  # patch rows one rank holds in a micro-batch
    h, f, m = v.hidden_size, v.ffn_hidden_size, v.merged_hidden_size
    layer = 0.0
    for n, k in ((3 * h // tp, h), (h, h // tp), (f // tp, h), (h, f // tp)):  # qkv, proj, fc1, fc2
        layer += sum(gemm_fwd_bwd(rates, tokens, n, k))
    layer += sum(attention_time(rates, tokens, patches, v.num_attention_heads // tp, v.head_dim, v.head_dim,
                                causal=False))
    e_bytes, f_bytes = tokens * h * 2, tokens * f * 2
    layer += memory_time(rates, ENCODER_BLOCK_REPLICATED_E * e_bytes
                         + (ENCODER_BLOCK_PER_HEAD_E * e_bytes + ENCODER_BLOCK_PER_FFN_F * f_bytes) / tp,
                         ENCODER_BLOCK_KERNELS)
    merged_rows = max(1, tokens // v.spatial_merge_size ** 2)
    projector = sum(gemm_fwd_bwd(rates, merged_rows, m // tp, m)) + sum(gemm_fwd_bwd(rates, merged_rows,
                                                                                       v.out_hidden_size, m // tp))
    embed = sum(gemm_fwd_bwd(rates, tokens, h // tp, v.patch_dim))
    compute = (v.num_layers * layer + v.num_projectors * projector + embed) / pp
    act = tokens * h * 2  # one 16-bit [tokens, h] tensor
    # sequence parallel TP: an all-gather and a reduce-scatter around attention and the MLP, forward and backward
    tp_comm = v.num_layers / pp * 4 * 2 * ring_time(link, "all_gather", act, _intra(tp, cluster))
    # CP: each block gathers the image's keys and values (forward) and reduce-scatters their gradients
    cp_comm = v.num_layers / pp * 2 * ring_time(link, "all_gather", 2 * act * cp / tp, _intra(cp, cluster))
    mb_s = compute + tp_comm + cp_comm
    params = encoder_params(v)
    shard = params / (tp * pp)
    grad_group = group_placement(tp * cp * pp, dp, cluster.hardware.gpus_per_node)
    grad_reduce = ring_time(link, "all_reduce", shard * GRAD_BYTES, grad_group)
    # a pipelined encoder runs its micro-batches through pp stages: (m + pp - 1) stage slots
    step_s = (microbatches + pp - 1) * mb_s + grad_reduce
    activations = in_flight * v.num_layers / pp * ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * h / tp
    memory = shard * (WEIGHT_BYTES + GRAD_BYTES) + shard * OPTIMIZER_BYTES / dp + activations
    llm_tokens = llm.micro_batch_size * images.image_tokens_per_sample(v)
    boundary = llm_tokens * vl.llm.hidden_size * BOUNDARY_ELEMENT_BYTES * v.num_projectors / (llm.tp * llm.cp)
    return EncoderCost(params, per_mb, compute, tp_comm, cp_comm, grad_reduce, mb_s, step_s, memory, activations,
                       boundary)


@dataclass(frozen=True)
class MultimodalEstimate:
    """A multimodal layout's predicted step: ``terms`` its exposed seconds by name (they sum to ``step_time``),
    ``reasons`` one line per term saying where its seconds come from, ``memory_bytes`` the most-loaded GPU."""

    layout: MultimodalLayout
    llm: Estimate
    encoder: EncoderCost
    step_time: float
    terms: tuple[tuple[str, float], ...]
    reasons: tuple[tuple[str, str], ...]
    memory_bytes: float
    fits: bool
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float

    def calibration_terms(self) -> tuple[tuple[str, float], ...]:
        """The step's seconds in the LLM's term names (costmodel.terms), so a tuning search calibrates a
        multimodal layout's prediction as it does a text-only one's: the LLM's own terms, the encoder's seconds
        split as its micro-batch's parts (compute into ``gemm``: its work is dense GEMMs and attention of the
        same kind; TP and CP communication into ``tp_comm``/``cp_comm``), its gradient all-reduce into
        ``dp_grad``, the boundary all-to-all into ``ep_a2a`` (an all-to-all over the same links) and the
        separate placement's point-to-point fill into ``pp_p2p``. They sum to ``step_time``."""
        out: dict[str, float] = dict(self.llm.time.terms)
        enc = self.encoder
        parts = (("gemm", enc.compute_s), ("tp_comm", enc.tp_comm_s), ("cp_comm", enc.cp_comm_s))
        whole = sum(t for _, t in parts)
        for name, seconds in self.terms:
            if name in ("encoder", "encoder_beyond_llm"):
                for term, part in parts:
                    out[term] = out.get(term, 0.0) + (seconds * part / whole if whole > 0 else 0.0)
                if whole <= 0:
                    out["gemm"] = out.get("gemm", 0.0) + seconds
            elif name != "llm":
                term = {"encoder_grad_reduce": "dp_grad", "boundary": "ep_a2a", "boundary_fill": "pp_p2p"}[name]
                out[term] = out.get(term, 0.0) + seconds
        return tuple(out.items())

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.layout.label(), "placement": self.layout.placement,
                "heterogeneous": self.layout.is_heterogeneous, "llm_layout": self.layout.llm.label(),
                "encoder_layout": {"tp": self.layout.encoder_tp, "cp": self.layout.encoder_cp,
                                   "pp": self.layout.encoder_pp, "dp": self.layout.encoder_dp},
                "llm_gpus": self.layout.llm.world_size, "encoder_gpus": self.layout.encoder_world,
                "step_time_s": self.step_time, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tflops_per_gpu": self.tflops_per_gpu, "memory_bytes": self.memory_bytes, "fits": self.fits,
                "terms_s": dict(self.terms), "reasons": dict(self.reasons),
                "llm_step_time_s": self.llm.time.step_time, "llm_bottleneck": self.llm.limiter}


def estimate_multimodal(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs,
                        layout: MultimodalLayout, cluster: ClusterSpec, llm: Estimate,
                        llm_cluster: ClusterSpec) -> MultimodalEstimate:
    """Price ``layout`` given ``llm``, the LLM estimate of ``layout.llm`` on ``llm_cluster`` (the cluster's GPUs
    the LLM gets: all of them unless the encoder is separate)."""
    c = layout.llm
    separate = layout.placement == "separate"
    enc = encoder_cost(vl, training, images, layout, cluster, c.pp + (1 if separate else 0))
    microbatches = training.global_batch_size // (c.micro_batch_size * c.dp)
    link = link_rates(cluster.hardware)
    t_llm = llm.time.step_time
    terms: list[tuple[str, float]] = []
    reasons: list[tuple[str, str]] = []
    enc_text = (f"{enc.images_per_microbatch:g} images per micro-batch per encoder rank at "
                f"{layout.encoder_label()}: {enc.microbatch_s * 1e3:.2f} ms "
                f"(compute {enc.compute_s * 1e3:.2f}, TP {enc.tp_comm_s * 1e3:.2f}, CP {enc.cp_comm_s * 1e3:.2f})")
    if layout.placement == "homogeneous":
        slots = microbatches + c.pp - 1
        encoder = slots * enc.microbatch_s
        terms += [("llm", t_llm), ("encoder", encoder), ("encoder_grad_reduce", enc.grad_reduce_s)]
        reasons += [("llm", f"the LLM's step at {c.label()}: {llm.explanation}"),
                     ("encoder", f"the encoder inherits the LLM's tensor and context parallel sizes ({c.tp}, {c.cp}) "
                                 f"on the first of {c.pp} pipeline stages; "
                                 f"that stage is slower by one micro-batch's encoding, the step by {slots} of them "
                                 f"({microbatches} micro-batches + {c.pp - 1} fill): {enc_text}"),
                     ("encoder_grad_reduce", f"encoder gradients all-reduced over the LLM's dp {c.dp}")]
        memory = llm.memory.total + enc.memory_bytes
        memory_reason = "the encoder's weights, state and activations join the first stage's GPUs"
    elif layout.placement == "colocated":
        per_mb = all_to_all_time(link, enc.boundary_bytes, group_placement(1, c.world_size,
                                                                             cluster.hardware.gpus_per_node))
        boundary = 2 * microbatches * per_mb
        terms += [("llm", t_llm), ("encoder", microbatches * enc.microbatch_s + (layout.encoder_pp - 1) * enc.microbatch_s),
                  ("encoder_grad_reduce", enc.grad_reduce_s), ("boundary", boundary)]
        reasons += [("llm", f"the LLM's step at {c.label()}: {llm.explanation}"),
                     ("encoder", f"the encoder's own groups over all {c.world_size} GPUs, run in turn with the LLM: "
                                 f"{enc_text}"),
                     ("encoder_grad_reduce", f"encoder gradients all-reduced over encoder dp {layout.encoder_dp}"),
                     ("boundary", f"image tokens redistributed from the encoder's layout to the LLM's and their "
                                  f"gradients back: {enc.boundary_bytes / 2 ** 20:.2f} MiB per LLM rank per "
                                  f"micro-batch each way, an all-to-all over the GPUs")]
        memory = llm.memory.total + enc.memory_bytes
        memory_reason = "the encoder's weights, state and activations join every GPU's"
    else:
        per_mb = p2p_time(link, enc.boundary_bytes, crosses_nodes=True)
        enc_step = enc.step_s  # each micro-batch's transfer overlaps the next one's encoding
        slower = max(t_llm, enc_step)
        fill = enc.microbatch_s + 2 * per_mb
        terms += [("llm", t_llm), ("encoder_beyond_llm", slower - t_llm), ("boundary_fill", fill)]
        reasons += [("llm", f"the LLM's step on its {c.world_size} GPUs at {c.label()}: {llm.explanation}"),
                     ("encoder_beyond_llm", f"the encoder on its own {layout.encoder_world} GPUs takes "
                                            f"{enc_step:.3f} s per step ({enc_text}); "
                                            + ("it hides behind the LLM" if enc_step <= t_llm else
                                               "the LLM waits for it")),
                     ("boundary_fill", f"the first micro-batch's encoding and the last one's gradient return are not "
                                       f"overlapped: {enc.microbatch_s * 1e3:.2f} ms + 2 x "
                                       f"{per_mb * 1e3:.2f} ms point-to-point across nodes")]
        memory = max(llm.memory.total, enc.memory_bytes)
        memory_reason = (f"the LLM's GPUs hold no encoder; the encoder's GPUs hold {enc.memory_bytes / 2 ** 30:.1f} "
                         f"GiB")
    step = sum(t for _, t in terms)
    reasons.append(("memory", f"{memory / 2 ** 30:.1f} GiB on the most-loaded GPU: {memory_reason}"))
    fits = llm.fits and memory <= cluster.usable_hbm_bytes and enc.memory_bytes <= llm_cluster.usable_hbm_bytes
    world = layout.world_size
    seq = training.seq_length
    flops = flops_per_step(vl.llm, seq, training.global_batch_size) + (
        training.global_batch_size * images.images_per_sample * encoder_flops_per_image(v := vl.vision,
                                                                                        images.patches_per_image(v)))
    return MultimodalEstimate(layout, llm, enc, step, tuple(terms), tuple(reasons), memory, fits,
                              training.global_batch_size * seq / step / world, flops / step / world / 1e12)
