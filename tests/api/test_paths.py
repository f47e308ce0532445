"""Server paths an API user names are confined to their own directory under FOLDTUNE_DATA_ROOT
(api.service.paths): traversal, absolute paths, symbolic links out of the root and another owner's
directory are refused with one answer that does not say whether the path exists; relative paths are
the owner's; a service runner checks the stored paths again (a link swapped in after submission)."""

import os
import threading

import pytest
from problem_rules import validation_rules

from api.service.paths import owner_dir_name
from api.worker.trainings import run_claimed_training
from db.queue import claim_next_training
from db.models import Training

RULE = "path_in_owner_root"


def _refused(client, headers, body, field):
    """The problem a body is refused with, asserting it names the path rule on ``field``."""
    r = client.post("/v1/trainings", json=body, headers=headers)
    assert (f"body.{field}", RULE) in validation_rules(r)
    return r.json()


def test_outside_paths_are_refused_alike_whether_or_not_they_exist(client, alice, training_body, data_root, tmp_path):
    (tmp_path / "exists").mkdir()
    link = data_root / "alice" / "out"
    link.symlink_to(tmp_path / "exists")  # a link inside alice's directory pointing out of the root
    answers = {}
    for field, path in ((f, p) for f in ("data_path", "checkpoint_dir") for p in ("/etc", "/etc/no-such-dir-foldtune", str(tmp_path / "exists"), str(tmp_path / "missing"),
                 "../../exists", "../../missing", "data/../../../exists", "out", "out/sub")):
        problem = _refused(client, alice, {**training_body, field: path}, field)
        # nothing but the text sent shows in the answer: not the resolved target, not whether it exists
        answers[field, path] = problem["detail"].replace(repr(path), "PATH").replace(field, "FIELD")
        assert str(tmp_path / "exists") not in problem["detail"] or path == str(tmp_path / "exists")
    assert len(set(answers.values())) == 1, answers


def test_another_owners_directory_is_out_of_reach(client, alice, bob, training_body, data_root):
    """bob can neither read alice's data nor resume from (and write into) her checkpoints."""
    created = client.post("/v1/trainings", json={**training_body, "checkpoint_every": 4}, headers=alice)
    assert created.status_code == 201, created.text
    alices = created.json()
    (data_root / "bob" / "data").mkdir(parents=True)
    bob_body = {**training_body, "data_path": "data", "checkpoint_dir": "ckpt"}
    assert client.post("/v1/trainings", json=bob_body, headers=bob).status_code == 201
    for field, path in (("checkpoint_dir", alices["checkpoint_dir"]), ("checkpoint_dir", "../alice/ckpt"),
                        ("data_path", alices["data_path"]), ("data_path", "../alice/data")):
        _refused(client, bob, {**bob_body, field: path}, field)


def test_relative_paths_are_the_owners_and_stored_resolved(client, alice, training_body, data_root):
    (data_root / "alice" / "corpora").mkdir()
    (data_root / "alice" / "latest-corpus").symlink_to(data_root / "alice" / "corpora")  # a link that stays inside
    body = {**training_body, "data_path": "latest-corpus", "checkpoint_dir": "runs/../runs/one"}
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert r.status_code == 201, r.text
    real = os.path.realpath(data_root / "alice")
    assert r.json()["data_path"] == os.path.join(real, "corpora")
    assert r.json()["checkpoint_dir"] == os.path.join(real, "runs", "one")
    assert ("body.data_path", "data_path_exists") in validation_rules(
        client.post("/v1/trainings", json={**body, "data_path": "not-there"}, headers=alice))


def test_owner_directory_names_cannot_escape_or_collide():
    assert owner_dir_name("alice", 1) == "alice"
    for i, odd in enumerate(["..", ".", "a/b", "Alice", "x\\y", "", "_owner-2", "é"], start=2):
        assert owner_dir_name(odd, i) == f"_owner-{i}"


def test_the_runner_checks_the_stored_paths_again(client, alice, app, training_body, data_root, tmp_path, db_url):
    """A link placed where the checkpoint directory will be, after submission, sends it out of the root: the
    service runner fails the training with the rule, before anything runs, and writes nothing there."""
    r = client.post("/v1/trainings", json=training_body, headers=alice)
    assert r.status_code == 201, r.text
    outside = tmp_path / "victim"
    outside.mkdir()
    (data_root / "alice" / "ckpt").symlink_to(outside)
    with app.state.sessions() as s:
        training = claim_next_training(s, "r1")
    status = run_claimed_training(training, app.state.sessions, db_url, "r1", 1.0, threading.Event(),
                                  data_root=data_root)
    assert status == "failed"
    with app.state.sessions() as s:
        row = s.get(Training, training.id)
        assert row.status == "failed" and RULE in row.error and str(outside) not in row.error
    assert list(outside.iterdir()) == []
