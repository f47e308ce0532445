"""A cancelled job's trials end as cancelled, never as lost: a trial the search starts after the cancel (before
the runner's next heartbeat noticed it) is not stored and stops the search at once, and a trial row still
running when the search stops is recorded "cancelled", not left for the stale sweep's "no heartbeat"."""

from __future__ import annotations

import copy
import threading
import types

import pytest
from runner_env import TINY_JOB, make_runner

from api.worker.runner import CANCELLED_REASON, _TrialRecorder
from api.worker.trials import JobStopped
from db.jobs import cancel_job
from db.models import Job, Trial
from db.queue import claim_next_job
from db.trials import fail_running_trials, start_trial
from spec.failure import FailureKind
from spec.layout_codec import Labelled
from spec.parallel_config import ParallelConfig


def _started(number: int, config: ParallelConfig) -> dict:
    """A ``trial_started`` event as the search emits it."""
    labelled = Labelled(config)
    return {"number": number, "layout": labelled.label(), "labelled": labelled}


@pytest.fixture
def running_job(client, alice, app):
    job_id = client.post("/v1/jobs", json=copy.deepcopy(TINY_JOB), headers=alice).json()["id"]
    with app.state.sessions() as s:
        assert claim_next_job(s, "test-runner").id == job_id
    return job_id


def test_a_trial_started_after_the_cancel_is_not_stored_and_stops_the_search(app, db_url, running_job):
    runner = make_runner(db_url)
    try:
        with app.state.sessions() as s:
            job = s.get(Job, running_job)
        stop = threading.Event()
        recorder = _TrialRecorder(runner, job, types.SimpleNamespace(estimates={}), stop)
        recorder("trial_started", _started(0, ParallelConfig(world_size=2, ep=2)))  # running: stored
        with app.state.sessions() as s:
            assert cancel_job(s, running_job)
        with pytest.raises(JobStopped):
            recorder("trial_started", _started(1, ParallelConfig(world_size=2, tp=2, ep=2)))
        assert stop.is_set()  # the trials in flight stop now, not at the next heartbeat
        with app.state.sessions() as s:
            trials = {t.number: (t.status, t.failure_kind) for t in s.query(Trial).filter_by(job_id=running_job)}
        assert trials == {0: ("failed", FailureKind.CANCELLED.value)}  # cancel_job's; trial 1 never stored
    finally:
        runner.close()


def test_trials_left_running_by_a_cancelled_search_are_recorded_cancelled(app, running_job):
    with app.state.sessions() as s:
        start_trial(s, running_job, 0, {"world_size": 2, "ep": 2}, runner_id="test-runner", label="ep2",
                    predicted_step_time_s=0.1)
        assert fail_running_trials(s, running_job, CANCELLED_REASON, FailureKind.CANCELLED) == [0]
        trial = s.query(Trial).filter_by(job_id=running_job).one()
        assert (trial.status, trial.failure_kind, trial.failure_reason) == ("failed", "cancelled", CANCELLED_REASON)
