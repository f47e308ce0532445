"""Heterogeneous layouts run on gloo equal the single-process model. Colocated: the encoder in its own tensor-
parallel group over the LLM's data- (and expert-) parallel ranks, the boundary communicators moving images in
and token gradients back. Separate: the encoder on its own ranks, two micro-batches ahead of the LLM's, tokens
sent forward and their gradients returned as the LLM's backward produces them. Each rank's cross-entropy equals the reference's on its sample alone, and the encoder's
gradients (summed over the encoder's data-parallel group, averaged over the LLM's) equal the reference's on the
whole batch, shard by shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spec.multimodal import ImageInputs
from spec.parallel_config import ParallelConfig
from spec.vl_catalog import get_vl_model
from executor.hf.weights import copy_full_weights
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.vlm.boundary import encoder_groups, shard_encoder_state
from executor.vlm.model import VisionLanguageMoE, VLBatch
from executor.vlm.synthetic import synthetic_batch

SEQ = 32
IMAGES = ImageInputs(images_per_sample=2, image_height=8, image_width=16)  # 2 images of 2x4 patches, 2 tokens


def _model(state, group=None):
    torch.manual_seed(0)
    return VisionLanguageMoE(get_vl_model("tiny-vl-moe"), state, ExecutorOptions(), seq_length=SEQ,
                             mrope_section=(4, 2, 2), encoder_group=group)


def _sample(batch: VLBatch, i: int) -> VLBatch:
    per = len(batch.grids) // batch.ids.shape[0]
    rows = batch.patches.shape[0] // batch.ids.shape[0]
    return VLBatch(batch.ids[i:i + 1], batch.labels[i:i + 1], batch.patches[i * rows:(i + 1) * rows],
                   batch.grids[i * per:(i + 1) * per])


def _worker(rank: int, world: int, label: str, enc_tp: int) -> dict:
    spec = get_vl_model("tiny-vl-moe")
    config = ParallelConfig.parse(label, world)
    batch = synthetic_batch(spec, IMAGES, SEQ, config.dp, torch.Generator().manual_seed(1))  # one sample per dp rank
    reference = _model(build_parallel_state(ParallelConfig(1), 0))
    reference(batch).loss.backward()  # mean over the whole batch
    ref_grads = {n: p.grad for n, p in reference.encoder.named_parameters()}

    state = build_parallel_state(config, rank)
    tp_group, dp_group = encoder_groups(world, enc_tp, rank)
    model = _model(state, tp_group)
    copy_full_weights(model.llm, state, {p.shard_info.name: p.detach() for p in reference.llm.parameters()})
    model.encoder.load_state_dict(shard_encoder_state(reference.encoder.state_dict(),
                                                      spec.vision.num_attention_heads, enc_tp, tp_group.rank))
    mine = state.dp.rank  # the LLM's data-parallel rank trains sample `mine` of the batch
    out = model(_sample(batch, mine))
    out.loss.backward()
    with torch.no_grad():
        alone = reference(_sample(batch, mine)).ce
    expected = shard_encoder_state(ref_grads, spec.vision.num_attention_heads, enc_tp, tp_group.rank)
    # each CP rank's loss is the mean over its half of the sequence: the sample's is their mean, and the
    # gradients reaching the encoder from all of them sum to cp times the sample's
    cp = state["cp"]
    ce = out.ce.clone()
    if cp.size > 1:
        dist.all_reduce(ce, group=cp.pg)
    worst = 0.0
    for name, p in model.encoder.named_parameters():
        grad = p.grad.clone()
        if dp_group.size > 1:
            dist.all_reduce(grad, group=dp_group.pg)
        worst = max(worst, float((grad / (state.dp.size * cp.size) - expected[name]).abs().max()))
    return {"ce": float(ce) / cp.size, "ce_alone": float(alone), "grad_error": worst,
            "grad_scale": max(float(g.abs().max()) for g in ref_grads.values())}


@pytest.mark.parametrize("label, enc_tp", [
    ("dp2", 2),  # encoder tp 2 over the LLM's two data-parallel ranks (encoder TP != LLM TP)
    ("dp2 ep2", 2),  # the LLM's experts split over EP
    ("dp2 ep2", 1),  # encoder data-parallel over the same ranks (its own dp group)
    ("tp2", 1),  # LLM tp 2 (sequence parallel), encoder tp 1: each rank writes the image rows it holds
    ("cp2 ep2", 2),  # LLM cp 2 (load-balanced halves of the sequence) with EP, encoder tp 2
])
def test_colocated_encoder_layout_equals_the_single_process_run(label, enc_tp):
    result = launch(_worker, 2, (label, enc_tp), backend="gloo", timeout_s=300, start_method="fork")
    assert result.ok, result.failure_reason
    for r in result.results:
        assert r["ce"] == pytest.approx(r["ce_alone"], rel=1e-5, abs=1e-6)
        assert r["grad_scale"] > 1e-4  # the comparison is not of zeros
        assert r["grad_error"] < 1e-5 * max(1.0, r["grad_scale"])


def _separate_worker(rank: int, world: int, label: str, enc_tp: int, enc_dp: int, microbatches: int) -> dict:
    from executor.vlm.separate import SeparatePlacement, encoder_groups as separate_groups, encoder_step, \
        llm_microbatch
    spec = get_vl_model("tiny-vl-moe")
    placement = SeparatePlacement(world - enc_tp * enc_dp, enc_tp, enc_dp)
    llm_world = placement.llm_world
    batch = synthetic_batch(spec, IMAGES, SEQ, microbatches * llm_world, torch.Generator().manual_seed(1))
    reference = _model(build_parallel_state(ParallelConfig(1), 0))
    reference(batch).loss.backward()
    ref_grads = {n: p.grad for n, p in reference.encoder.named_parameters()}
    config = ParallelConfig.parse(label, llm_world)
    state = build_parallel_state(config, rank)  # every rank creates every LLM group; encoder ranks join none
    tp_group, dp_group = separate_groups(placement, rank)

    def sample(k: int, llm_rank: int) -> VLBatch:  # micro-batch k of LLM rank r: sample k·llm_world + r
        return _sample(batch, k * llm_world + llm_rank)

    if placement.is_encoder(rank):
        model = _model(build_parallel_state(ParallelConfig(1), 0), tp_group)
        model.encoder.load_state_dict(shard_encoder_state(reference.encoder.state_dict(),
                                                          spec.vision.num_attention_heads, enc_tp, tp_group.rank))
        served = placement.served(placement.replica_of(rank))
        encoder_step(model.encoder, placement, rank,
                     [[(sample(k, r).patches, list(sample(k, r).grids)) for r in served] for k in range(microbatches)])
        expected = shard_encoder_state(ref_grads, spec.vision.num_attention_heads, enc_tp, tp_group.rank)
        worst = 0.0
        for name, p in model.encoder.named_parameters():
            grad = p.grad.clone()
            if dp_group.size > 1:
                dist.all_reduce(grad, group=dp_group.pg)
            worst = max(worst, float((grad / llm_world - expected[name]).abs().max()))
        return {"role": "encoder", "grad_error": worst,
                "grad_scale": max(float(g.abs().max()) for g in ref_grads.values())}
    model = _model(state)
    copy_full_weights(model.llm, state, {p.shard_info.name: p.detach() for p in reference.llm.parameters()})
    errors, sends = [], []
    for k in range(microbatches):
        mine = sample(k, rank)
        out, work = llm_microbatch(model, placement, rank, mine, microbatches)
        sends += work
        with torch.no_grad():
            errors.append(abs(float(out.ce) - float(reference(mine).ce)))
    for w in sends:
        w.wait()
    return {"role": "llm", "ce_error": max(errors)}


@pytest.mark.parametrize("label, world, enc_tp, enc_dp", [
    ("dp2", 3, 1, 1),  # one encoder rank serving two LLM data-parallel ranks
    ("dp2 ep2", 4, 2, 1),  # an encoder TP group of two, the LLM's experts over EP
    ("dp2", 4, 1, 2),  # two encoder replicas, one per LLM rank
])
def test_separate_encoder_ranks_equal_the_single_process_run(label, world, enc_tp, enc_dp):
    result = launch(_separate_worker, world, (label, enc_tp, enc_dp, 2), backend="gloo", timeout_s=300,
                    start_method="fork")
    assert result.ok, result.failure_reason
    roles = [r["role"] for r in result.results]
    assert roles.count("encoder") == enc_tp * enc_dp
    for r in result.results:
        if r["role"] == "llm":
            assert r["ce_error"] < 1e-5
        else:
            assert r["grad_scale"] > 1e-4 and r["grad_error"] < 1e-5 * max(1.0, r["grad_scale"])
