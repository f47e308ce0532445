"""SIGTERM to a real `foldtune runner` process mid-trial, on a Ray of its own with token authentication
on: its first trial runs to success under auth, the second (hung in a step) is abandoned at once, the
job is back in the queue within seconds (not after the stale-claim timeout), and no process the runner
started (Ray's own, the rank actors) outlives it."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from runner_env import owner_session, rank_actor_pids
from sqlalchemy import select

from db.engine import make_engine, make_sessionmaker
from db.models import Job, Trial
from executor.launch_ray import pid_alive

pytestmark = pytest.mark.slow


def _submit(db_url: str) -> int:
    from api.schemas.jobs import JobCreate
    from api.service.jobs import submit_job

    with owner_session(db_url) as (session, owner):
        request = JobCreate.model_validate({
            "model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8, "precision": "fp32"},
            "cluster": {"gpu": "cpu", "num_gpus": 2}, "budget": {"max_trials": 4, "max_seconds": 900}})
        return submit_job(session, owner, request, None)[0].id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (by parent pid), with its command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = _cmdline(child)
                frontier.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_sigterm_mid_trial_requeues_the_job_at_once_and_leaves_no_process(db_url, tmp_path):
    job_id = _submit(db_url)
    data_dir = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "FOLDTUNE_RAY_ADDRESS", "RAY_ADDRESS")}
    env.update({"FOLDTUNE_DATABASE_URL": db_url, "FOLDTUNE_DATA_DIR": str(data_dir), "FOLDTUNE_RUNNER_ID": "leaving",
                "FOLDTUNE_HEARTBEAT_S": "1", "FOLDTUNE_RAY_NUM_CPUS": "4", "FOLDTUNE_TRIAL_WARMUP_STEPS": "1",
                "FOLDTUNE_TRIAL_STEPS": "1", "FOLDTUNE_TRIAL_TIMEOUT_S": "300",
                # trial 1's rank 0 hangs after its first timed step: only a real cancel ends it before 300 s
                "FOLDTUNE_FAULT": "hang:rank=0:step=0:trial=1",
                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    port = _free_port()
    env["FOLDTUNE_RUNNER_HEALTH_PORT"] = str(port)
    log_path = tmp_path / "runner.log"
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)

    def trials() -> list[Trial]:
        with sessions() as session:
            return list(session.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)))

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "runner"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:  # until trial 1 runs (trial 0 finished) and its rank actors are up
            rows = trials()
            tree = _descendants(proc.pid)
            if (len(rows) == 2 and rows[1].status == "running"
                    and sum(cmd.startswith("ray::RankActor") for cmd in tree.values()) == 2):
                break
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the runner never reached its second trial\n" + log_path.read_text()
            time.sleep(0.2)
        assert rows[0].status == "succeeded", rows[0].failure_reason  # a real trial ran with token auth on
        time.sleep(1.5)  # well into the hung step
        tree = _descendants(proc.pid)
        # the session mark reaches the rank actors (runner_env.rank_actor_pids relies on it)
        assert sorted(rank_actor_pids()) == sorted(p for p, cmd in tree.items() if cmd.startswith("ray::RankActor"))

        # Ray was started with token auth and the token file the runner generated (0600) in its data dir.
        token = data_dir / "ray_auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) == 64
        ray_procs = [pid for pid, cmd in tree.items() if "gcs_server" in cmd or "raylet" in cmd]
        assert ray_procs, tree
        for pid in ray_procs:
            ray_env = _environ(pid)
            assert ray_env.get("RAY_AUTH_MODE") == "token" and ray_env.get("RAY_AUTH_TOKEN_PATH") == str(token)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            assert answer.status == 200 and json.load(answer) == {"status": "ok", "runner_id": "leaving"}

        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while True:  # the job is back in the queue within seconds
            with sessions() as session:
                job = session.get(Job, job_id)
            if job.status == "queued":
                break
            # the stale-claim requeue would take 60 s; this is the trial's teardown plus one transaction
            assert time.monotonic() - sent < 30, f"job still {job.status}\n" + log_path.read_text()
            time.sleep(0.1)
        assert job.claimed_by is None
        assert proc.wait(30) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    rows = trials()
    engine.dispose()
    assert [(t.status, t.failure_kind, t.failure_reason) for t in rows[1:]] == [("failed", "lost", "runner shut down")]
    out = log_path.read_text()
    assert "SIGTERM, shutting down" in out and "Traceback" not in out, out

    deadline = time.monotonic() + 15
    while (left := {pid: cmd for pid, cmd in tree.items() if pid_alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}, f"processes the runner started outlived it: {left}"
