"""Checkpoints written before the experts' gate and up projections were fused (w1, w3 -> w13) still load."""

from __future__ import annotations

import shutil

import torch
import torch.distributed.checkpoint as dcp

from spec.catalog import get_model
from executor.data import global_batch, micro_batches
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train.checkpoint import TRAINER_FILE, load_checkpoint, save_checkpoint
from executor.train.optim_state import MOMENTS, local_state
from executor.train_step import Trainer

TINY = get_model("tiny-moe")
SEQ = 16


def _trained() -> tuple[MoEGPT, Trainer]:
    torch.manual_seed(0)
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(), SEQ)
    trainer = Trainer(model)
    for step in range(2):
        trainer.step(micro_batches(global_batch(TINY.vocab_size, SEQ, 2, 0, step), 1, 0, 1))
    return model, trainer


def _named(model: MoEGPT) -> list[tuple[str, torch.Tensor]]:
    return [(p.shard_info.name, p.detach()) for p in model.parameters()]


def _as_written_before_the_fusion(new: str, old: str) -> int:
    """Rewrite checkpoint ``new`` into ``old`` with every ``...experts.w13`` key split into w1 and w3."""
    keys = dcp.FileSystemReader(new).read_metadata().state_dict_metadata
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in keys.items()}
    dcp.load(full, checkpoint_id=new)
    split = {}
    for key, value in full.items():
        if ".experts.w13" in key:
            split[key.replace(".experts.w13", ".experts.w1")] = value[:, 0].clone()
            split[key.replace(".experts.w13", ".experts.w3")] = value[:, 1].clone()
        else:
            split[key] = value
    dcp.save(split, checkpoint_id=old)
    shutil.copy(f"{new}/{TRAINER_FILE}", f"{old}/{TRAINER_FILE}")
    return sum(".experts.w13" in k for k in full)


def test_a_checkpoint_with_separate_gate_and_up_tensors_loads_into_the_fused_model(tmp_path):
    model, trainer = _trained()
    path = save_checkpoint(tmp_path / "new", 2, model, trainer.optimizer, model.state, TINY.name)
    fused = _as_written_before_the_fusion(str(path), str(tmp_path / "old"))
    assert fused == TINY.num_layers * (1 + len(MOMENTS))  # parameter and both moments of every MoE layer

    fresh = MoEGPT(TINY, single_process_state(), ExecutorOptions(seed=7), SEQ)
    fresh_trainer = Trainer(fresh)
    before = {name: t.clone() for name, t in _named(fresh)}
    resumed = load_checkpoint(tmp_path / "old", fresh, fresh_trainer.optimizer, fresh.state, TINY.name)
    assert resumed.step == 2
    want = local_state(trainer.optimizer, list(model.parameters()))
    got = local_state(fresh_trainer.optimizer, list(fresh.parameters()))
    assert len(want) == len(got) == len(list(model.parameters()))
    for (p, a), (q, b) in zip(want.items(), got.items()):
        assert p.shard_info.name == q.shard_info.name
        for key in ("master", *MOMENTS):
            assert torch.equal(a[key], b[key]), (p.shard_info.name, key)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q), p.shard_info.name
    # the fresh model started elsewhere (another seed): the fused tensors' equality above is the load's doing
    fused_names = [n for n in before if ".experts.w13" in n]
    assert len(fused_names) == TINY.num_layers
    after = dict(_named(fresh))
    assert not any(torch.equal(before[n], after[n]) for n in fused_names)
