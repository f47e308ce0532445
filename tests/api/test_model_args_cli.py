"""The front door of the local commands: ``foldtune profile``, ``train`` and ``tune`` refuse a model, proxy or
layout the executor cannot run in one line with exit code 2, before any rank, Ray or database starts."""

from __future__ import annotations

import pytest

from api.cli.main import main

DROPOUT = ("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\nvocab_size: 256\n"
           "num_experts: 4\nmoe_router_topk: 2\nhidden_dropout: 0.1\n")


@pytest.fixture
def dropout_file(tmp_path):
    path = tmp_path / "drop-moe.yaml"
    path.write_text(DROPOUT)
    return str(path)


def _refused(capsys, argv, *says):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("foldtune: error: ") and err.count("\n") == 1, (code, out, err)
    assert all(s in err for s in says), err
    return err


def test_profile_refuses_before_launching(capsys, dropout_file):
    _refused(capsys, ["profile", "--model-file", dropout_file, "--ep", "2"], "[executor_model]", "dropout")
    _refused(capsys, ["profile", "--model", "tiny-moe", "--layers", "3"], "[proxy_layers]")
    _refused(capsys, ["profile", "--model", "tiny-moe", "--proxy", "tiny", "--ep", "3"], "[executor_experts_ep]",
             "num_experts (8) must be divisible by ep (3)")
    _refused(capsys, ["profile", "--model", "tiny-moe", "--gbs", "3", "--ep", "2"], "[gbs_mbs_dp]")


def test_train_refuses_before_launching(capsys, dropout_file, tmp_path):
    base = ["train", "--data", str(tmp_path), "--steps", "1", "--gpus", "2"]
    _refused(capsys, [*base, "--model-file", dropout_file, "--layout", "ep2"], "[executor_model]")
    _refused(capsys, [*base, "--model", "tiny-moe", "--layout", "tp2", "--seq", "33"], "[executor_seq_cp]", "tp·cp")
    _refused(capsys, [*base, "--model", "tiny-moe", "--proxy", "tiny", "--job", "1"], "--job trains the job's model")


def test_tune_refuses_before_ray_and_the_database(capsys, dropout_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("FOLDTUNE_DATABASE_URL", raising=False)
    _refused(capsys, ["tune", "--model-file", dropout_file], "[executor_model]", "dropout")
    _refused(capsys, ["tune", "--model", "mixtral-8x7b", "--layers", "40"], "[proxy_layers]", "[1, 32]")
    _refused(capsys, ["tune", "--seq", "63"], "[executor_layout]", "2·cp")
    assert not (tmp_path / "data" / "foldtune.sqlite3").exists()
