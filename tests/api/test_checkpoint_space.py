"""Trainings and their disk: a training whose checkpoints cannot fit on the checkpoint filesystem is refused
before step 1 with the sizes (API 422 ``checkpoint_space``, a one-line CLI error, the runner failing it
before it launches a rank); ``keep_last`` bounds what is kept. Free space is faked through
:func:`api.service.checkpoint_space.free_bytes`, never by filling a disk."""

from __future__ import annotations

import threading

import pytest

from api.cli.main import main
from api.service import checkpoint_space
from api.service.checkpoint_space import checkpoints_at_once, checkpoints_saved
from api.worker.trainings import run_claimed_training
from costmodel.checkpoint_size import checkpoint_bytes
from db.models import Training
from db.queue import claim_next_training
from problem_rules import validation_rules
from spec.catalog import get_model
from spec.limits import MAX_KEEP_LAST

PER = checkpoint_bytes(get_model("tiny-moe"))  # the training_body's model


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(checkpoint_space, "free_bytes", lambda path: free)


def test_the_checkpoints_on_disk_at_once():
    assert [checkpoints_saved(20, every) for every in (0, 5, 6, 20, 50)] == [1, 4, 4, 1, 1]
    assert checkpoints_at_once(20, 5, 0) == 4  # all kept
    assert checkpoints_at_once(20, 5, 1) == 2  # the one kept and the one being written
    assert checkpoints_at_once(20, 5, 9) == 4 and checkpoints_at_once(20, 0, 1) == 1


def test_free_bytes_reads_the_nearest_existing_directory(tmp_path):
    assert checkpoint_space.free_bytes(tmp_path / "not" / "yet") > 0


def test_a_training_whose_checkpoints_cannot_fit_is_refused_with_the_sizes(client, alice, training_body,
                                                                           monkeypatch):
    body = {**training_body, "checkpoint_every": 5}  # 20 steps: 4 checkpoints
    _free(monkeypatch, PER * 5 // 2)
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert ("body.checkpoint_dir", "checkpoint_space") in validation_rules(r)
    detail = r.json()["detail"]
    assert f"{PER:,} bytes" in detail and f"x 4 saved = {4 * PER:,} bytes" in detail, detail
    assert f"{PER * 5 // 2:,} bytes" in detail and "keep fewer (keep_last)" in detail, detail
    assert client.get("/v1/trainings", headers=alice).json()["total"] == 0  # nothing stored
    r = client.post("/v1/trainings", json={**body, "keep_last": 1}, headers=alice)  # 2 at once fit
    assert r.status_code == 201, r.text
    assert r.json()["keep_last"] == 1 and r.json()["checkpoint_every"] == 5


def test_keep_last_is_bounded(client, alice, training_body):
    r = client.post("/v1/trainings", json={**training_body, "keep_last": MAX_KEEP_LAST + 1}, headers=alice)
    assert ("body.keep_last", "less_than_equal") in validation_rules(r)
    r = client.post("/v1/trainings", json={**training_body, "keep_last": -1}, headers=alice)
    assert ("body.keep_last", "greater_than_equal") in validation_rules(r)


def test_trainings_submit_is_refused_in_one_line_and_sends_keep_last(capsys, keys, server_url, training_body,
                                                                     monkeypatch):
    argv = ["trainings", "submit", "--layout", "tp1 ep2 dp2 mbs1", "--model", "tiny-moe", "--gpu", "cpu", "--gpus",
            "2", "--data", training_body["data_path"], "--steps", "20", "--checkpoint-dir",
            training_body["checkpoint_dir"], "--checkpoint-every", "5", "--url", server_url, "--api-key", keys["alice"]]
    _free(monkeypatch, PER * 3 // 2)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the checkpoints do not fit" in err and f"{4 * PER:,} bytes" in err, err
    assert main([*argv, "--keep-last", "1"]) == 2  # 2 at once still do not fit in 1.5
    assert "(keep_last 1 and the one being written)" in capsys.readouterr().err
    _free(monkeypatch, PER * 2)
    assert main([*argv, "--keep-last", "1", "--json"]) == 0
    assert '"keep_last": 1' in capsys.readouterr().out


def test_cli_train_is_refused_before_any_rank_starts(capsys, tmp_path, monkeypatch):
    _free(monkeypatch, PER - 1)
    ck = tmp_path / "ck"
    code = main(["train", "--data", str(tmp_path), "--model", "tiny-moe", "--steps", "3", "--checkpoint-dir", str(ck),
                 "--gpu", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and f"{PER:,} bytes" in err and "free space" in err, err
    assert not ck.exists() and "step" not in out  # no rank ran, nothing written


def test_the_runner_fails_a_training_whose_disk_filled_since_submission(app, client, alice, db_url, training_body,
                                                                        monkeypatch):
    tid = client.post("/v1/trainings", json=training_body, headers=alice).json()["id"]
    _free(monkeypatch, PER - 1)
    with app.state.sessions() as s:
        row = claim_next_training(s, "r1")
    status = run_claimed_training(row, app.state.sessions, db_url, "r1", 60.0, threading.Event())
    assert status == "failed"
    with app.state.sessions() as s:
        t = s.get(Training, tid)
        assert t.status == "failed" and "the checkpoints do not fit" in t.error and t.started_at is not None
