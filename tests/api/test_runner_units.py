"""The runner's small decisions, without Ray: candidates, fault selection, settings (failure kinds come typed
from the launchers: tests/executor/test_launch*.py, and end to end tests/api/test_faults.py)."""

from __future__ import annotations

import dataclasses

import pytest

from api.worker.runner import RunnerSettings
from api.worker.candidates import CANDIDATES_PER_TRIAL, job_candidates
from api.worker.trials import faults_for_trial, fixed_cost_summary
from spec.catalog import get_hardware, get_model
from spec.errors import SpecError
from spec.validity import executor_layout_rules
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec


def test_candidates_are_the_fastest_fitting_layouts_the_executor_runs():
    training = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32")
    cands = job_candidates(get_model("tiny-moe"), training, ClusterSpec(get_hardware("cpu"), 4), max_trials=3)
    assert 0 < len(cands.candidates) <= CANDIDATES_PER_TRIAL * 3
    # EP all-to-all overlap is searched where the executor builds it (pp = 1)
    assert all(c.config.pp == 1 for c in cands.candidates if c.config.overlap_moe_expert_parallel_comm)
    times = [c.rank_time for c in cands.candidates]  # the planner's robust order: the intervals' high ends
    assert times == sorted(times) and all(c.predicted_low <= c.predicted_step_time <= c.predicted_high
                                          for c in cands.candidates)
    assert set(cands.estimates) == {c.labelled for c in cands.candidates}
    assert cands.summary()["searched"] == len(cands.candidates) and cands.fitting <= cands.valid
    # A wider search reaches layouts the executor cannot build (tp 4 does not divide tiny-moe's 2 kv heads):
    # they are dropped with their reason counted, and no candidate breaks an executor rule.
    wide = job_candidates(get_model("tiny-moe"), training, ClusterSpec(get_hardware("cpu"), 4), max_trials=30)
    assert wide.not_executable, wide.summary()  # non-empty, so the checks below check something
    assert all("must be divisible by tp (4)" in why or "overlap_moe_expert_parallel_comm" in why
               for why in wide.not_executable)
    assert any("must be divisible by tp (4)" in why for why in wide.not_executable)
    assert 0 < sum(wide.not_executable.values()) <= wide.planned - len(wide.candidates)
    assert wide.candidates and all(c.config.tp < 4 for c in wide.candidates)
    for c in (*cands.candidates, *wide.candidates):
        assert executor_layout_rules(get_model("tiny-moe"), c.config, training.seq_length) == [], c.config.label()


def test_faults_select_trials():
    spec = "oom:rank=1:step=0:trial=0,kill:rank=1:step=2:trial=1,hang:rank=0:step=1"
    assert faults_for_trial(spec, 0) == "oom:rank=1:step=0,hang:rank=0:step=1"
    assert faults_for_trial(spec, 1) == "kill:rank=1:step=2,hang:rank=0:step=1"
    assert faults_for_trial(spec, 5) == "hang:rank=0:step=1"
    assert faults_for_trial("", 0) == ""
    with pytest.raises(SpecError, match="trial must be an integer"):
        faults_for_trial("kill:rank=1:trial=x", 0)


def test_settings_from_the_environment():
    env = {"FOLDTUNE_DATABASE_URL": "sqlite:////tmp/x.sqlite3", "FOLDTUNE_RUNNER_ID": "r7",
           "FOLDTUNE_TRIAL_STEPS": "4", "FOLDTUNE_PARALLEL_TRIALS": "2", "FOLDTUNE_RANK_MEMORY_BYTES": "1e9"}
    s = RunnerSettings.from_env(environ=env)
    assert (s.database_url, s.runner_id, s.parallel_trials) == ("sqlite:////tmp/x.sqlite3", "r7", 2)
    assert (s.trial.timed_steps, s.trial.rank_memory_bytes) == (4, 10**9)
    assert s.trial.reuse_ranks
    assert not RunnerSettings.from_env(environ={**env, "FOLDTUNE_REUSE_RANKS": "0"}).trial.reuse_ranks
    with pytest.raises(SpecError, match="FOLDTUNE|timed_steps|invalid"):
        RunnerSettings.from_env(environ={**env, "FOLDTUNE_TRIAL_STEPS": "0"})
    with pytest.raises(SpecError, match="bad"):
        RunnerSettings.from_env(environ={**env, "FOLDTUNE_HEARTBEAT_S": "soon"})


@pytest.mark.parametrize("model, cluster, rule, says", [
    (get_model("mixtral-8x22b"), ClusterSpec(get_hardware("h100"), 8), "layout_fits", "fit in GPU memory"),
    (dataclasses.replace(get_model("tiny-moe"), hidden_dropout=0.1), ClusterSpec(get_hardware("cpu"), 4),
     "executor_model", "dropout"),
])
def test_no_candidate_comes_with_the_rule_and_a_reason(model, cluster, rule, says):
    # a job stored without the front door's check (an older server, a direct insert) fails with this reason
    training = TrainingSpec(seq_length=4096, global_batch_size=1024)
    cands = job_candidates(model, training, cluster, max_trials=3)
    assert cands.candidates == [] and cands.rejection.rule == rule and says in cands.rejection.reason
    assert str(cands.rejection).split("]", 1)[1].split(":", 1)[-1].strip()  # never empty after the colon


def test_fixed_cost_summary_takes_the_first_trial_apart_from_the_median_of_the_others():
    # by trial number, whatever order they finished in: trial 0 started the ranks
    summary = fixed_cost_summary({3: 2.0, 0: 30.0, 1: 1.0, 2: 4.0})
    assert summary == {"trials": 4, "first_s": 30.0, "median_after_first_s": 2.0, "total_s": 37.0}
    assert fixed_cost_summary({5: 9.0}) == {"trials": 1, "first_s": 9.0, "median_after_first_s": None, "total_s": 9.0}
    assert fixed_cost_summary({})["first_s"] is None


def test_the_trial_line_and_the_job_summary_show_the_fixed_cost():
    import io

    from api.cli.tune_cmd import TrialPrinter
    from executor.measurement import Measurement

    out = io.StringIO()
    m = Measurement(ok=True, step_time=0.05, fixed_cost_s=2.25, startup_s=0.5, warmup_s=1.75, reused_ranks=True)
    TrialPrinter(out)("trial_finished", {"number": 1, "layout": "tp2", "state": "complete", "measurement": m,
                                         "step_time": 0.05, "predicted_step_time": 0.04})
    assert out.getvalue().rstrip().endswith("ok  fixed cost 2.2 s (start-up 0.5 s, warm-up 1.8 s, reused ranks)")
    out = io.StringIO()
    TrialPrinter(out)("job_finished", {"job_id": 1, "status": "succeeded", "rows": [], "best": None, "result": {
        "time_multipliers": {}, "memory_multiplier": 1.0, "num_observations": 0, "stopped_because": "budget",
        "fixed_cost": {"trials": 3, "first_s": 20.0, "median_after_first_s": 1.5, "total_s": 23.5}}})
    assert ("fixed cost per trial (dispatch to first timed step): first 20.0 s, median after the first 1.5 s, "
            "23.5 s in all (3 trials)") in out.getvalue()
