"""The guided search against a synthetic 'machine' whose truth differs from the model per term group.

The machine here is a known function (so the test knows the optimum and the right calibration); the
search itself, its Optuna storage, pruning, failure handling and resume are the real code paths.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass

import optuna
import pytest

from spec.parallel_config import ParallelConfig
from planner.calibration import Observation, fit_calibration, group_seconds
from planner.search import Candidate, SearchBudget, SlowTrialPruner, run_search

optuna.logging.set_verbosity(optuna.logging.WARNING)
GIB = 2**30
TRUTH = {"compute": 1.3, "memory_bound": 1.0, "comm": 0.8, "all_to_all": 2.5}


@dataclass
class FakeMeasurement:
    ok: bool
    step_time: float | None = None
    peak_allocated_bytes: float | None = None
    failure_reason: str | None = None
    failure_kind: str | None = None
    pruned: bool = False
    tokens_per_expert: list[int] | None = None


def make_candidates() -> list[Candidate]:
    """32 layouts of 16 GPUs whose predicted terms trade compute against all-to-all and comm."""
    out = []
    for tp, ep, mbs, rec in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), ("none", "full")):
        cfg = ParallelConfig(world_size=16, tp=tp, ep=ep, micro_batch_size=mbs, recompute_granularity=rec)
        compute = 1.0 / (1 + 0.1 * mbs) + (0.3 if rec == "full" else 0.0) + 0.05 * tp
        a2a = 0.08 * math.log2(ep) + (0.02 if ep > 1 else 0.0)
        comm = 0.04 * math.log2(tp) + 0.3 / ep
        terms = (("gemm", compute), ("ep_a2a", a2a), ("tp_comm", comm), ("memory_bound", 0.05))
        memory = (70 * GIB / tp / ep) * (0.5 if rec == "full" else 1.0) * (1 + 0.3 * (mbs - 1)) + 8 * GIB
        out.append(Candidate(cfg, sum(v for _, v in terms), terms, memory))
    return out


def true_time(c: Candidate) -> float:
    return sum(TRUTH[g] * s for g, s in group_seconds(c.predicted_terms).items())


def machine(candidates, capacity, calls, oom_margin=1.0, crash_layouts=()):
    by_label = {c.config.label(): c for c in candidates}

    def run_trial(config, report):
        c = by_label[config.label()]
        calls.append(config.label())
        true_mem = c.predicted_memory_bytes * 1.15  # the model under-predicts memory by 15 %
        if config.label() in crash_layouts:
            return FakeMeasurement(ok=False, failure_reason="rank 1 exited with code -9", failure_kind="crash")
        if true_mem > capacity * oom_margin:
            return FakeMeasurement(ok=False, failure_reason="CUDA out of memory on rank 0", failure_kind="oom")
        t = true_time(c)
        for step in range(4):
            if report(step, t):
                return FakeMeasurement(ok=True, step_time=t, peak_allocated_bytes=true_mem, pruned=True)
        return FakeMeasurement(ok=True, step_time=t, peak_allocated_bytes=true_mem)

    return run_trial


def test_calibration_recovers_term_multipliers():
    cands = make_candidates()
    obs = [Observation(c.predicted_terms, c.predicted_memory_bytes, true_time(c), c.predicted_memory_bytes * 1.1)
           for c in cands[::2]]
    cal = fit_calibration(obs, prior_strength=1e-6)
    mult = dict(cal.time_multipliers)
    for group in ("compute", "comm", "all_to_all"):
        assert mult[group] == pytest.approx(TRUTH[group], rel=0.02), group
    assert cal.memory_multiplier == pytest.approx(1.1)
    assert cal.relative_rmse < 1e-3


def test_guided_search_finds_true_best_within_a_fifth_of_the_space():
    cands = make_candidates()
    capacity = 80 * GIB
    fits_truly = [c for c in cands if c.predicted_memory_bytes * 1.15 <= capacity]
    true_best = min(fits_truly, key=true_time)
    calls: list[str] = []
    result = run_search(cands, machine(cands, capacity, calls), capacity_bytes=capacity,
                        budget=SearchBudget(max_trials=7))
    assert result.best_config == true_best.config
    assert len(calls) == 7 and len(set(calls)) == 7  # nothing measured twice
    # The uncalibrated model's own favourite is not the true best: the calibration had to find it.
    assert min(cands, key=lambda c: c.predicted_step_time).config != true_best.config
    assert dict(result.calibration.time_multipliers)["all_to_all"] > 1.5


def test_oom_and_crash_are_recorded_and_the_search_goes_on():
    cands = make_candidates()
    # 20 GiB: several layouts the model predicts to fit (up to 20 GiB) truly need 15 % more, so some run OOM
    capacity = 20 * GIB
    assert any(capacity / 1.15 < c.predicted_memory_bytes <= capacity for c in cands)
    calls: list[str] = []
    best_pred = min(cands, key=lambda c: c.predicted_step_time)
    events: list[dict] = []
    result = run_search(cands, machine(cands, capacity, calls, crash_layouts={best_pred.config.label()}),
                        capacity_bytes=capacity, budget=SearchBudget(max_trials=10),
                        on_event=lambda kind, data: events.append(data) if kind == "trial_finished" else None)
    states = {r.layout: r for r in result.rows}
    crashed = states[best_pred.config.label()]
    assert crashed.state == "fail" and "exited with code -9" in crashed.failure_reason
    ooms = [r for r in result.rows if r.failure_reason and "out of memory" in r.failure_reason]
    assert ooms  # the OOM path ran (the checks on it below are not vacuous)
    # The kind travels typed beside the reason: the search never reads the reason text.
    kinds = {e["layout"]: e["failure_kind"] for e in events}
    assert kinds[best_pred.config.label()] == "crash"
    assert all(kinds[r.layout] == "oom" for r in ooms)
    assert all(kinds[r.layout] is None for r in result.rows if r.state != "fail")
    assert result.best_config is not None
    # An OOM teaches the memory model: afterwards it predicts at least the true 1.15x.
    assert result.calibration.memory_multiplier >= 1.15 * 0.99
    assert len(result.rows) == 10


def test_the_study_carries_the_attributes_it_is_given(tmp_path):
    cands = make_candidates()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    attrs = {"foldtune_job_id": 7, "model": "mixtral-8x7b", "gpu": "h100-sxm", "num_gpus": 64}
    run_search(cands, machine(cands, 80 * GIB, []), capacity_bytes=80 * GIB, budget=SearchBudget(max_trials=1),
               storage=storage, study_name="job-7", study_attrs=attrs)
    study = optuna.load_study(study_name="job-7", storage=storage)
    assert study.user_attrs == attrs
    # the objective has a name and unit (optuna-dashboard shows it instead of "Objective 0")
    assert study.metric_names == ["step_time_s"]
    assert study.best_value == study.best_trial.values[0] > 0


def test_an_in_memory_study_names_its_objective_too():
    cands = make_candidates()
    storage = optuna.storages.InMemoryStorage()
    with warnings.catch_warnings():
        warnings.simplefilter("error", optuna.exceptions.ExperimentalWarning)  # and does not warn about it
        run_search(cands, machine(cands, 80 * GIB, []), capacity_bytes=80 * GIB, budget=SearchBudget(max_trials=1),
                   storage=storage, study_name="s")
    assert optuna.load_study(study_name="s", storage=storage).metric_names == ["step_time_s"]


def test_slow_trials_are_pruned():
    cands = make_candidates()
    calls: list[str] = []
    result = run_search(cands, machine(cands, 80 * GIB, calls), capacity_bytes=80 * GIB,
                        budget=SearchBudget(max_trials=12), pruner=SlowTrialPruner(margin=0.05, warmup_steps=2))
    assert any(r.state == "pruned" for r in result.rows)
    best = min(r.measured_step_time for r in result.rows if r.state == "complete")
    assert all(r.measured_step_time > best * 1.05 for r in result.rows if r.state == "pruned")


def test_resume_from_storage_continues_without_duplicates(tmp_path):
    cands = make_candidates()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    calls: list[str] = []
    run_search(cands, machine(cands, 80 * GIB, calls), capacity_bytes=80 * GIB,
               budget=SearchBudget(max_trials=3), storage=storage, study_name="job-1")
    # A runner died mid-trial: leave one RUNNING trial behind.
    study = optuna.load_study(study_name="job-1", storage=storage)
    orphan = study.ask()
    del orphan
    result = run_search(cands, machine(cands, 80 * GIB, calls), capacity_bytes=80 * GIB,
                        budget=SearchBudget(max_trials=6), storage=storage, study_name="job-1")
    measured = [r for r in result.rows if r.state in ("complete", "pruned")]
    assert len(measured) == 6
    assert len(calls) == 6 and len(set(calls)) == 6


def test_parallel_trials_never_measure_one_layout_twice():
    cands = make_candidates()
    calls: list[str] = []
    run_search(cands, machine(cands, 80 * GIB, calls), capacity_bytes=80 * GIB,
               budget=SearchBudget(max_trials=8, parallel_trials=3))
    assert len(calls) == 8 and len(set(calls)) == 8


def test_uniformly_slower_machine_is_learned_from_two_measurements():
    # A CPU that runs every term 12x slower than its profile: two observations must be enough to
    # predict every other layout, without any group multiplier hitting a clamp.
    cands = make_candidates()
    obs = [Observation(c.predicted_terms, c.predicted_memory_bytes, 12.0 * c.predicted_step_time)
           for c in cands[:2]]
    cal = fit_calibration(obs)
    for c in cands:
        assert cal.step_time(c.predicted_terms) == pytest.approx(12.0 * c.predicted_step_time, rel=0.01)


def test_memory_is_recorded_through_optuna_constraints(tmp_path):
    cands = make_candidates()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    calls: list[str] = []
    capacity = 80 * GIB
    run_search(cands, machine(cands, capacity, calls), capacity_bytes=capacity,
               budget=SearchBudget(max_trials=4), storage=storage, study_name="c")
    study = optuna.load_study(study_name="c", storage=storage)
    done = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    assert done
    for t in done:
        values = list(t.constraints.values()) if isinstance(t.constraints, dict) else list(t.constraints)
        assert values == [pytest.approx(t.user_attrs["measured_peak_bytes"] - capacity)]


def test_a_measured_routing_load_reprices_the_candidates_once():
    """The first measured tokens per expert re-price every candidate (same layouts); later trials store the
    re-priced prediction and the calibration compares measurements with it."""
    from dataclasses import replace

    from planner.search import ATTR_EXPERT_LOAD, ATTR_PRED_TIME, CostModelSampler

    cands = make_candidates()
    calls, loads = [], []
    base = machine(cands, 80 * GIB, calls)

    def run_trial(config, report):
        return replace(base(config, report), tokens_per_expert=[300, 100])

    def repredict(load, current):
        loads.append(load)  # EP layouts twice as slow once routing is known to be skewed
        return [replace(c, predicted_step_time=c.predicted_step_time * (2.0 if c.config.ep > 1 else 1.0),
                        predicted_terms=tuple((k, v * (2.0 if c.config.ep > 1 else 1.0)) for k, v in c.predicted_terms))
                for c in current]

    sampler = CostModelSampler(cands, 80 * GIB, repredict=repredict)
    storage = optuna.storages.InMemoryStorage()
    run_search(cands, run_trial, capacity_bytes=80 * GIB, budget=SearchBudget(max_trials=6), sampler=sampler,
               storage=storage, study_name="routing")
    assert loads == [(0.75, 0.25)] and sampler.expert_load == (0.75, 0.25)
    trials = sorted(optuna.load_study(study_name="routing", storage=storage).get_trials(), key=lambda t: t.number)
    assert all(t.user_attrs[ATTR_EXPERT_LOAD] == [0.75, 0.25] for t in trials if t.state.is_finished())
    original = {c.config.label(): c.predicted_step_time for c in cands}
    later = [t for t in trials[1:] if t.user_attrs.get("layout")]
    assert later and all(t.user_attrs[ATTR_PRED_TIME] == pytest.approx(
        original[t.user_attrs["layout"]] * (2.0 if ParallelConfig.from_dict(t.user_attrs["config"]).ep > 1 else 1.0))
        for t in later)


def test_a_failing_repricing_keeps_the_search_going(caplog):
    from dataclasses import replace

    from planner.search import CostModelSampler

    cands = make_candidates()
    base = machine(cands, 80 * GIB, [])

    def run_trial(config, report):
        return replace(base(config, report), tokens_per_expert=[1, 1])

    def broken(load, current):
        raise RuntimeError("estimate failed")

    sampler = CostModelSampler(cands, 80 * GIB, repredict=broken)
    result = run_search(cands, run_trial, capacity_bytes=80 * GIB, budget=SearchBudget(max_trials=4), sampler=sampler)
    assert len([r for r in result.rows if r.state == "complete"]) == 4
    assert "routing load not applied" in caplog.text
    assert all(sampler.candidate(c.params) == c for c in cands)  # the balanced prices stay
