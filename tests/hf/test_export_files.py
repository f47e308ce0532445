"""``foldtune export-hf`` hands on a loadable directory: the tokenizer files of ``--model-dir`` beside the
weights, every file readable by all (0644; safetensors alone writes 0600)."""

from __future__ import annotations

import json
import os
import stat

import torch

from api.cli.main import main
from executor.data import global_batch, micro_batches
from executor.hf.files import TOKENIZER_FILES
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train.checkpoint import save_checkpoint
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.hf_config import hf_config_from_spec

TINY = get_model("tiny-moe")


def _checkpoint(directory):
    torch.manual_seed(0)
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(), 16)
    trainer = Trainer(model)
    trainer.step(micro_batches(global_batch(TINY.vocab_size, 16, 2, 0, 0), 1, 0, 1))
    save_checkpoint(directory, 1, model, trainer.optimizer, model.state, TINY.name)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_export_copies_the_tokenizer_and_writes_files_readable_by_all(tmp_path, capsys):
    _checkpoint(tmp_path / "ck")
    source = tmp_path / "src"
    source.mkdir()
    defaults = ExecutorOptions()
    (source / "config.json").write_text(json.dumps(hf_config_from_spec(TINY, defaults.rotary_base,
                                                                       defaults.norm_epsilon)))
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    os.chmod(source / "tokenizer.json", 0o600)  # the copy gets the export's mode, not the source's
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "ck"), "--model-dir", str(source), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "with the tokenizer of" in said and "tokenizer.json, tokenizer_config.json" in said, said
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert {p.name: _mode(p) for p in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], 0o644)


def test_a_catalog_model_s_export_has_no_tokenizer_but_the_same_modes(tmp_path, capsys):
    _checkpoint(tmp_path / "ck")
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "ck"), "--model", "tiny-moe", "--out", str(out)]) == 0
    assert "tokenizer" not in capsys.readouterr().out
    assert not any((out / name).exists() for name in TOKENIZER_FILES)
    assert {p.name: _mode(p) for p in out.iterdir()} == {"config.json": 0o644, "model.safetensors": 0o644}
