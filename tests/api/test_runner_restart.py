"""A runner killed with SIGKILL mid-job: another runner requeues the stale job, resumes its Optuna study
and completes it; no trial is lost or recorded twice."""

from __future__ import annotations

import os
import signal
import time

import optuna
import pytest
from runner_env import make_runner, owner_session, runner_process, session_ray, wait_no_rank_actors
from sqlalchemy import select

from db.engine import make_engine, make_sessionmaker
from db.models import Job, Trial
from db.optuna_storage import optuna_storage_url

pytestmark = pytest.mark.slow
# The killed runner is dead when the rescuer looks, so no live heartbeat can race with a short limit.
STALE_AFTER_S = 2.0


def _submit(db_url: str, max_trials: int) -> int:
    from api.service.jobs import submit_job
    from api.schemas.jobs import JobCreate

    with owner_session(db_url) as (session, owner):
        request = JobCreate.model_validate({
            "model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8, "precision": "fp32"},
            "cluster": {"gpu": "cpu", "num_gpus": 2}, "budget": {"max_trials": max_trials, "max_seconds": 900}})
        return submit_job(session, owner, request, None)[0].id


def _trials(sessions, job_id: int) -> list[Trial]:
    with sessions() as session:
        return list(session.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)))


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_runner_killed_mid_job_is_resumed_without_losing_or_duplicating_trials(db_url, tmp_path):
    job_id = _submit(db_url, max_trials=2)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with runner_process(db_url, "doomed", tmp_path / "runner1.log", FOLDTUNE_TRIAL_WARMUP_STEPS="1",
                        FOLDTUNE_TRIAL_STEPS="1") as first:
        deadline = time.monotonic() + 240
        while True:  # kill it while its second trial runs, after the first one finished
            trials = _trials(sessions, job_id)
            if len(trials) >= 2 and trials[0].status != "running" and trials[-1].status == "running":
                break
            assert first.poll() is None, (tmp_path / "runner1.log").read_text()
            assert time.monotonic() < deadline, "the first runner never reached its second trial"
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        before = {t.number: (t.status, t.step_time_s, t.label) for t in trials if t.status != "running"}
        interrupted = trials[-1].number

        time.sleep(STALE_AFTER_S + 1)
        runner = make_runner(db_url, runner_id="rescuer", stale_after_s=STALE_AFTER_S)
        try:
            assert runner.run(once=True) == 1
        finally:
            runner.close()

        with sessions() as session:
            job = session.get(Job, job_id)
        trials = _trials(sessions, job_id)
    engine.dispose()

    assert job.status == "succeeded", job.error
    assert job.claimed_by == "rescuer" and job.attempts == 2
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(numbers)))  # every Optuna trial recorded, once
    study = optuna.load_study(study_name=f"job-{job_id}", storage=optuna_storage_url(db_url))
    assert sorted(t.number for t in study.trials) == numbers
    by_number = {t.number: t for t in trials}
    for number, (status, step_time, label) in before.items():  # what finished before the kill is untouched
        assert (by_number[number].status, by_number[number].step_time_s, by_number[number].label) == \
               (status, step_time, label)
    lost = by_number[interrupted]
    assert (lost.status, lost.failure_kind) == ("failed", "lost")
    # The interrupted layout was measured again under a new number; the budget of 2 finished trials holds.
    counted = [t for t in trials if t.failure_kind != "lost"]
    assert len(counted) == 2 and all(t.status in ("succeeded", "pruned", "failed") for t in trials)
    assert lost.label in {t.label for t in counted}
    assert len({t.label for t in counted}) == len(counted)
    assert wait_no_rank_actors() == []


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_a_runner_shut_down_mid_trial_gives_the_job_back_and_the_trial_is_measured_again(db_url):
    import threading

    session_ray()
    job_id = _submit(db_url, max_trials=1)  # one trial: the lost one, measured again as trial 1
    runner = make_runner(db_url, runner_id="leaving", timed_steps=200)
    statuses: list = []
    thread = threading.Thread(target=lambda: statuses.append(runner.run_job_id(job_id)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while not any(t.status == "running" for t in _trials(runner.sessions, job_id)):
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.2)
        time.sleep(2)
        runner.stop()  # what SIGTERM does in `foldtune runner`
        thread.join(120)
        assert statuses == ["queued"]
        with runner.sessions() as session:
            job = session.get(Job, job_id)
        assert job.status == "queued" and job.claimed_by is None
        [lost] = _trials(runner.sessions, job_id)
        assert (lost.status, lost.failure_kind) == ("failed", "lost")
    finally:
        runner.stop()
        thread.join(30)
        runner.close()

    again = make_runner(db_url, runner_id="next")
    try:
        assert again.run(once=True) == 1
        trials = _trials(again.sessions, job_id)
        with again.sessions() as session:
            job = session.get(Job, job_id)
    finally:
        again.close()
    assert job.status == "succeeded"
    assert [t.number for t in trials] == [0, 1]
    assert trials[1].label == lost.label and trials[1].status == "succeeded"  # measured again, in full
    assert wait_no_rank_actors() == []
