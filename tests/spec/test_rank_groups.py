"""Rank groups against Megatron-LM's documented tp-cp-ep-dp-pp layout."""

import pytest

from spec import FoldedGroups, ParallelConfig
from spec.errors import InvalidConfigError
from spec.rank_groups import GROUP_KINDS, GridSizes, group_span


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


LAYOUTS = [dict(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1), dict(world_size=32, tp=2, cp=2, pp=2, ep=8, etp=2),
           dict(world_size=64, tp=4, pp=2, ep=8, etp=2), dict(world_size=48, tp=2, cp=3, pp=2, ep=4),
           dict(world_size=8), dict(world_size=24, tp=1, cp=1, pp=3, ep=2, etp=1)]


def test_the_closed_form_is_the_enumerated_first_group():
    for kw in LAYOUTS:
        g = FoldedGroups(ParallelConfig(**kw))
        for name in GROUP_KINDS:
            if name == "mp" and g.config.tp > 1 and g.config.pp > 1:
                with pytest.raises(InvalidConfigError, match="not evenly spaced"):
                    g.stride(name)
                continue
            first, stride = g.groups(name)[0], g.stride(name)
            assert first == [k * stride.stride for k in range(stride.size)], (kw, name)
            for gpn in (1, 2, 4, 8):
                assert stride.nodes(gpn) == group_span(g.config, name, gpn), (kw, name, gpn)


def test_strides_of_the_layer_groups_need_no_dp_or_pp():
    sizes = GridSizes(tp=4, cp=2, etp=2, ep=8)
    assert [(s.stride, s.size) for s in map(sizes.group, ("tp", "cp", "etp", "ep", "tp_ep"))] == \
        [(1, 4), (4, 2), (1, 2), (2, 8), (1, 16)]
    with pytest.raises(InvalidConfigError, match="unknown group"):
        sizes.group("xp")
