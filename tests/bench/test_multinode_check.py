"""bench/multinode_check.py, the CPU side of issue 20's GPU bar: the placement and side-by-side checks read
from a real (migrated) SQLite service database, and each check fails on the placements it must reject."""

from __future__ import annotations

import pytest

from bench import multinode_check as mc

NODE_A, NODE_B = "a" * 56, "b" * 56


def _m(world: int, ranks: list[tuple[str, list[str]]], window: list[float]) -> dict:
    return {"ok": True, "world_size": world, "placement": [{"node": n, "ip": "10.0.0.1", "gpus": g} for n, g in ranks],
            "run_window": window}


def _trial(number: int, measurement: dict, status: str = "succeeded") -> dict:
    return {"number": number, "status": status, "failure_kind": None, "failure_reason": None,
            "measurement": measurement}


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


def test_both_checks_pass_on_trials_side_by_side_on_their_own_gpus(service_db, capsys):
    job_id, cal, trials = mc.load_trials(service_db)
    assert job_id == 1 and cal["ray_cluster"]["gpus_per_node"] == 1 and [t["number"] for t in trials] == [0, 1, 2]
    assert mc.main(["placement", "--db", service_db]) == 0
    assert mc.main(["overlap", "--db", service_db]) == 0
    out = capsys.readouterr().out
    assert "trials 0 and 1 ran side by side for 8.0 s on disjoint GPUs" in out
    assert "00:01:40.000 .. 00:01:50.000 UTC" in out  # trial 0's run window, printed in UTC


def test_two_gpu_trials_must_use_both_gpus_of_their_node():
    good = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_A, ["1"])], [0.0, 1.0]))]
    assert mc.placement_problems(good, 2, want_gpus=2) == []
    one_gpu = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_A, ["0"])], [0.0, 1.0]))]
    assert any("two ranks on one GPU" in p for p in mc.placement_problems(one_gpu, 2, want_gpus=2))
    split = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_B, ["0"])], [0.0, 1.0]))]
    assert any("ranks 0 and 1 are not on one Ray node" in p for p in mc.placement_problems(split, 2))
    # across nodes: ranks 0,1 on one node and 2,3 on another is what the planner assumed with 2 per node
    spanning = [_trial(0, _m(4, [(NODE_A, ["0"]), (NODE_A, ["1"]), (NODE_B, ["0"]), (NODE_B, ["1"])], [0.0, 1.0]))]
    assert mc.placement_problems(spanning, 2) == []
    assert mc.placement_problems(spanning, 4)  # ... and not what a planner of 4 per node assumed
    assert mc.placement_problems([_trial(0, {}, status="failed")], 2) == ["no succeeded trial"]


def test_overlap_needs_trials_at_the_same_time_on_disjoint_gpus():
    one_after_other = [_trial(0, _m(1, [(NODE_A, ["0"])], [0.0, 5.0])), _trial(1, _m(1, [(NODE_A, ["1"])], [5.5, 9.0]))]
    assert mc.overlapping_pairs(one_after_other) == []
    same_gpu = [_trial(0, _m(1, [(NODE_A, ["0"])], [0.0, 5.0])), _trial(1, _m(1, [(NODE_A, ["0"])], [1.0, 9.0]))]
    assert mc.overlapping_pairs(same_gpu) == [(0, 1, 4.0)]
    assert mc.shared_gpus(same_gpu, 0, 1) == {(NODE_A, "0")}
