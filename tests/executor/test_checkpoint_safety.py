"""A checkpoint directory is data, never code: a ``trainer.pt`` or DCP ``.metadata`` carrying a pickled object
that would run code is refused with a CheckpointError (and the code does not run) on every path that reads
one (resuming a training, ``foldtune export-hf``), a ``latest`` marker naming a directory elsewhere is
refused, and a checkpoint foldtune wrote still resumes and exports. A launched rank's result file is read
the same way (:mod:`executor.safe_load`): one that would run code fails the launch, unrun."""

from __future__ import annotations

import pickle

import pytest
import torch

from spec.catalog import get_model
from executor.data import global_batch, micro_batches
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from api.cli.main import main as foldtune
from executor.launch_local import launch
from executor.measurement import Measurement
from executor.train.checkpoint import (LATEST, TRAINER_FILE, CheckpointError, latest_checkpoint, load_checkpoint,
                                       save_checkpoint)
from executor.train_step import Trainer

TINY = get_model("tiny-moe")
SEQ = 16


class _RunsCode:
    """Unpickling this runs ``exec``: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of a tiny MoE after one step: (checkpoint directory, its step directory)."""
    torch.manual_seed(0)
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(), SEQ)
    trainer = Trainer(model)
    trainer.step(micro_batches(global_batch(TINY.vocab_size, SEQ, 2, 0, 0), 1, 0, 1))
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, save_checkpoint(directory, 1, model, trainer.optimizer, model.state, TINY.name)


def _fresh():
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(seed=3), SEQ)
    return model, Trainer(model).optimizer


def _copy(step_dir, tmp_path):
    import shutil

    return shutil.copytree(step_dir, tmp_path / step_dir.name)


def test_a_checkpoint_foldtune_wrote_resumes(saved):
    directory, step_dir = saved
    assert latest_checkpoint(directory) == step_dir
    model, optimizer = _fresh()
    assert load_checkpoint(step_dir, model, optimizer, model.state, TINY.name).step == 1


def test_a_trainer_state_carrying_a_pickled_object_is_refused_unrun(saved, tmp_path):
    step_dir = _copy(saved[1], tmp_path)
    trainer = torch.load(step_dir / TRAINER_FILE, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**trainer, "layout": _RunsCode(str(marker))}, step_dir / TRAINER_FILE)
    model, optimizer = _fresh()
    with pytest.raises(CheckpointError, match="refused") as err:
        load_checkpoint(step_dir, model, optimizer, model.state, TINY.name)
    assert "weights_only" in str(err.value) and not marker.exists()


def _crafted_metadata(step_dir, marker) -> None:
    """Give ``step_dir``'s DCP metadata an object whose unpickling creates ``marker``."""
    with open(step_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the genuine metadata (this test's own file), with one object added
    metadata.planner_data = {"x": _RunsCode(str(marker))}
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_dcp_metadata_carrying_a_pickled_object_is_refused_unrun(saved, tmp_path):
    step_dir = _copy(saved[1], tmp_path)
    marker = tmp_path / "ran"
    _crafted_metadata(step_dir, marker)
    model, optimizer = _fresh()
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(step_dir, model, optimizer, model.state, TINY.name)
    assert not marker.exists()


def test_a_latest_marker_pointing_out_of_the_directory_is_refused(saved, tmp_path):
    (tmp_path / "mine").mkdir()
    for name in ("../elsewhere/step-00000001", str(saved[1]), ".."):
        (tmp_path / "mine" / LATEST).write_text(name + "\n")
        with pytest.raises(CheckpointError, match="refused"):
            latest_checkpoint(tmp_path / "mine")


def test_export_hf_writes_a_genuine_checkpoint(saved, tmp_path):
    assert foldtune(["export-hf", str(saved[0]), "--model", TINY.name, "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


def test_export_hf_refuses_crafted_metadata_and_runs_nothing(saved, tmp_path, capsys):
    step_dir = _copy(saved[1], tmp_path)
    marker = tmp_path / "ran"
    _crafted_metadata(step_dir, marker)
    assert foldtune(["export-hf", str(step_dir), "--model", TINY.name, "--out", str(tmp_path / "hf")]) == 2
    assert "refused" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def _returns(rank: int, world_size: int, value: object) -> object:
    return value


def test_a_rank_result_that_would_run_code_fails_the_launch_unrun(tmp_path):
    marker = tmp_path / "ran"
    result = launch(_returns, 1, (_RunsCode(str(marker)),), start_method="fork", timeout_s=120)
    assert not result.ok and "refused" in result.failure_reason
    assert not marker.exists()


def test_rank_results_of_plain_data_and_foldtune_types_come_back():
    value = {"m": Measurement(ok=True, step_time=0.5), "t": torch.arange(3), "k": TINY}
    result = launch(_returns, 2, (value,), start_method="fork", timeout_s=120)
    assert result.ok, result.failure_reason
    assert result.results[1]["m"].step_time == 0.5 and result.results[0]["k"] == TINY
    assert torch.equal(result.results[0]["t"], torch.arange(3))
