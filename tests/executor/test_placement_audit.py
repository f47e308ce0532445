"""executor/placement_audit.py: each check fails on the placements it must reject."""

from __future__ import annotations

from executor.placement_audit import overlapping_pairs, placement_problems, shared_gpus

NODE_A, NODE_B = "a" * 56, "b" * 56


def _m(world: int, ranks: list[tuple[str, list[str]]], window: list[float]) -> dict:
    return {"ok": True, "world_size": world, "placement": [{"node": n, "ip": "10.0.0.1", "gpus": g} for n, g in ranks],
            "run_window": window}


def _trial(number: int, measurement: dict, status: str = "succeeded") -> dict:
    return {"number": number, "status": status, "failure_kind": None, "failure_reason": None,
            "measurement": measurement}


def test_two_gpu_trials_must_use_both_gpus_of_their_node():
    good = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_A, ["1"])], [0.0, 1.0]))]
    assert placement_problems(good, 2, want_gpus=2) == []
    one_gpu = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_A, ["0"])], [0.0, 1.0]))]
    assert any("two ranks on one GPU" in p for p in placement_problems(one_gpu, 2, want_gpus=2))
    split = [_trial(0, _m(2, [(NODE_A, ["0"]), (NODE_B, ["0"])], [0.0, 1.0]))]
    assert any("ranks 0 and 1 are not on one Ray node" in p for p in placement_problems(split, 2))
    # across nodes: ranks 0,1 on one node and 2,3 on another is what the planner assumed with 2 per node
    spanning = [_trial(0, _m(4, [(NODE_A, ["0"]), (NODE_A, ["1"]), (NODE_B, ["0"]), (NODE_B, ["1"])], [0.0, 1.0]))]
    assert placement_problems(spanning, 2) == []
    assert placement_problems(spanning, 4)  # ... and not what a planner of 4 per node assumed
    assert placement_problems([_trial(0, {}, status="failed")], 2) == ["no succeeded trial"]


def test_overlap_needs_trials_at_the_same_time_on_disjoint_gpus():
    one_after_other = [_trial(0, _m(1, [(NODE_A, ["0"])], [0.0, 5.0])), _trial(1, _m(1, [(NODE_A, ["1"])], [5.5, 9.0]))]
    assert overlapping_pairs(one_after_other) == []
    same_gpu = [_trial(0, _m(1, [(NODE_A, ["0"])], [0.0, 5.0])), _trial(1, _m(1, [(NODE_A, ["0"])], [1.0, 9.0]))]
    assert overlapping_pairs(same_gpu) == [(0, 1, 4.0)]
    assert shared_gpus(same_gpu, 0, 1) == {(NODE_A, "0")}
