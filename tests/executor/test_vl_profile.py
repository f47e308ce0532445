"""A multimodal layout measured as a tuning trial measures it: VLTrainer steps on gloo ranks (homogeneous and
colocated), the separate placement's steps equal to the colocated ones, the encoder's replicas kept equal by its
gradient reduction, and a layout the executor does not run refused with its rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spec.multimodal import ImageInputs
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.validity import executor_multimodal_rules
from spec.vl_catalog import get_vl_model
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.vlm.profile import build_vl_rank, profile_vl_layout
from executor.vlm.train import mrope_section_for, synthetic_micro_batches

SPEC = get_vl_model("tiny-vl-moe")
IMAGES = ImageInputs(images_per_sample=2, image_height=8, image_width=16)
TRAINING = TrainingSpec(seq_length=32, global_batch_size=4, precision="fp32")


def test_mrope_section_splits_the_rotary_pairs_as_qwen3_vl():
    assert mrope_section_for(64) == (24, 20, 20)  # Qwen3-VL's published split
    assert mrope_section_for(8) == (4, 2, 2)


@pytest.mark.parametrize("label", ["dp2 ep2 placement=homogeneous", "dp2 ep2 placement=colocated enc_tp2",
                                   "tp2 placement=colocated enc_tp1", "pp2 placement=colocated enc_tp1 enc_dp2"])
def test_a_multimodal_layout_is_measured_on_gloo_ranks(label):
    layout = MultimodalLayout.parse(label, 2)
    m = profile_vl_layout(SPEC, TRAINING, IMAGES, layout, warmup_steps=1, timed_steps=2, device="cpu",
                          launcher=lambda *a, **k: launch(*a, **k, start_method="fork"))
    assert m.ok, m.failure_reason
    assert m.layout == layout.label() and m.world_size == 2 and len(m.step_times) == 2
    assert all(loss > 0 for loss in m.losses)
    assert sum(m.tokens_per_expert) > 0


def _replicas_worker(rank: int, world: int, label: str) -> float:
    layout = MultimodalLayout.parse(label, world)
    model, trainer = build_vl_rank(SPEC, TRAINING, layout, rank, ExecutorOptions(), torch.device("cpu"))
    dp = model.state.dp
    for step in range(2):
        trainer.step(synthetic_micro_batches(SPEC, IMAGES, TRAINING.seq_length, TRAINING.global_batch_size, 1,
                                             dp.size, dp.rank, 0, step))
    # the encoder's replicas saw different images: only the gradient reduction keeps their weights equal
    flat = torch.cat([p.detach().flatten() for p in model.encoder.parameters()])
    other = flat.clone()
    dist.broadcast(other, 0)
    return float((flat - other).abs().max())


def test_encoder_replicas_stay_equal_after_steps():
    result = launch(_replicas_worker, 2, ("dp2 placement=colocated enc_tp1",), backend="gloo", timeout_s=300,
                    start_method="fork")
    assert result.ok, result.failure_reason
    assert max(result.results) == 0.0


def _fork(*a, **k):
    return launch(*a, **k, start_method="fork")


@pytest.mark.parametrize("colocated, separate", [
    ("dp2 placement=colocated enc_tp1 enc_dp2", "dp2 placement=separate enc_tp1 enc_dp1"),  # one encoder rank
    pytest.param("dp2 ep2 placement=colocated enc_tp2 enc_dp1", "dp2 ep2 placement=separate enc_tp2 enc_dp1",
                 marks=pytest.mark.slow),  # an encoder TP group of its own
    pytest.param("tp2 placement=colocated enc_tp1 enc_dp2", "tp2 dp1 placement=separate enc_tp1 enc_dp2",
                 marks=pytest.mark.slow),  # two replicas, each serving one TP rank of the same samples
    pytest.param("tp2 placement=colocated enc_tp1 enc_dp2", "tp2 dp1 placement=separate enc_tp1 enc_dp1",
                 marks=pytest.mark.slow),  # one replica encodes the TP peers' samples once, sums their gradients
])
def test_a_separate_trial_trains_as_the_colocated_one(colocated, separate):
    """Same weights (drawn alike whichever ranks hold them), same batches: the separate placement's steps give
    the colocated one's losses, so its encoder's gradients and Adam steps were the same."""
    lay_c, lay_s = MultimodalLayout.parse(colocated, 2), MultimodalLayout.parse(separate)
    m_c = profile_vl_layout(SPEC, TRAINING, IMAGES, lay_c, warmup_steps=0, timed_steps=3, device="cpu",
                            launcher=_fork)
    m_s = profile_vl_layout(SPEC, TRAINING, IMAGES, lay_s, warmup_steps=0, timed_steps=3, device="cpu",
                            launcher=_fork)
    assert m_c.ok and m_s.ok, (m_c.failure_reason, m_s.failure_reason)
    assert m_s.world_size == lay_s.llm.world_size + lay_s.encoder_tp * lay_s.encoder_dp
    assert len(m_s.losses) == 3 and m_s.losses[0] != m_s.losses[2]  # it trains: the later steps see new weights
    assert m_s.losses == pytest.approx(m_c.losses, rel=1e-5)
    assert m_s.tokens_per_expert == m_c.tokens_per_expert


def test_the_executor_rule_names_what_the_vl_step_cannot_run():
    def refused(label: str, world: int, vl=SPEC) -> str:
        found = executor_multimodal_rules(MultimodalLayout.parse(label, world), vl)
        return found[0].reason if found else ""

    assert refused("pp2 placement=colocated enc_tp1 enc_dp2", 2) == ""  # a pipelined LLM under a colocated encoder
    assert refused("dp2 placement=separate enc_tp1 enc_dp2", 4) == ""
    assert "pp = 1 under a homogeneous encoder" in refused("pp2 placement=homogeneous", 2)
    assert "pp = 1 under a separate encoder" in refused("pp2 dp1 placement=separate enc_tp1 enc_dp1", 3)
    assert "within one stage" in refused("pp2 dp2 placement=colocated enc_tp4 enc_dp1", 4)
    assert "encoder dp 4 must divide the LLM's 2 ranks" in refused("dp2 placement=separate enc_tp1 enc_dp4", 6)
    # Qwen3-ViT's three deepstack levels join LLM layers 0-2; a 4-layer LLM at pp 2 has 2 on its first stage
    deep = get_vl_model("qwen3-vit+small-moe")
    assert "deepstack" in refused("pp2 dp1 placement=colocated enc_tp1 enc_dp2", 2, deep)
    assert refused("dp2 placement=colocated enc_tp1 enc_dp2", 2, deep) == ""


def test_a_layout_the_executor_does_not_run_is_refused_by_rule():
    layout = MultimodalLayout.parse("pp2 dp1 placement=separate enc_tp1 enc_dp1", 3)
    m = profile_vl_layout(SPEC, TRAINING, IMAGES, layout, device="cpu")
    assert not m.ok and m.failure_reason.startswith("executor_vl_layout")
