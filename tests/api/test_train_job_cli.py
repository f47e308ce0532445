"""``foldtune train --job ID``: a tuning job's best layout trained through the service code and the runner.

A real `foldtune tune` job (1 trial, tiny-moe on 2 CPU ranks, no calibration first: tests/api/test_tune_cli.py runs
tune's calibration) goes into a fresh SQLite database; `foldtune
train --job 1` then stores a training linked to it (with the best trial's predicted step time) and runs it
in-process through Ray, printing each stored step with measured and predicted step time. Options that
contradict the job, unknown jobs and jobs without a successful trial are one error line each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from runner_env import TINY_JOB, session_ray, wait_no_rank_actors
from sqlalchemy import create_engine, text

from api.cli.main import main
from executor.dataset.prepare import prepare_dataset

STEPS = 5


def _cli(tmp_path, *args: str, ray_address: str | None = None, timeout: float = 600):
    env = {**os.environ, "FOLDTUNE_DATA_DIR": str(tmp_path / "home"), "RAY_AUTH_MODE": "disabled"}
    env.pop("FOLDTUNE_DATABASE_URL", None)
    if ray_address:
        env["FOLDTUNE_RAY_ADDRESS"] = ray_address
    return subprocess.run([sys.executable, "-m", "api.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def dataset(tmp_path):
    docs = Path(__file__).resolve().parents[2] / "docs"
    return str(prepare_dataset([str(docs)], str(tmp_path / "corpus"), heldout_fraction=0.1).path)


@pytest.mark.slow
def test_train_job_trains_the_best_layout_through_the_runner(tmp_path, dataset):
    ray = session_ray()
    tuned = _cli(tmp_path, "tune", "--gpus", "2", "--max-trials", "1", "--timed-steps", "1", "--auto-calibrate", "off",
                 ray_address=ray)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    done = _cli(tmp_path, "train", "--job", "1", "--data", dataset, "--steps", str(STEPS), "--lr-warmup", "1",
                "--eval-batches", "1", ray_address=ray)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    step_lines = [line for line in out if re.match(r"step +\d+ ", line)]
    assert [line.split()[1] for line in step_lines] == [str(n) for n in range(1, STEPS + 1)]
    assert all("loss" in line and "predicted" in line for line in step_lines)
    assert "training 1: succeeded" in out
    assert any(re.fullmatch(r"step time: predicted \S+ s, measured \S+ s \(median of stored steps\), error [-+]\d+% "
                            r"\(predicted - measured\) / measured", line) for line in out), out

    engine = create_engine(f"sqlite:///{tmp_path / 'home' / 'foldtune.sqlite3'}")
    with engine.connect() as conn:
        best_config, best_pred = conn.execute(text(
            "SELECT t.config, t.predicted_step_time_s FROM jobs j JOIN trials t ON t.id = j.best_trial_id "
            "WHERE j.id = 1")).one()
        job_id, status, config, predicted, ckpt = conn.execute(text(
            "SELECT job_id, status, config, predicted_step_time_s, checkpoint_dir FROM trainings WHERE id = 1")).one()
        metrics = conn.execute(text("SELECT step, loss, step_time_s FROM training_metrics WHERE training_id = 1 "
                                    "ORDER BY step")).all()
    engine.dispose()
    assert (job_id, status, config) == (1, "succeeded", best_config)
    assert predicted is not None and predicted == best_pred
    assert [m.step for m in metrics] == list(range(1, STEPS + 1)) and all(m.step_time_s > 0 for m in metrics)
    assert Path(ckpt) == tmp_path / "home" / "checkpoints" / "job-1" and any(Path(ckpt).iterdir())

    # The served view compares every stored step with the prediction.
    from api.service.trainings import metric_views
    from db.engine import make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{tmp_path / 'home' / 'foldtune.sqlite3'}")
    with make_sessionmaker(engine)() as session:
        views = metric_views(session, 1, after_step=-1, limit=100)
    engine.dispose()
    assert [v.step for v in views] == list(range(1, STEPS + 1))
    for v in views:
        assert v.predicted_step_time_s == predicted
        assert v.step_time_error == pytest.approx((predicted - v.step_time_s) / v.step_time_s)
    assert wait_no_rank_actors() == []


@pytest.fixture
def queued_job(db_url):
    """A tuning job stored but never run (so it has no successful trial), owned by the local owner."""
    from api.service.jobs import submit_job
    from api.schemas.jobs import JobCreate
    from db.engine import make_engine, make_sessionmaker
    from db.keys import get_or_create_owner

    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as session:
        owner = get_or_create_owner(session, "local")
        session.commit()
        job, _ = submit_job(session, owner, JobCreate.model_validate(TINY_JOB), None)
        job_id = job.id
    engine.dispose()
    return job_id


def _train(db_url, dataset, *args):
    return main(["train", "--database-url", db_url, "--data", dataset, "--steps", "3", *args])


def _one_error_line(err: str) -> str:
    assert err.startswith("foldtune: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_train_job_errors_are_one_line(db_url, queued_job, dataset, capsys):
    assert _train(db_url, dataset, "--job", "999") == 2
    assert "job 999 does not exist" in _one_error_line(capsys.readouterr().err)

    assert _train(db_url, dataset, "--job", str(queued_job)) == 2
    assert f"job {queued_job} (queued) has no successful trial" in _one_error_line(capsys.readouterr().err)

    assert _train(db_url, dataset, "--job", str(queued_job), "--model", "small-moe", "--gpus", "4", "--seq", "64",
                  "--gpu", "h100") == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "--model small-moe (the job's is tiny-moe)" in err and "--gpus 4 (the job's is 2)" in err
    assert "--gpu h100 (the job's hardware cpu trains on cpu)" in err and "--seq" not in err  # --seq 64 is the job's own

    with pytest.raises(SystemExit) as exc:
        _train(db_url, dataset, "--job", str(queued_job), "--layout", "dp2")
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    assert _train(db_url, dataset, "--layout", "dp1") == 2
    assert "--model is required with --layout" in _one_error_line(capsys.readouterr().err)


def test_train_job_stores_nothing_when_the_job_has_no_best(db_url, queued_job, dataset):
    from db.engine import make_engine

    assert _train(db_url, dataset, "--job", str(queued_job)) == 2
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM trainings")).scalar() == 0
    engine.dispose()
