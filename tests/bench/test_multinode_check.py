"""bench/multinode_check.py (a child process): the placement and side-by-side checks read from a real
(migrated) SQLite service database."""

from __future__ import annotations

import pytest

NODE_A = "a" * 56


def _m(world: int, ranks: list[tuple[str, list[str]]], window: list[float]) -> dict:
    return {"ok": True, "world_size": world, "placement": [{"node": n, "ip": "10.0.0.1", "gpus": g} for n, g in ranks],
            "run_window": window}


@pytest.fixture
def service_db(tmp_path):
    """A migrated SQLite service database holding one job (2 GPUs per node) of three trials: two that ran
    side by side on GPUs 0 and 1, one that failed."""
    from db.engine import make_engine, make_sessionmaker
    from db.migrate import upgrade
    from db.models import Job, Owner, Trial

    url = f"sqlite:///{tmp_path / 'foldtune.sqlite3'}"
    upgrade(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        owner = Owner(name="local")
        session.add(owner)
        session.flush()
        job = Job(owner_id=owner.id, status="succeeded", model_name="small-moe", model_spec={}, training_spec={},
                  cluster={}, gpu_name="h100-sxm", num_gpus=1, signature="s" * 64, max_trials=3,
                  calibration={"ray_cluster": {"gpus_per_node": 1}})
        session.add(job)
        session.flush()
        for number, m in ((0, _m(1, [(NODE_A, ["0"])], [100.0, 110.0])), (1, _m(1, [(NODE_A, ["1"])], [101.0, 109.0]))):
            session.add(Trial(job_id=job.id, number=number, status="succeeded", config={}, measurement=m))
        session.add(Trial(job_id=job.id, number=2, status="failed", config={}, failure_kind="node_lost",
                          failure_reason="node lost: ...", measurement={"ok": False}))
        session.commit()
    engine.dispose()
    return str(tmp_path / "foldtune.sqlite3")


def test_both_checks_pass_on_trials_side_by_side_on_their_own_gpus(service_db, script):
    placement = script("multinode_check", "placement", "--db", service_db)
    assert placement.returncode == 0, placement.stdout + placement.stderr
    assert [line.split(":")[0] for line in placement.stdout.splitlines()[:3]] == [
        "job 1 trial 0", "job 1 trial 1", "job 1 trial 2"]  # the newest job, every trial
    assert "placement ok" in placement.stdout and "(1 per node)" in placement.stdout  # the job's calibration
    overlap = script("multinode_check", "overlap", "--db", service_db)
    assert overlap.returncode == 0, overlap.stdout + overlap.stderr
    out = placement.stdout + overlap.stdout
    assert "trials 0 and 1 ran side by side for 8.0 s on disjoint GPUs" in out
    assert "00:01:40.000 .. 00:01:50.000 UTC" in out  # trial 0's run window, printed in UTC
