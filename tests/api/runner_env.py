"""Shared by the runner tests: one Ray instance per test session, a runner bound to a test database, and
the check that no rank process outlives its trial."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from api.worker.runner import Runner, RunnerSettings
from api.worker.trials import TrialSettings

TINY_JOB = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8, "precision": "fp32"},
            "cluster": {"gpu": "cpu", "num_gpus": 2}, "budget": {"max_trials": 6, "max_seconds": 900}}


def session_ray() -> str:
    """Start (once per process) the local Ray every runner test shares; returns its GCS address."""
    import ray

    from executor.launch_ray import attach_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    attach_ray()
    return ray.get_runtime_context().gcs_address


def make_runner(db_url: str, runner_id: str = "test-runner", stale_after_s: float = 30.0, data_root=None,
                **trial: object) -> Runner:
    """A runner on ``db_url`` with a short step budget (1 warm-up, 1 timed step); ``data_root`` as the
    service's FOLDTUNE_DATA_ROOT (None: trusts stored training paths, as the local CLI)."""
    settings = RunnerSettings(database_url=db_url, runner_id=runner_id, heartbeat_s=1.0, stale_after_s=stale_after_s,
                              poll_s=0.5, trial=TrialSettings(**{"warmup_steps": 1, "timed_steps": 1,
                                                                 "timeout_s": 120.0, **trial}),
                              data_root=data_root)
    return Runner(settings)


@contextlib.contextmanager
def owner_session(db_url: str, owner_name: str = "alice") -> Iterator[tuple]:
    """(session, owner) on the migrated database ``db_url``; the owner is created if new."""
    from db.engine import make_engine, make_sessionmaker
    from db.keys import get_or_create_owner
    from db.migrate import upgrade

    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            owner = get_or_create_owner(session, owner_name)
            session.commit()
            yield session, owner
    finally:
        engine.dispose()


@contextlib.contextmanager
def runner_process(db_url: str, runner_id: str, log_path, **env: str) -> Iterator[subprocess.Popen]:
    """A `foldtune runner --once` process on ``db_url`` and this session's Ray (heartbeat every second),
    its output in ``log_path``; killed on exit if still alive. ``env``: more environment variables."""
    environ = {**os.environ, "FOLDTUNE_DATABASE_URL": db_url, "FOLDTUNE_RAY_ADDRESS": session_ray(),
               "FOLDTUNE_RUNNER_ID": runner_id, "FOLDTUNE_HEARTBEAT_S": "1", "RAY_AUTH_MODE": "disabled", **env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "runner", "--once"], env=environ,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def run_one_claim(db_url: str, data_root=None) -> None:
    """Let a fresh test runner claim and finish exactly one queued job or training, then close it."""
    runner = make_runner(db_url, data_root=data_root)
    try:
        assert runner.run(once=True) == 1
    finally:
        runner.close()


def submit_and_run(client, body: dict, headers: dict, db_url: str) -> dict:
    """POST ``body`` as a job, let a fresh test runner run it to its end, and return the job as GET shows it."""
    submitted = client.post("/v1/jobs", json=body, headers=headers)
    assert submitted.status_code == 201, submitted.text
    run_one_claim(db_url)
    return client.get(f"/v1/jobs/{submitted.json()['id']}", headers=headers).json()


def rank_actor_pids() -> list[int]:
    """Processes of rank actors (their title is ``ray::RankActor...``) of this test session still alive: those
    whose environment carries this session's FOLDTUNE_TEST_SESSION (tests/conftest.py), inherited through
    every Ray this session starts or joins, also by orphans. Other users' tests on a shared machine have
    rank actors of their own; those are not ours to count."""
    mark = f"FOLDTUNE_TEST_SESSION={os.environ['FOLDTUNE_TEST_SESSION']}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if not cmd.startswith("ray::RankActor"):
                continue
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            with open(f"/proc/{entry}/environ", "rb") as f:
                ours = mark in f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if ours and not zombie:
            pids.append(int(entry))
    return pids


def wait_no_rank_actors(timeout_s: float = 20.0) -> list[int]:
    """Rank actor processes left after ``timeout_s`` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout_s
    while (pids := rank_actor_pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


@contextlib.contextmanager
def simulated_ray_cluster(nodes: int = 2, slots: int = 2, head_system_config: dict | None = None) -> Iterator:
    """A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head without CPUs and ``nodes``
    worker nodes of ``slots`` CPUs and ``slots`` units of ``fake_gpu`` each, the rank resource of gloo ranks
    (FOLDTUNE_RAY_RANK_RESOURCE); any Ray this process started before is shut down first. The environment is
    restored and the cluster shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    from executor import launch_ray

    saved = dict(os.environ)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[launch_ray.RANK_RESOURCE_ENV] = "fake_gpu"
    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 0, "include_dashboard": False}
    if head_system_config:
        head["_system_config"] = head_system_config
    sim = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes):
        sim.add_node(num_cpus=slots, resources={"fake_gpu": slots})
    sim.wait_for_nodes()
    try:
        yield sim
    finally:
        ray.shutdown()
        sim.shutdown()
        os.environ.clear()
        os.environ.update(saved)
