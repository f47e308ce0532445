"""Trainings manage their disk: ``keep_last`` keeps the newest complete checkpoints, deleting older ones only
after the new one is complete, and a save that fails says why in the operating system's words."""

from __future__ import annotations

import errno

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from costmodel.checkpoint_size import checkpoint_bytes
from executor.data import global_batch, micro_batches
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint, save_failure_reason
from executor.train.checkpoint_names import TRAINER_FILE, list_checkpoints, step_dir_name
from executor.train.loop import TrainConfig
from executor.train.retention import prune_checkpoints
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.errors import SpecError
from spec.limits import MAX_KEEP_LAST

TINY = get_model("tiny-moe")
SEQ = 16


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(), SEQ)
    trainer = Trainer(model)
    trainer.step(micro_batches(global_batch(TINY.vocab_size, SEQ, 2, 0, 0), 1, 0, 1))
    return model, trainer.optimizer


def _save(directory, step, trained):
    model, optimizer = trained
    return save_checkpoint(directory, step, model, optimizer, model.state, TINY.name)


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path, trained):
    for step in (1, 2, 3):
        _save(tmp_path, step, trained)
    (tmp_path / step_dir_name(4)).mkdir()  # a later save still being written: not the pruner's
    assert prune_checkpoints(tmp_path, 0) == [] and len(list_checkpoints(tmp_path)) == 4  # 0 keeps all
    assert prune_checkpoints(tmp_path, 2) == [step_dir_name(1)]
    assert [e.step for e in list_checkpoints(tmp_path)] == [2, 3, 4]
    assert prune_checkpoints(tmp_path, 1) == [step_dir_name(2)]
    assert latest_checkpoint(tmp_path).name == step_dir_name(3) and (tmp_path / step_dir_name(4)).is_dir()


def test_an_incomplete_leftover_before_latest_is_deleted_and_not_counted(tmp_path, trained):
    _save(tmp_path, 1, trained)
    (tmp_path / step_dir_name(2)).mkdir()  # a save that crashed before its trainer state
    _save(tmp_path, 3, trained)
    assert prune_checkpoints(tmp_path, 2) == [step_dir_name(2)]
    assert [(e.step, e.complete) for e in list_checkpoints(tmp_path)] == [(1, True), (3, True)]


def test_without_a_complete_checkpoint_nothing_is_deleted(tmp_path):
    (tmp_path / step_dir_name(1)).mkdir()
    assert prune_checkpoints(tmp_path, 1) == [] and (tmp_path / step_dir_name(1)).is_dir()


def test_keep_last_is_bounded():
    with pytest.raises(SpecError, match=r"keep_last must be in 0\.\.10000"):
        TrainConfig("data", steps=1, seq_length=8, global_batch_size=1, keep_last=-1)
    with pytest.raises(SpecError, match=r"keep_last must be in 0\.\.10000"):
        TrainConfig("data", steps=1, seq_length=8, global_batch_size=1, keep_last=MAX_KEEP_LAST + 1)


def test_a_failed_save_names_the_os_reason_not_the_ranks(tmp_path, trained):
    (tmp_path / step_dir_name(5)).write_text("a file where the step directory goes")
    with pytest.raises(CheckpointError) as failed:
        _save(tmp_path, 5, trained)
    message = str(failed.value)
    assert "saving checkpoint" in message and step_dir_name(5) in message
    assert ("Not a directory" in message or "File exists" in message) and "dict_keys" not in message, message
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / step_dir_name(5) / TRAINER_FILE).exists()


def test_the_reason_of_a_full_disk_inside_dcp_s_exception():
    full = OSError(errno.ENOSPC, "No space left on device", "/ck/step-00000050/__0_0.distcp")
    wrapped = CheckpointException("failed", {0: (full, None)})
    assert save_failure_reason(wrapped) == "rank 0: No space left on device: /ck/step-00000050/__0_0.distcp"
    assert save_failure_reason(RuntimeError("PytorchStreamWriter failed writing file data/0\nmore")) == \
        "RuntimeError: PytorchStreamWriter failed writing file data/0"


def test_the_preflight_s_predicted_size_is_what_a_save_writes(tmp_path, trained):
    """12 bytes per parameter (costmodel.checkpoint_size); the metadata and trainer state add a few percent at
    test sizes."""
    path = _save(tmp_path, 1, trained)
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    predicted = checkpoint_bytes(TINY)
    assert predicted <= written <= 1.1 * predicted, (written, predicted)
