"""``foldtune tune``: one command sets up the embedded service (SQLite in the data dir, migrations) and
runs a real tuning job through Ray, printing each trial and ending with the table and the best layout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from service_env import live_server
from runner_env import session_ray, wait_no_rank_actors
from sqlalchemy import create_engine, text

from api.cli.main import main
from api.http.app import create_app
from api.http.settings import ApiSettings


def _tune(tmp_path, *args: str, ray_address: str | None = None, timeout: float = 600):
    env = {**os.environ, "FOLDTUNE_DATA_DIR": str(tmp_path / "data"), "RAY_AUTH_MODE": "disabled"}
    env.pop("FOLDTUNE_DATABASE_URL", None)
    if ray_address:
        env["FOLDTUNE_RAY_ADDRESS"] = ray_address
    return subprocess.run([sys.executable, "-m", "api.cli.main", "tune", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_tune_runs_a_real_job_on_a_fresh_data_dir_and_best_finds_its_layout(tmp_path, monkeypatch, capsys):
    # tune calibrates the machine before its search, on cpu too (minimal here: seconds, the code path of quick)
    done = _tune(tmp_path, "--gpus", "2", "--max-trials", "1", "--timed-steps", "1", "--auto-calibrate", "minimal",
                 ray_address=session_ray())
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "job 1: no calibrated profile of cpu yet: calibrating this machine (minimal" in out
    assert re.search(r"^job 1: calibrated in \d+ s, stored as 'cpu-2-ranks-auto-calibrated'", out, re.M), out
    assert "priced with hardware profile 'cpu-2-ranks-auto-calibrated' (calibrated by this job)" in out
    assert f"created an API key for owner 'local' in {tmp_path / 'data' / 'api-key'}" in out
    # the README's `foldtune best ...` after `foldtune tune`: same owner (the local key), same precision (fp32)
    tuned = re.search(r"^best layout: (.+?)  ", out, re.M).group(1)
    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("FOLDTUNE_API_KEY", raising=False)
    app = create_app(ApiSettings(database_url=f"sqlite:///{tmp_path / 'data' / 'foldtune.sqlite3'}"))
    with live_server(app) as url:
        code = main(["best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "2", "--url", url])
        jobs_code = main(["jobs", "--url", url])
    app.state.engine.dispose()
    best_out = capsys.readouterr().out
    assert code == 0 and jobs_code == 0, best_out
    assert f"  layout:    {tuned}\n" in best_out and "job 1 trial" in best_out
    assert "succeeded" in best_out.split("CREATED", 1)[1]  # `foldtune jobs` lists tune's job
    assert "trial  0" in out and "measured" in out
    assert "measured vs predicted" in out and "best layout: tp" in out and "job 1: succeeded" in out
    db = tmp_path / "data" / "foldtune.sqlite3"
    assert db.exists() and (tmp_path / "data" / "foldtune-optuna.sqlite3").exists()
    # the Optuna study (what optuna-dashboard opens) says what it searched
    import optuna

    study = optuna.load_study(study_name="job-1", storage=f"sqlite:///{tmp_path / 'data' / 'foldtune-optuna.sqlite3'}")
    assert {k: study.user_attrs[k] for k in ("foldtune_job_id", "model", "gpu", "num_gpus", "seq_length",
                                             "global_batch_size", "precision")} == {
        "foldtune_job_id": 1, "model": "tiny-moe", "gpu": "cpu", "num_gpus": 2, "seq_length": 64,
        "global_batch_size": 8, "precision": "fp32"}
    assert study.user_attrs["hardware_profile"] == "cpu-2-ranks-auto-calibrated"  # what priced it
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        status, best = conn.execute(text("SELECT status, best_trial_id FROM jobs WHERE id = 1")).one()
        trials = conn.execute(text("SELECT count(*) FROM trials WHERE job_id = 1")).scalar()
    engine.dispose()
    assert status == "succeeded" and best is not None and trials == 1
    assert wait_no_rank_actors() == []


@pytest.mark.slow  # a child process importing the CLI; tests/api/test_cli.py checks one-line errors in-process
def test_tune_rejects_bad_input_in_one_line(tmp_path):
    done = _tune(tmp_path, "--model", "no-such-model", "--max-trials", "1", timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("foldtune: error: ") and "no-such-model" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # starts Ray
def test_tune_on_gpus_the_ray_cluster_lacks_is_one_error_line(tmp_path):
    done = _tune(tmp_path, "--gpu", "h100-sxm", "--gpus", "2", "--seq", "64", "--gbs", "8", "--model", "small-moe",
                 ray_address=session_ray(),
                 timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("foldtune: error: --gpus 2 x h100-sxm needs 2 GPUs in the Ray cluster, it has 0 "
                                   "(--gpu cpu runs CPU ranks)")
    assert not (tmp_path / "data" / "foldtune.sqlite3").exists()  # nothing stored
