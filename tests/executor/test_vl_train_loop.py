"""The vision-language training loop: one global gradient norm over the LLM's and the encoder's parameters
(checked against a hand-summed norm, equal whatever ranks hold the encoder), clipping that scales both parts
by it, and checkpoints a run resumes from with the losses of an uninterrupted run (under the same layout,
under another placement, and with the LLM pipelined under a colocated encoder)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from costmodel.checkpoint_size import checkpoint_bytes
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.vl_catalog import get_vl_model
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.train.loop import TrainConfig
from executor.vlm.dataset import VLDataset, save_vl_dataset
from executor.vlm.profile import build_vl_rank
from executor.vlm.train_loop import vl_train_worker

SPEC = get_vl_model("tiny-vl-moe")
SEQ = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Random 16x16 images, each sample: BOS, the image's 4 tokens, then random text."""
    directory = tmp_path_factory.mktemp("vl-data")
    gen = torch.Generator().manual_seed(0)
    samples = 40
    ids = torch.randint(10, 60, (samples, SEQ), generator=gen)
    ids[:, 0], ids[:, 1:5] = 1, SPEC.image_token_id
    save_vl_dataset(directory, ids, torch.randn(samples, 1, 3, 16, 16, generator=gen), heldout=8)
    return str(directory)


def _cfg(data: str, steps: int, checkpoint_dir=None, checkpoint_every: int = 0, max_grad_norm: float = 1.0):
    return TrainConfig(data, steps=steps, seq_length=SEQ, global_batch_size=4, lr=3e-3, min_lr=3e-4,
                       warmup_steps=1, weight_decay=0.0, eval_batches=1, max_grad_norm=max_grad_norm,
                       checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)


def _train(label: str, cfg: TrainConfig):
    layout = MultimodalLayout.parse(label)
    result = launch(vl_train_worker, layout.world_size, (SPEC, layout, ExecutorOptions(), cfg), backend="gloo",
                    timeout_s=300, start_method="fork")
    assert result.ok, result.failure_reason
    return result.results[0]


def _optimizer_grads(model, trainer) -> list[torch.Tensor]:
    """The gradients the two optimizers read next: the LLM reducer's buckets and the encoder's."""
    return trainer.clipper.llm.gradients() + [p.grad for p in model.encoder.parameters()]


def test_one_norm_over_the_llm_and_the_encoder_clips_both(data):
    layout = MultimodalLayout.parse("dp1 placement=colocated enc_tp1 enc_dp1")
    training = TrainingSpec(seq_length=SEQ, global_batch_size=4, precision="fp32")
    model, trainer = build_vl_rank(SPEC, training, layout, 0, ExecutorOptions(), torch.device("cpu"))
    dataset = VLDataset.load(data)
    micro = [[dataset.batch(SPEC, [0, 1]), dataset.batch(SPEC, [2, 3])]]
    trainer.enable_clipping(None)  # measure only: the gradients stay as the step made them
    trainer.step_data(micro)
    params = [*model.llm.parameters(), *model.encoder.parameters()]
    by_hand = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))  # autograd's, one rank
    encoder_part = sum(float(p.grad.square().sum()) for p in model.encoder.parameters())
    assert encoder_part > 1e-6 * by_hand ** 2  # the encoder's share counts
    assert trainer.grad_norm == pytest.approx(by_hand, rel=1e-5)
    grads = [g.clone() for g in _optimizer_grads(model, trainer)]
    target = by_hand / 4
    assert trainer.clipper.clip(target) == pytest.approx(by_hand, rel=1e-5)
    scale = target / (by_hand + 1e-6)
    for before, after in zip(grads, _optimizer_grads(model, trainer)):
        torch.testing.assert_close(after, before * scale, rtol=1e-5, atol=1e-12)
    assert trainer.clipper.norm().item() == pytest.approx(target, rel=1e-5)


@pytest.mark.slow
def test_the_global_norm_is_the_same_on_every_placement(data):
    """Same weights, same samples: one rank, the encoder colocated over two LLM data-parallel ranks, and the
    encoder on its own rank (one replica, then two) give the same norm and losses, step after step."""
    runs = {label: _train(label, _cfg(data, 3, max_grad_norm=0.5)) for label in (
        "dp1 placement=colocated enc_tp1 enc_dp1", "dp2 placement=colocated enc_tp1 enc_dp2",
        "dp2 placement=separate enc_tp1 enc_dp1", "dp2 placement=separate enc_tp1 enc_dp2")}
    reference = runs.pop("dp1 placement=colocated enc_tp1 enc_dp1")
    assert all(m.grad_norm > 0.5 for m in reference.metrics)  # the clipping acts
    for label, report in runs.items():
        assert [m.grad_norm for m in report.metrics] == pytest.approx(
            [m.grad_norm for m in reference.metrics], rel=1e-4), label
        assert [m.loss for m in report.metrics] == pytest.approx([m.loss for m in reference.metrics], rel=1e-5)
        assert report.metrics[-1].eval_loss == pytest.approx(reference.metrics[-1].eval_loss, rel=1e-5)


@pytest.fixture(scope="module")
def first_runs(data, tmp_path_factory):
    """``first_runs(label)``: (the uninterrupted 4-step run, the 2-step run that saved a checkpoint, the
    checkpoint directory) of ``label``, run once per module: several resume cases start from the same first
    layout, and the runs are deterministic (same weights, same samples)."""
    done: dict = {}

    def runs(label: str):
        if label not in done:
            ckpt = tmp_path_factory.mktemp("first-run") / "ckpt"
            done[label] = (_train(label, _cfg(data, 4)), _train(label, _cfg(data, 2, ckpt, checkpoint_every=2)),
                           ckpt)
        return done[label]
    return runs


@pytest.mark.parametrize("first, second", [
    ("dp2 placement=colocated enc_tp2 enc_dp1", "dp2 placement=colocated enc_tp2 enc_dp1"),
    pytest.param("dp2 placement=separate enc_tp2 enc_dp1", "dp2 placement=separate enc_tp2 enc_dp1",
                 marks=pytest.mark.slow),
    pytest.param("dp2 placement=colocated enc_tp2 enc_dp1", "dp2 placement=separate enc_tp1 enc_dp2",
                 marks=pytest.mark.slow),  # the checkpoint holds whole tensors: another placement resumes it
    # the LLM pipelined under a colocated encoder continues the one-rank run: the pipelined step is that step
    ("dp1 placement=colocated enc_tp1 enc_dp1", "pp2 dp1 placement=colocated enc_tp1 enc_dp2"),
    pytest.param("dp1 placement=colocated enc_tp1 enc_dp1", "pp2 dp2 placement=colocated enc_tp2 enc_dp2",
                 marks=pytest.mark.slow),  # an encoder TP group in each stage, two LLM data-parallel ranks
    pytest.param("dp1 placement=colocated enc_tp1 enc_dp1", "tp2 pp2 dp1 placement=colocated enc_tp1 enc_dp4",
                 marks=pytest.mark.slow),  # LLM tp 2: each first-stage rank writes the image rows it holds
])
def test_a_resumed_run_continues_as_the_uninterrupted_one(data, first_runs, tmp_path, first, second):
    whole, saved, ckpt = first_runs(first)
    assert saved.checkpoints and (ckpt / "latest").is_file()
    # the service's free-space preflight predicts 12 bytes per parameter, the encoder's counted
    written = sum(f.stat().st_size for f in Path(saved.checkpoints[-1]).rglob("*") if f.is_file())
    predicted = checkpoint_bytes(SPEC)
    assert predicted <= written <= 1.15 * predicted, (written, predicted)
    shutil.copytree(ckpt, tmp_path / "ckpt")  # the resumed run writes its own checkpoints beside the saved one
    resumed = _train(second, _cfg(data, 4, tmp_path / "ckpt", checkpoint_every=2))
    assert resumed.start_step == 2 and resumed.resumed_from is not None
    assert [m.step for m in resumed.metrics] == [2, 3]
    assert [m.loss for m in resumed.metrics] == pytest.approx([m.loss for m in whole.metrics[2:]], rel=1e-5)
    assert [m.grad_norm for m in resumed.metrics] == pytest.approx([m.grad_norm for m in whole.metrics[2:]],
                                                                   rel=1e-4)
    assert resumed.metrics[-1].eval_loss == pytest.approx(whole.metrics[-1].eval_loss, rel=1e-5)
