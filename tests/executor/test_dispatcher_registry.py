"""The dispatcher names come from spec.dispatchers; the executor and the cost model register exactly those."""

import pytest

from costmodel.dispatch import PRICING, dispatcher_pricing
from costmodel.step_time import estimate_step_time
from executor.dispatcher import DISPATCHER_CLASSES, make_dispatcher
from executor.parallel.groups import single_process_state
from spec import ClusterSpec, InvalidConfigError, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.dispatchers import DISPATCHER_KINDS, DISPATCHERS


def test_both_registries_hold_exactly_the_spec_names():
    assert DISPATCHERS == tuple(k.name for k in DISPATCHER_KINDS)
    assert tuple(DISPATCHER_CLASSES) == DISPATCHERS
    assert tuple(PRICING) == DISPATCHERS
    assert all(cls.name == name for name, cls in DISPATCHER_CLASSES.items())
    assert all(p.name == name for name, p in PRICING.items())


def test_every_spec_name_builds_and_prices():
    state = single_process_state()
    for name in DISPATCHERS:
        assert make_dispatcher(name, state, 4, 2).name == name
        assert dispatcher_pricing(name).name == name


def test_an_unknown_dispatcher_is_an_error_everywhere():
    with pytest.raises(InvalidConfigError, match="bogus"):
        make_dispatcher("bogus", single_process_state(), 4, 2)
    with pytest.raises(InvalidConfigError, match="bogus"):
        dispatcher_pricing("bogus")
    with pytest.raises(InvalidConfigError, match="moe_token_dispatcher_type"):
        ParallelConfig(world_size=8, ep=8, moe_token_dispatcher_type="bogus")
    # a layout that slipped past ParallelConfig's check is not priced as all-to-all
    config = ParallelConfig(world_size=8, ep=8)
    object.__setattr__(config, "moe_token_dispatcher_type", "bogus")
    model, cluster = get_model("mixtral-8x7b"), ClusterSpec(get_hardware("h100-sxm"), 8)
    with pytest.raises(InvalidConfigError, match="bogus"):
        estimate_step_time(model, TrainingSpec(seq_length=4096, global_batch_size=8), cluster, config)
