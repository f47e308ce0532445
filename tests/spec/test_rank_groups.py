"""Rank groups against Megatron-LM's documented tp-cp-ep-dp-pp layout."""

from spec import FoldedGroups, ParallelConfig
from spec.rank_groups import group_span


def test_world16_tp2_cp2_dp2_pp2_with_etp1_ep4_edp2():
    g = FoldedGroups(ParallelConfig(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1))
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.groups("etp") == [[r] for r in range(16)]
    # Folding: the expert layout's pipeline groups are exactly the dense ones.
    assert g.groups("expert_pp") == g.groups("pp")


def test_every_rank_in_exactly_one_group_of_each_kind():
    g = FoldedGroups(ParallelConfig(world_size=32, tp=2, cp=2, pp=2, ep=8, etp=2))
    for name in ("tp", "cp", "dp", "dp_cp", "pp", "mp", "etp", "ep", "edp", "tp_ep"):
        flat = sorted(r for group in g.groups(name) for r in group)
        assert flat == list(range(32)), name


def test_etp2_ep2_edp_groups():
    # world 8, ETP2·EP2·EDP2: etp fastest, then ep, then edp.
    g = FoldedGroups(ParallelConfig(world_size=8, tp=2, ep=2, etp=2))
    assert g.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_group_span_knows_which_groups_cross_nodes():
    c = ParallelConfig(world_size=32, tp=8, ep=16, pp=1)
    assert group_span(c, "tp", gpus_per_node=8) == 1
    assert group_span(c, "ep", gpus_per_node=8) == 2
    assert group_span(c, "dp", gpus_per_node=8) == 4
