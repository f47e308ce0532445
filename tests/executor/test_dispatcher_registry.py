"""The dispatcher names come from spec.dispatchers; the executor and the cost model register exactly those; every
executor dispatcher implements the whole TokenDispatcher contract, and the EP-overlap schedule uses nothing else."""

import ast
import inspect

import pytest

from executor import ep_overlap

from costmodel.dispatch import PRICING, dispatcher_pricing
from costmodel.step_time import estimate_step_time
from executor.dispatcher import DISPATCHER_CLASSES, TokenDispatcher, make_dispatcher
from executor.parallel.groups import single_process_state
from spec import ClusterSpec, InvalidConfigError, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.dispatchers import DISPATCHER_KINDS, DISPATCHERS, EXECUTOR_DISPATCHERS, MEGATRON_ONLY_DISPATCHERS


def test_both_registries_hold_exactly_the_spec_names():
    assert DISPATCHERS == tuple(k.name for k in DISPATCHER_KINDS)
    assert tuple(DISPATCHER_CLASSES) == EXECUTOR_DISPATCHERS  # the Megatron-only ones are priced, not built
    assert set(EXECUTOR_DISPATCHERS) | set(MEGATRON_ONLY_DISPATCHERS) == set(DISPATCHERS)
    assert tuple(PRICING) == DISPATCHERS
    assert all(cls.name == name for name, cls in DISPATCHER_CLASSES.items())
    assert all(p.name == name for name, p in PRICING.items())


def test_every_spec_name_builds_and_prices():
    state = single_process_state()
    for name in EXECUTOR_DISPATCHERS:
        assert make_dispatcher(name, state, 4, 2).name == name
    for name in DISPATCHERS:
        assert dispatcher_pricing(name).name == name
    for name in MEGATRON_ONLY_DISPATCHERS:  # refused by name, never built as another dispatcher
        with pytest.raises(InvalidConfigError, match=name):
            make_dispatcher(name, state, 4, 2)


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


def test_every_dispatcher_implements_every_stage_of_the_contract():
    for cls in DISPATCHER_CLASSES.values():
        assert issubclass(cls, TokenDispatcher) and not inspect.isabstract(cls), cls.name
    stages = {"dispatch_preprocess", "dispatch_postprocess", "combine_preprocess", "combine_postprocess"}
    assert stages <= TokenDispatcher.__abstractmethods__


def test_the_overlap_schedule_calls_only_contract_methods():
    """What staged_moe_layer reads off its dispatcher: every name is declared by TokenDispatcher itself."""
    tree = ast.parse(inspect.getsource(ep_overlap.staged_moe_layer))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dispatcher"}
    contract = {name for name in vars(TokenDispatcher) if not name.startswith("_")}
    assert used and used <= contract, used - contract
