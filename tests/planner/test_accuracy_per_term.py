"""planner.accuracy.pace_phases: per-term errors are read on the rank that sets the step's pace."""

from __future__ import annotations

from planner.accuracy import compare, pace_phases
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model

# EP4 under a random router (shape of the 4 x H200 table of 2026-11-26 10:21): rank 1 holds the hot expert;
# ranks 0, 2 and 3 wait for it inside their all-to-all
BY_RANK = [{"experts": 0.088, "ep_alltoall": 0.111}, {"experts": 0.177, "ep_alltoall": 0.011},
           {"experts": 0.099, "ep_alltoall": 0.101}, {"experts": 0.095, "ep_alltoall": 0.103}]


def test_the_busiest_expert_rank_is_read_not_rank_0():
    row = {"phases": BY_RANK[0], "phases_by_rank": BY_RANK}
    assert pace_phases(row) is BY_RANK[1]


def test_tables_without_per_rank_phases_fall_back_to_rank_0():
    assert pace_phases({"phases": BY_RANK[0]}) is BY_RANK[0]
    assert pace_phases({"phases": BY_RANK[0], "phases_by_rank": []}) is BY_RANK[0]
    dense = [{"attention": 0.03}, {"attention": 0.031}]  # no experts phase anywhere: the first rank
    assert pace_phases({"phases": dense[0], "phases_by_rank": dense}) is dense[0]


def test_compare_reads_the_ep_all_to_all_on_the_pace_setting_rank():
    """A measured EP2 row whose rank 0 waited 80 ms in its all-to-all for rank 1's experts: the per-term error
    is taken against rank 1's 2 ms, not rank 0's 80 ms."""
    model, training = get_model("mixtral-8x7b").with_layers(2), TrainingSpec(seq_length=4096, global_batch_size=8)
    config = ParallelConfig(world_size=2, ep=2)
    ranks = [{"experts": 0.100, "ep_alltoall": 0.080}, {"experts": 0.180, "ep_alltoall": 0.002}]
    row = {"layout": config.label(), "config": config.to_dict(), "ok": True, "step_time": 0.4,
           "phases": ranks[0], "phases_by_rank": ranks}
    rows, _ = compare(model, training, ClusterSpec(get_hardware("h200"), 2), [row])
    a2a = rows[0]["terms"]["ep_a2a"]
    assert a2a["measured_s"] == 0.002
    assert a2a["error"] == (a2a["predicted_s"] - 0.002) / 0.002
