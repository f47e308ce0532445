"""A database holding what the dashboard shows, made by really running foldtune: a finished tuning job of
tiny-moe on 2 CPU ranks (gloo, 3 trials), a short training of its best layout with checkpoints and a shorter
one at another learning rate (to compare the two), all owned by alice; bob owns a queued job of his own. Shared by the browser tests and
bench/dashboard_screenshots.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner_env import make_runner, session_ray

from db.engine import make_engine, make_sessionmaker
from db.keys import create_api_key
from db.migrate import upgrade

DASH_JOB = {"model": "tiny-moe", "training": {"seq_length": 32, "global_batch_size": 4, "precision": "fp32"},
            "cluster": {"gpu": "cpu", "num_gpus": 2}, "budget": {"max_trials": 3, "max_seconds": 600}}
BOB_JOB = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
           "cluster": {"gpu": "cpu", "num_gpus": 4}, "budget": {"max_trials": 2, "max_seconds": 600}}
TRAIN_STEPS = 12
OTHER_STEPS = 6   # the second training's steps
OTHER_LR = 1e-3   # and its peak learning rate


@dataclass(frozen=True)
class DashboardData:
    database_url: str
    keys: dict[str, str]          # owner name -> API key
    job_id: int                   # alice's finished tuning job
    bob_job_id: int               # bob's queued job (alice must not see it)
    training_id: int              # alice's finished training
    other_training_id: int | None = None  # alice's second, shorter training of the same layout (other lr)


def build_dashboard_data(workdir: Path, max_trials: int = 3, train_steps: int = TRAIN_STEPS) -> DashboardData:
    """Run the job (``max_trials`` trials) and the trainings (``train_steps`` and OTHER_STEPS steps) for real into a
    SQLite file in ``workdir``: about a minute on 2 idle CPU cores with the defaults."""
    from fastapi.testclient import TestClient

    from api.http.app import create_app
    from api.http.settings import ApiSettings
    from executor.dataset.prepare import prepare_dataset

    url = f"sqlite:///{workdir / 'foldtune.sqlite3'}"
    upgrade(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        keys = {name: create_api_key(session, name)[1] for name in ("alice", "bob")}
    engine.dispose()
    _own_ray()
    root = workdir / "users"  # the service's data root: alice's paths lie in root / "alice"
    (root / "alice").mkdir(parents=True, exist_ok=True)
    app = create_app(ApiSettings(database_url=url, data_root=root))
    with TestClient(app) as client:
        alice = {"X-API-Key": keys["alice"]}
        job = client.post("/v1/jobs", json={**DASH_JOB, "budget": {**DASH_JOB["budget"], "max_trials": max_trials}},
                          headers=alice)
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        _run_once(url, root)
        finished = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
        assert finished["status"] == "succeeded", finished["error"]
        docs = Path(__file__).resolve().parents[2] / "docs"
        data = prepare_dataset([str(docs)], str(root / "alice" / "data"), heldout_fraction=0.1).path
        training = client.post("/v1/trainings", headers=alice, json={
            "job_id": job_id, "data_path": str(data), "steps": train_steps, "checkpoint_dir": str(root / "alice" / "ckpt"),
            "checkpoint_every": train_steps // 2, "warmup_steps": 2, "eval_every": max(train_steps // 3, 1),
            "eval_batches": 1})
        assert training.status_code == 201, training.text
        training_id = training.json()["id"]
        _run_once(url, root)
        done = client.get(f"/v1/trainings/{training_id}", headers=alice).json()
        assert done["status"] == "succeeded", done["error"]
        other = client.post("/v1/trainings", headers=alice, json={
            "job_id": job_id, "data_path": str(data), "steps": OTHER_STEPS, "lr": OTHER_LR, "min_lr": OTHER_LR / 10,
            "checkpoint_dir": str(root / "alice" / "ckpt-other"), "warmup_steps": 1, "eval_every": OTHER_STEPS // 2,
            "eval_batches": 1})
        assert other.status_code == 201, other.text
        _run_once(url, root)
        done = client.get(f"/v1/trainings/{other.json()['id']}", headers=alice).json()
        assert done["status"] == "succeeded", done["error"]
        bob_job = client.post("/v1/jobs", json=BOB_JOB, headers={"X-API-Key": keys["bob"]})
        assert bob_job.status_code == 201, bob_job.text
    app.state.engine.dispose()
    return DashboardData(url, keys, job_id, bob_job.json()["id"], training_id, other.json()["id"])


def _own_ray() -> None:
    """This process's Ray: a local instance of its own even when someone on the machine ran `ray start`
    (ray.init() without an address would join that cluster: /tmp/ray/ray_current_cluster)."""
    import os

    had = os.environ.get("RAY_ADDRESS")
    if had is None:
        os.environ["RAY_ADDRESS"] = "local"
    try:
        session_ray()
    finally:
        if had is None:
            os.environ.pop("RAY_ADDRESS", None)


def _run_once(url: str, data_root: Path) -> None:
    runner = make_runner(url, data_root=data_root)
    try:
        assert runner.run(once=True) == 1
    finally:
        runner.close()
