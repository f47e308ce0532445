"""A tuning job that searches precision, below the HTTP layer: its candidates (both precisions, priced each at
its own, ranked together), the trial executor running each trial's TrainingSpec at the trial's precision, the
precision each stored trial reports, and the best layout's export at its precision."""

from __future__ import annotations

import io
import threading
from dataclasses import replace

import optuna
import pytest

import api.worker.trials as trials_mod
from api.cli._export import best_record, render
from api.cli.tune_cmd import TrialPrinter
from api.worker.candidates import CANDIDATES_PER_TRIAL, job_candidates
from api.worker.trials import TrialExecutor, TrialSettings
from costmodel.estimate import estimate as price_layout
from db.models import Trial
from planner.runnable import tuned_precisions
from planner.search import SearchBudget, run_search, startup_order
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)
TRAINING = TrainingSpec(seq_length=64, global_batch_size=8)


def h100_candidates(max_trials: int = 3):
    cluster = ClusterSpec(get_hardware("h100-sxm"), 2)
    return cluster, job_candidates(get_model("tiny-moe"), TRAINING, cluster, max_trials, search_precision=True)


def test_an_fp8_gpu_searches_both_precisions_ranked_together():
    cluster, cands = h100_candidates()
    assert cands.precisions == ("bf16", "fp8") and cands.precision_note is None
    assert cands.summary()["precisions"] == ["bf16", "fp8"]
    precisions = [c.precision for c in cands.candidates]
    assert set(precisions) == {"bf16", "fp8"}
    assert all(precisions.count(p) <= CANDIDATES_PER_TRIAL * 3 for p in ("bf16", "fp8"))  # a cap per precision
    times = [c.rank_time for c in cands.candidates]
    assert times == sorted(times)  # one ranking (the intervals' high ends), whatever the precision
    assert set(cands.estimates) == {c.labelled for c in cands.candidates}  # one estimate per (layout, precision)
    for c in cands.candidates[:4]:  # each priced at its own precision
        e = price_layout(get_model("tiny-moe"), replace(TRAINING, precision=c.precision), cluster, c.config)
        assert c.predicted_step_time == pytest.approx(e.time.step_time)


def test_a_gpu_without_fp8_keeps_the_job_precision_and_bf16_and_says_so():
    training = replace(TRAINING, precision="fp32")
    cands = job_candidates(get_model("tiny-moe"), training, ClusterSpec(get_hardware("cpu"), 2), 3,
                           search_precision=True)
    assert cands.precisions == ("fp32", "bf16")
    assert cands.candidates and {c.precision for c in cands.candidates} <= {"fp32", "bf16"}
    assert "fp8 not searched" in cands.precision_note and "cpu" in cands.precision_note
    assert cands.summary()["precision_note"] == cands.precision_note
    # the rule itself: fp8 stays where the GPU has an fp8 peak
    assert tuned_precisions(TRAINING, get_hardware("h100-sxm").gpu) == (("bf16", "fp8"), None)
    assert tuned_precisions(TRAINING, get_hardware("a100-80gb").gpu)[0] == ("bf16",)


def test_each_trial_runs_the_job_training_at_its_own_precision(monkeypatch):
    cluster, cands = h100_candidates()
    ran = []

    class Measured:
        ok, pruned, peak_allocated_bytes, tokens_per_expert = True, False, None, None

        def __init__(self, step_time):
            self.step_time = step_time

    def fake_profile(model, training, config, options, **kw):
        ran.append((config.label(), training))
        return Measured(0.1 + 0.01 * len(ran))

    monkeypatch.setattr(trials_mod, "profile_layout", fake_profile)
    executor = TrialExecutor(get_model("tiny-moe"), TRAINING, cluster, TrialSettings(reuse_ranks=False),
                             threading.Event())
    result = run_search(cands.candidates, executor, capacity_bytes=cluster.usable_hbm_bytes,
                        budget=SearchBudget(max_trials=4))
    # the sampler's uncalibrated start, of either precision: the lowest pessimistic end; then the other precision's
    # own start (precision is checked by measurement); then the layouts whose intervals overlap the first one,
    # fastest predicted first
    order = startup_order(cands.candidates)
    other = startup_order([c for c in cands.candidates if c.precision != order[0].precision])[0]
    expected = [order[0], other] + [c for c in order[1:] if c is not other][:1]
    assert [(label, t.precision) for label, t in ran[:3]] == [(c.config.label(), c.precision) for c in expected]
    assert all(replace(t, precision="bf16") == TRAINING for _, t in ran)  # only the precision changes
    rows = sorted(result.rows, key=lambda r: r.number)
    assert [r.precision for r in rows] == [t.precision for _, t in ran]
    assert result.best_precision == rows[0].precision  # the fake machine: the first trial is the fastest


def test_a_tiny_proxy_job_measures_bf16_beside_fp8_and_reports_fp8s_gain(monkeypatch):
    """Issue 38: a job searching precision measures the best bf16 candidate too, and its result and printed report
    say fp8's measured gain over bf16. The trials run through the job's executor, the GPU run faked: fp8 steps
    take 1.25x the bf16 ones (what the mbs-1 measurements on the H200 found: fp8 not faster)."""
    cluster, cands = h100_candidates()
    bf16_seconds = {}

    class Measured:
        ok, pruned, peak_allocated_bytes, tokens_per_expert = True, False, None, None

        def __init__(self, step_time):
            self.step_time = step_time

    def fake_profile(model, training, config, options, **kw):
        base = bf16_seconds.setdefault(config.label(), 0.1 + 0.01 * len(bf16_seconds))
        return Measured(base * (1.25 if training.precision == "fp8" else 1.0))

    monkeypatch.setattr(trials_mod, "profile_layout", fake_profile)
    executor = TrialExecutor(get_model("tiny-moe"), TRAINING, cluster, TrialSettings(reuse_ranks=False),
                             threading.Event())
    events = []
    result = run_search(cands.candidates, executor, capacity_bytes=cluster.usable_hbm_bytes,
                        budget=SearchBudget(max_trials=1), on_event=lambda kind, data: events.append((kind, data)))
    rows = sorted(result.rows, key=lambda r: r.number)
    assert {r.precision for r in rows} == {"bf16", "fp8"} and len(rows) == 2  # one trial budget, stretched
    bests = result.best_by_precision
    gain = bests["bf16"].step_time / bests["fp8"].step_time
    assert result.gain_over_bf16 == {"fp8": pytest.approx(gain)}
    assert dict(events)["search_finished"]["gain_over_bf16"] == result.gain_over_bf16
    # the report printed by `foldtune tune`
    out = io.StringIO()
    summary = {"time_multipliers": {}, "memory_multiplier": 1.0, "num_observations": 2, "stopped_because": "x",
               "best_by_precision": {p: {"layout": b.layout, "step_time_s": b.step_time} for p, b in bests.items()},
               "gain_over_bf16": result.gain_over_bf16}
    TrialPrinter(out)("job_finished", {"job_id": 1, "status": "succeeded", "result": summary, "rows": result.rows,
                                       "best": result.best_config, "best_precision": result.best_precision,
                                       "best_step_time": result.best_step_time})
    text = out.getvalue()
    assert f"fp8 over bf16 (best measured of each): {gain:.2f}x" in text
    assert "best at bf16: " + bests["bf16"].layout in text and "best at fp8: " + bests["fp8"].layout in text


def test_a_stored_trial_reports_its_precision():
    assert Trial(predicted={"precision": "fp8"}, measurement={"precision": "fp8"}).precision == "fp8"
    assert Trial(predicted={"step_time_s": 1.0}, measurement={"precision": "bf16"}).precision == "bf16"
    assert Trial(predicted=None, measurement=None).precision is None


def _job(trial_precision: str | None) -> dict:
    config = ParallelConfig(world_size=2, ep=2)
    return {"id": 7, "status": "succeeded", "model": "tiny-moe", "model_spec": get_model("tiny-moe").to_dict(),
            "training": {**TRAINING.to_dict(), "search_precision": True},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 2},
            "best_trial": {"number": 3, "config": config.to_dict(), "step_time_s": 0.01,
                           "predicted_step_time_s": 0.012, "precision": trial_precision}}


def test_the_best_exports_at_the_precision_it_ran():
    fp8 = render(_job("fp8"), "megatron-args")
    assert "--fp8-format hybrid" in fp8 and "--bf16" in fp8 and "h100-sxm, fp8," in fp8
    assert best_record(_job("fp8"))["training"]["precision"] == "fp8"
    bf16 = render(_job("bf16"), "megatron-args")
    assert "--fp8-format" not in bf16 and "--bf16" in bf16
    assert best_record(_job(None))["training"]["precision"] == "bf16"  # an older trial: the job's precision
    assert render(_job("fp8"), "csv").splitlines()[1].split(",")[7] == "fp8"
