"""bench/costmodel_accuracy.pace_phases: per-term errors are read on the rank that sets the step's pace."""

from __future__ import annotations

from bench.costmodel_accuracy import pace_phases

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
