"""The term table: every term list of the time model, the estimate and the calibration derives from it."""

import pytest

from costmodel import terms
from costmodel.calibrate.component_factors import FACTOR_TERMS
from costmodel.estimate import BOTTLENECK_TERMS
from costmodel.step_time import TERMS, estimate_step_time, layer_times
from planner.calibration import GROUPS, TERM_GROUPS, group_seconds
from spec import ClusterSpec, InvalidConfigError, ParallelConfig, TrainingSpec, get_hardware, get_model


def _breakdown():
    model, cluster = get_model("mixtral-8x7b"), ClusterSpec(get_hardware("h100-sxm"), 16)
    config = ParallelConfig(world_size=16, tp=2, pp=2, ep=4, etp=2)
    return model, cluster, config, estimate_step_time(model, TrainingSpec(seq_length=4096, global_batch_size=64),
                                                      cluster, config)


def test_every_term_list_is_the_table_s():
    _, _, _, b = _breakdown()
    assert tuple(name for name, _ in b.terms) == TERMS == tuple(t.name for t in terms.TERM_TABLE)
    assert tuple(name for name, _ in b.hidden) == terms.HIDDEN_TERMS
    assert {t for group in TERM_GROUPS.values() for t in group} == set(TERMS)
    assert GROUPS == tuple(TERM_GROUPS) == ("compute", "memory_bound", "comm", "all_to_all")
    assert {t for names in BOTTLENECK_TERMS.values() for t in names} == set(TERMS)
    assert set(FACTOR_TERMS) <= set(TERMS)
    assert all(t.scope in terms.SCOPES for t in terms.TERM_TABLE)


def test_layer_parts_use_the_layer_slots():
    model, cluster, config, _ = _breakdown()
    parts = layer_times(model, TrainingSpec(seq_length=4096, global_batch_size=64), cluster, config)
    for part in parts.values():
        assert tuple(name for name, _ in part.fwd) == terms.LAYER_TERMS


def test_unknown_term_is_an_error_not_compute():
    with pytest.raises(InvalidConfigError, match="unknown time term 'not_a_term'"):
        group_seconds([("gemm", 1.0), ("not_a_term", 1.0)])
    with pytest.raises(InvalidConfigError, match="not_a_term"):
        terms.term_index("not_a_term")
    # host_overhead is an explicit compute term now, as it was counted before
    assert group_seconds([("host_overhead", 2.0)])["compute"] == 2.0


def test_every_term_names_the_constants_its_interval_comes_from():
    """The table's constants column is what costmodel.uncertainty resolves into a provenance: every row names
    one it has a rule for, the hidden terms among them."""
    from costmodel import uncertainty

    kinds = {t.constants for t in terms.TERM_TABLE}
    assert all(t.constants for t in terms.TERM_TABLE)
    assert kinds <= set(uncertainty._COMPUTE) | set(uncertainty._COLLECTIVE_KINDS)
    assert set(uncertainty.OVERLAP_EXPOSED) == set(terms.HIDDEN_TERMS)
    assert {t.name for t in terms.TERM_TABLE if t.constants == "derived"} == {"recompute", "pp_bubble"}
