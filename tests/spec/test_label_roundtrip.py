"""Every form of a layout (spec.layout_codec) reads back to the same layout, as properties over sampled layouts.

Two samplers: the planner's own space (DeepSeek-V3 on 256 H100s with offload options: every layout, micro-batch
size, dispatcher option, optimizer and recompute choice the enumerator builds, through its unchecked fast path)
and arbitrary layouts over every field the label spells (placement options, partial full recompute, any
offload fraction), built by the checked constructor. Hypothesis shrinks a failure to the smallest layout.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.enumerate import ConfigMaker, SearchSpace, divisors, enumerate_layouts, recompute_count
from spec.cp_comm_types import CP_COMM_TYPES
from spec.dispatchers import DISPATCHERS, EXECUTOR_DISPATCHERS
from spec.errors import InvalidConfigError
from spec.inputs import build_specs
from spec.layout_codec import (ACTIVATION_OFFLOAD_MODULES, RECOMPUTE_MODULES, Labelled, current_optuna_params,
                               optuna_key)
from spec.parallel_config import ParallelConfig
from spec.training_spec import PRECISIONS

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORLD = 256


@lru_cache(maxsize=1)
def _planner_space():
    model, training, cluster = build_specs("deepseek-v3", WORLD, gpu="h100-sxm", seq_length=4096,
                                           global_batch_size=1024)
    # offloads that leave the attention half to CUDA graphs, which the planner then tries too (any_configs covers the
    # other offload modules)
    space = SearchSpace(optimizer_offload=(0.5, 1.0), activation_offload=(("moe",), ("mlp", "moe")))
    return enumerate_layouts(model, training, cluster, space)


@st.composite
def planned_configs(draw) -> ParallelConfig:
    """One config of the enumeration, as ``Enumeration.configs`` builds it (``ParallelConfig.trusted``)."""
    enum = _planner_space()
    option = draw(st.sampled_from(enum.offload))
    distopts, chain = enum.knobs_for(option)
    # an index, not st.sampled_from(enum.layouts): that strategy, built afresh per draw, hashes all ~25,000
    # layouts each time (its label), which was most of the properties' time; it draws and shrinks the same
    lay = enum.layouts[draw(st.integers(0, len(enum.layouts) - 1))]
    dispatcher = draw(st.sampled_from(lay.dispatchers))
    granularity, modules = chain[draw(st.integers(0, recompute_count(chain, dispatcher) - 1))]
    return ConfigMaker(WORLD, enum.pipeline, option).make(lay, draw(st.sampled_from(lay.micro_batch_sizes)),
                                                          dispatcher, draw(st.sampled_from(distopts)),
                                                          granularity, modules)


@st.composite
def any_configs(draw) -> ParallelConfig:
    """A layout over every field the label spells; the fields it leaves out take what they follow (sequence
    parallelism follows tp, parameter-gather overlap the distributed optimizer)."""
    world = draw(st.sampled_from((1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 96, 256, 1024)))
    tp = draw(st.sampled_from(divisors(world)))
    cp = draw(st.sampled_from(divisors(world // tp)))
    pp = draw(st.sampled_from(divisors(world // (tp * cp))))
    ep = draw(st.sampled_from(divisors(world // pp)))
    etp = draw(st.sampled_from(divisors(world // (pp * ep))))
    vpp = draw(st.integers(1, 6))
    granularity = draw(st.sampled_from(("none", "selective", "full")))
    modules = tuple(draw(st.lists(st.sampled_from(RECOMPUTE_MODULES), min_size=1, unique=True))) \
        if granularity == "selective" else ()
    layers = draw(st.integers(0, 12)) if granularity == "full" else 0
    distopt = draw(st.booleans())
    fraction = draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))) if distopt else 0.0
    offloaded = () if granularity == "full" else tuple(
        m for m in draw(st.lists(st.sampled_from(ACTIVATION_OFFLOAD_MODULES), unique=True))
        if m not in modules and not (m == "core_attn" and "mla_up_proj" in modules))
    placement = draw(st.sampled_from(("default", "layout", "first_last", "accounting")))
    fields = {"cp_comm_type": draw(st.sampled_from(CP_COMM_TYPES))}
    if fields["cp_comm_type"] == "a2a+p2p":  # (a2a size, p2p size) splitting cp
        a2a = draw(st.sampled_from(divisors(cp)))
        fields["hierarchical_context_parallel_sizes"] = (a2a, cp // a2a)
    if placement == "layout":  # one decoder layer per chunk, the embedding first and the loss last
        fields["pipeline_layout"] = "E" + "|".join(["t"] * (pp * vpp)) + "L"
    elif placement == "first_last":
        fields["decoder_first_pipeline_num_layers"] = draw(st.one_of(st.none(), st.integers(0, 8)))
        fields["decoder_last_pipeline_num_layers"] = draw(st.one_of(st.none(), st.integers(0, 8)))
    elif placement == "accounting":
        fields["account_for_embedding_in_pipeline_split"] = draw(st.booleans())
        fields["account_for_loss_in_pipeline_split"] = draw(st.booleans())
    try:
        return ParallelConfig(world_size=world, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                              micro_batch_size=draw(st.integers(1, 16)), recompute_granularity=granularity,
                              recompute_modules=modules, recompute_num_layers=layers,
                              moe_token_dispatcher_type=draw(st.sampled_from(DISPATCHERS)),
                              use_distributed_optimizer=distopt, overlap_param_gather=distopt,
                              overlap_moe_expert_parallel_comm=draw(st.booleans()),
                              moe_shared_expert_overlap=draw(st.booleans()),
                              cuda_graphs=draw(st.booleans()),
                              optimizer_cpu_offload_fraction=fraction, activation_offload_modules=offloaded,
                              **fields)
    except InvalidConfigError:  # the few combinations the constructor refuses
        assume(False)


def _every_form_reads_back(config: ParallelConfig, precision: str) -> None:
    label = config.label()
    assert ParallelConfig.parse(label) == config, label
    assert ParallelConfig.parse(label, world_size=config.world_size) == config, label
    assert ParallelConfig.parse(label.replace(" ", ", ")) == config, label  # commas separate tokens too
    trial = Labelled(config, precision)
    assert ParallelConfig.parse_labelled(trial.label()) == trial, trial.label()
    assert ParallelConfig.parse_labelled(label) == Labelled(config, None)
    params = trial.optuna_params()
    assert ParallelConfig.from_optuna_params(params, config.world_size, **{
        name: getattr(config, name) for name in ("pipeline_layout", "decoder_first_pipeline_num_layers",
                                                 "decoder_last_pipeline_num_layers",
                                                 "account_for_embedding_in_pipeline_split",
                                                 "account_for_loss_in_pipeline_split")}) == config
    assert current_optuna_params(params) == params  # the current version is its own
    assert ParallelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@PROPERTY
@given(planned_configs(), st.sampled_from(PRECISIONS))
def test_every_form_of_a_planned_layout_reads_back(config, precision):
    _every_form_reads_back(config, precision)


@PROPERTY
@given(any_configs(), st.sampled_from(PRECISIONS))
def test_every_form_of_any_layout_reads_back(config, precision):
    _every_form_reads_back(config, precision)


@PROPERTY
@given(planned_configs(), planned_configs())
def test_two_planned_layouts_share_no_label_and_no_optuna_key(a, b):
    assume(a != b)
    assert a.label() != b.label()
    assert optuna_key(a.to_optuna_params()) != optuna_key(b.to_optuna_params())


def test_the_planner_space_holds_every_knob_the_label_spells():
    """The sampler draws from a space that has each knob on and off (else the property would not test it)."""
    enum = _planner_space()
    assert enum.valid > 1_000_000
    options = {d for lay in enum.layouts for d in lay.dispatchers}
    assert {d.dispatcher for d in options} == set(EXECUTOR_DISPATCHERS) and any(d.ep_overlap for d in options)
    assert any(d.shared_overlap for d in options)  # DeepSeek-V3 has a shared expert
    assert any(d.cuda_graphs for d in options)  # H100s: CUDA graphs are tried
    assert {o[0] for o in enum.offload} == {0.0, 0.5, 1.0} and any(o[1] for o in enum.offload)
    assert {lay.cp_comm.cp_comm_type for lay in enum.layouts} == set(CP_COMM_TYPES)
    assert {g for g, _ in enum.recompute} == {"none", "selective", "full"}
    assert enum.distributed_optimizer == (True, False)


def test_distopt_off_label_is_a_valid_layout():
    config = ParallelConfig.parse("tp1 cp1 pp1 vpp1 ep2 etp1 dp4 edp2 mbs1 distopt=off")
    assert not config.use_distributed_optimizer and not config.overlap_param_gather
    assert config.label().endswith("distopt=off")


def test_an_offload_fraction_keeps_every_digit_it_needs():
    assert ParallelConfig(world_size=8, optimizer_cpu_offload_fraction=0.5).label().endswith("opt_offload=0.5")
    assert ParallelConfig(world_size=8, optimizer_cpu_offload_fraction=1.0).label().endswith("opt_offload=1")
    odd = ParallelConfig(world_size=8, optimizer_cpu_offload_fraction=0.123456789)
    assert ParallelConfig.parse(odd.label()) == odd


@pytest.mark.parametrize("text, shown", [("tp2 banana", "'banana'"), ("tp2 distopt=maybe", "'distopt=maybe'"),
                                         ("recompute=full:x", "'recompute=full:x'"),
                                         ("tp2 precision=fp7", "'precision=fp7'")])
def test_a_bad_layout_token_lists_the_valid_keys(text, shown):
    with pytest.raises(InvalidConfigError) as info:
        ParallelConfig.read_label(text)
    message = str(info.value)
    assert f"cannot parse layout token {shown}" in message
    for key in ("tpN", "cpN", "ppN", "vppN", "epN", "etpN", "dpN", "edpN", "mbsN", "recompute=", "dispatcher=",
                "distopt={on|off}", "precision="):
        assert key in message


def test_a_layout_alone_refuses_a_trial_knob_rather_than_drop_it():
    with pytest.raises(InvalidConfigError, match="parse_labelled"):
        ParallelConfig.parse("tp2 dp4 precision=fp8")
    assert ParallelConfig.parse_labelled("tp2 dp4 precision=fp8") == Labelled(ParallelConfig(8, tp=2), "fp8")
