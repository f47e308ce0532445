"""The rule book against the executor: every layout ``spec.validity.check`` accepts (executor rules included) the
executor builds, rank by rank, and a layout it rejects is refused naming the rule, by the one check before the
ranks start and by the guards deeper in the executor that re-check a rule.

Layouts are drawn at random (fixed seed) from sizes that mostly divide the world (1, 2, 4 and 8 GPUs) and from
every knob (recompute, dispatcher, EP overlap, activation offload, sequence parallelism, the distributed
optimizer), for tiny-moe and the tiny proxy of DeepSeek-V3 (MLA, MTP, shared experts), dropless and with
capacity routing. Building a rank's slice needs only its groups' ranks (no communicator); on one GPU a few
layouts also train a step (marked slow).
"""

from __future__ import annotations

import random

import pytest

from spec.catalog import get_model
from spec.dispatchers import DISPATCHERS
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig
from spec.proxy import tiny_proxy
from spec.training_spec import TrainingSpec
from spec.validity import check, is_executor_rule
from executor.buildable import check_buildable
from executor.ep_overlap import check_overlappable
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.pipeline import rank_order
from executor.train_step import Trainer
from executor.verify import Scenario, run_scenario

MODELS = {"tiny-moe": get_model("tiny-moe"), "mla-mtp": tiny_proxy(get_model("deepseek-v3"))}
TRAININGS = {"dropless": TrainingSpec(seq_length=32, global_batch_size=8),
             "capacity": TrainingSpec(seq_length=32, global_batch_size=8, routing_mode="capacity",
                                      moe_expert_capacity_factor=1.5)}
RECOMPUTE = [("none", ()), ("selective", ("core_attn",)), ("selective", ("moe",)), ("selective", ("mla_up_proj",)),
             ("selective", ("core_attn", "mla_up_proj")), ("selective", ("moe_act", "layernorm")), ("full", ())]
WORLDS = (1, 2, 4, 8)
ACCEPTED_PER_CASE = 6  # layouts built per (model, training, world); each builds all its ranks
REJECTED_PER_CASE = 10
TRAINED_PER_CASE = 2  # of the accepted layouts on one GPU


def _size(rng: random.Random, world: int) -> int:
    """A parallel size: a divisor of the world mostly, now and then one that does not divide it."""
    return rng.choice([d for d in (1, 2, 4, 8) if world % d == 0]) if rng.random() < 0.9 else 3


def _draw(rng: random.Random, world: int) -> ParallelConfig:
    granularity, modules = rng.choice(RECOMPUTE)
    distopt = rng.random() < 0.8
    tp = _size(rng, world)
    return ParallelConfig(
        world_size=world, tp=tp, cp=_size(rng, world), pp=_size(rng, world), vpp=rng.choice((1, 1, 2)),
        ep=_size(rng, world), etp=_size(rng, world), micro_batch_size=rng.choice((1, 2)),
        sequence_parallel=tp > 1 if rng.random() < 0.9 else rng.random() < 0.5,
        recompute_granularity=granularity, recompute_modules=modules,
        moe_token_dispatcher_type=rng.choice(DISPATCHERS), use_distributed_optimizer=distopt,
        overlap_param_gather=distopt if rng.random() < 0.9 else not distopt,
        overlap_moe_expert_parallel_comm=rng.random() < 0.3,
        activation_offload_modules=("moe",) if rng.random() < 0.15 else ())


def _sample(model_name: str, training_name: str, world: int):
    """(accepted layouts, [(rejected layout, its rejections)]) drawn for one case."""
    rng = random.Random(f"{model_name}/{training_name}/{world}")
    model, training = MODELS[model_name], TRAININGS[training_name]
    accepted, rejected = [], []
    for _ in range(20000):
        if len(accepted) >= ACCEPTED_PER_CASE and len(rejected) >= REJECTED_PER_CASE:
            break
        config = _draw(rng, world)
        rejections = check(model, training, config)
        if not rejections and len(accepted) < ACCEPTED_PER_CASE and config not in accepted:
            accepted.append(config)
        elif rejections and len(rejected) < REJECTED_PER_CASE:
            rejected.append((config, rejections))
    return accepted, rejected


CASES = [(m, t, w) for m in MODELS for t in TRAININGS for w in WORLDS]


def _build_every_rank(model, training: TrainingSpec, config: ParallelConfig) -> None:
    """What the executor does with a layout before its first step, on every rank: the model slice (router,
    attention, experts, MTP sharded by group rank), the pipeline schedule and the overlapped schedule's check."""
    options = ExecutorOptions.for_training(training, model=model)
    for rank in range(config.world_size):
        state = build_parallel_state(config, rank, communicators=False)
        net = MoEGPT(model, state, options, training.seq_length)
        rank_order(config.pp, config.vpp, config.num_micro_batches(training.global_batch_size), state["pp"].rank)
        if config.overlap_moe_expert_parallel_comm:
            check_overlappable(net)


@pytest.mark.parametrize("model_name,training_name,world", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_what_the_rule_book_accepts_the_executor_builds(model_name, training_name, world):
    model, training = MODELS[model_name], TRAININGS[training_name]
    accepted, rejected = _sample(model_name, training_name, world)
    assert len(accepted) == ACCEPTED_PER_CASE, (len(accepted), world)
    for config in accepted:
        check_buildable(model, training, config)
        _build_every_rank(model, training, config)
    assert len(rejected) == REJECTED_PER_CASE
    for config, rejections in rejected:
        with pytest.raises(InvalidConfigError) as refused:
            check_buildable(model, training, config)
        assert all(f"[{r.rule}] {r.reason}" in str(refused.value) for r in rejections)


@pytest.mark.slow
@pytest.mark.parametrize("model_name,training_name", [("tiny-moe", "capacity"), ("mla-mtp", "dropless")])
def test_what_the_rule_book_accepts_on_one_gpu_trains_a_step(model_name, training_name):
    """One process needs no process group: the first layouts accepted on one GPU also train a step
    (recompute, offload and the schedules at run time, not only at build time)."""
    model, training = MODELS[model_name], TRAININGS[training_name]
    options = ExecutorOptions.for_training(training, model=model)
    for config in _sample(model_name, training_name, 1)[0][:TRAINED_PER_CASE]:
        scenario = Scenario("rule-book", model, options, training.seq_length, training.global_batch_size,
                            config.micro_batch_size, steps=1)
        assert run_scenario(config, scenario)["loss"][0] > 0, config.label()


def test_each_sample_mixes_megatron_and_executor_rejections():
    """The samples exercise both kinds of rule (a check that the draw is not degenerate)."""
    kinds = set()
    for case in CASES:
        for _, rejections in _sample(*case)[1]:
            kinds |= {is_executor_rule(r.rule) for r in rejections}
    assert kinds == {True, False}


def test_the_executors_deeper_guards_name_the_rule_they_recheck():
    """Without the one check before the ranks start, building or scheduling such a layout still refuses,
    naming the rule of the rule book."""
    model, cp2 = MODELS["tiny-moe"], ParallelConfig(world_size=2, cp=2)
    padded = TrainingSpec(seq_length=32, global_batch_size=8, moe_pad_expert_input_to_capacity=True)  # dropless
    assert [r.rule for r in check(model, padded, cp2)] == ["pad_to_capacity"]
    with pytest.raises(InvalidConfigError, match=r"\[pad_to_capacity\]"):
        _build_every_rank(model, padded, cp2)
    _build_every_rank(model, TRAININGS["capacity"], cp2)  # token dropping under CP is built

    fp8_moments = ParallelConfig(world_size=1, exp_avg_dtype="fp8")
    assert [r.rule for r in check(model, TRAININGS["dropless"], fp8_moments)] == ["executor_optimizer_dtypes"]
    with pytest.raises(InvalidConfigError, match=r"\[executor_optimizer_dtypes\]"):
        Trainer(MoEGPT(model, build_parallel_state(fp8_moments, 0), ExecutorOptions(), 32))

    dropless = TRAININGS["dropless"]
    overlap_full = ParallelConfig(world_size=2, ep=2, recompute_granularity="full",
                                  overlap_moe_expert_parallel_comm=True)
    assert {r.rule for r in check(model, dropless, overlap_full)} == {"ep_overlap", "executor_ep_overlap"}
    with pytest.raises(InvalidConfigError, match=r"\[executor_ep_overlap\]"):
        _build_every_rank(model, dropless, overlap_full)

    interleaved = ParallelConfig(world_size=2, pp=2, vpp=2, micro_batch_size=8)  # one micro-batch per step
    deep = MODELS["mla-mtp"]
    assert [r.rule for r in check(deep, TrainingSpec(seq_length=32, global_batch_size=8), interleaved)] == [
        "vpp_microbatches"]
    with pytest.raises(InvalidConfigError, match=r"\[vpp_microbatches\]"):
        _build_every_rank(deep, TrainingSpec(seq_length=32, global_batch_size=8), interleaved)
