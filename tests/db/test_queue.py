"""Runners claiming, heartbeating and losing jobs, trials and trainings."""

import threading
from datetime import timedelta

import pytest
from sqlalchemy import select, text

from db.engine import is_postgres
from db.keys import get_or_create_owner
from db.models import Job, Training, Trial, utcnow
from db.queue import (claim_next_job, claim_next_training, finish_job, heartbeat_job, release_job, release_training,
                      requeue_stale)
from db.trials import best_trial, finish_trial, heartbeat_running_trials, start_trial


def test_claims_oldest_first_and_none_when_empty(sessions, add_jobs):
    ids = add_jobs(2)
    with sessions() as s:
        first = claim_next_job(s, "r1")
        assert (first.id, first.status, first.claimed_by, first.attempts) == (ids[0], "running", "r1", 1)
        assert first.started_at is not None and first.heartbeat_at is not None
        assert claim_next_job(s, "r2").id == ids[1]
        assert claim_next_job(s, "r3") is None


def test_concurrent_runners_never_claim_the_same_job(sessions, add_jobs):
    ids = add_jobs(40)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def runner(name):
        got = claimed.setdefault(name, [])
        try:
            barrier.wait()
            with sessions() as s:
                while (job := claim_next_job(s, name)) is not None:
                    got.append(job.id)
                    assert finish_job(s, job.id, name, "succeeded")
        except BaseException as exc:  # surfaced below, a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(f"runner{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    all_claims = [i for got in claimed.values() for i in got]
    assert sorted(all_claims) == ids  # every job once, none twice
    with sessions() as s:
        assert s.scalar(select(Job).where(Job.status != "succeeded")) is None


@pytest.mark.postgres
@pytest.mark.parametrize("db_kind", ["postgres"], indirect=True)  # SQLite serialises whole transactions instead
def test_postgres_claim_skips_a_row_locked_by_another_runner(sessions, add_jobs):
    ids = add_jobs(2)
    with sessions() as holder, sessions() as other:
        assert is_postgres(holder)
        locked = holder.scalar(select(Job.id).where(Job.status == "queued").order_by(Job.created_at)
                               .limit(1).with_for_update(skip_locked=True))
        assert locked == ids[0]
        other.execute(text("SET LOCAL lock_timeout = '2s'"))  # waiting instead of skipping would fail here
        job = claim_next_job(other, "r2")
        assert job.id == ids[1]
        holder.rollback()


def test_restarted_runner_gets_its_running_job_back(sessions, add_jobs):
    ids = add_jobs(2)
    with sessions() as s:
        assert claim_next_job(s, "r1").id == ids[0]
        again = claim_next_job(s, "r1")
        assert again.id == ids[0] and again.attempts == 1


def test_heartbeat_fails_once_job_is_cancelled_or_taken(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        claim_next_job(s, "r1")
        assert heartbeat_job(s, job_id, "r1")
        assert not heartbeat_job(s, job_id, "someone-else")
        s.get(Job, job_id).status = "cancelled"
        s.commit()
        assert not heartbeat_job(s, job_id, "r1")
        assert not finish_job(s, job_id, "r1", "succeeded")


def test_release_puts_job_back_without_counting_the_attempt(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        claim_next_job(s, "r1")
        assert release_job(s, job_id, "r1")
        job = s.get(Job, job_id, populate_existing=True)
        assert (job.status, job.claimed_by, job.attempts) == ("queued", None, 0)


def test_requeue_stale_job_and_fail_its_lost_trial(sessions, add_jobs):
    stale_id, fresh_id = add_jobs(2)
    long_ago = utcnow() - timedelta(minutes=10)
    with sessions() as s:
        claim_next_job(s, "dead", now=long_ago)
        claim_next_job(s, "alive")
        lost = start_trial(s, stale_id, 0, {"tp": 1}, runner_id="dead", now=long_ago)
        live = start_trial(s, fresh_id, 0, {"tp": 2}, runner_id="alive")
        report = requeue_stale(s, timeout_s=60)
        assert report.jobs_requeued == [stale_id] and report.trials_failed == [lost.id]
        stale = s.get(Job, stale_id, populate_existing=True)
        assert (stale.status, stale.claimed_by) == ("queued", None)
        assert s.get(Job, fresh_id, populate_existing=True).status == "running"
        lost_row = s.get(Trial, lost.id, populate_existing=True)
        assert (lost_row.status, lost_row.failure_kind) == ("failed", "lost")
        assert s.get(Trial, live.id, populate_existing=True).status == "running"
        # the dead runner's late result is refused; another runner takes the job over
        assert not finish_trial(s, lost.id, "succeeded", measurement={"step_time_s": 1.0}, step_time_s=1.0)
        assert not heartbeat_job(s, stale_id, "dead")
        assert claim_next_job(s, "r2").id == stale_id


def test_requeue_gives_up_after_max_attempts(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        for attempt in range(3):
            claim_next_job(s, f"dead{attempt}", now=utcnow() - timedelta(hours=1))
            report = requeue_stale(s, timeout_s=60, max_attempts=3)
        assert report.jobs_failed == [job_id] and report.jobs_requeued == []
        job = s.get(Job, job_id, populate_existing=True)
        assert job.status == "failed" and "3 time(s)" in job.error


def test_trial_lifecycle_and_best(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        claim_next_job(s, "r1")
        slow = start_trial(s, job_id, 0, {"tp": 1}, runner_id="r1", predicted_step_time_s=0.5)
        fast = start_trial(s, job_id, 1, {"tp": 2}, runner_id="r1")
        oom = start_trial(s, job_id, 2, {"tp": 4}, runner_id="r1")
        assert heartbeat_running_trials(s, job_id, "r1")  # slow, fast and oom are running
        assert finish_trial(s, slow.id, "succeeded", measurement={"step_time_s": 0.9}, step_time_s=0.9)
        assert finish_trial(s, fast.id, "succeeded", measurement={"step_time_s": 0.4}, step_time_s=0.4)
        assert finish_trial(s, oom.id, "failed", failure_kind="oom", failure_reason="CUDA out of memory")
        assert not heartbeat_running_trials(s, job_id, "r1")  # none is running any more
        with pytest.raises(ValueError, match="failure_kind"):
            finish_trial(s, slow.id, "failed")
        job = s.get(Job, job_id, populate_existing=True)
        assert job.best_trial_id == fast.id
        assert best_trial(s, owner_id=job.owner_id, signature="sig").id == fast.id
        other = get_or_create_owner(s, "mallory")
        s.commit()
        assert best_trial(s, owner_id=other.id, signature="sig") is None


def test_duplicate_trial_number_is_refused(sessions, add_jobs):
    from sqlalchemy.exc import IntegrityError

    (job_id,) = add_jobs(1)
    with sessions() as s:
        start_trial(s, job_id, 0, {"tp": 1}, runner_id="r1")
        with pytest.raises(IntegrityError):
            start_trial(s, job_id, 0, {"tp": 1}, runner_id="r1")


def _queued_training(s, job_id: int) -> Training:
    """A queued training of the job's owner, stored."""
    tr = Training(owner_id=s.get(Job, job_id).owner_id, job_id=job_id, config={"tp": 1}, model_spec={},
                  training_spec={}, cluster={}, data_path="/data", steps=10, checkpoint_dir="/ckpt")
    s.add(tr)
    s.commit()
    return tr


def test_training_claim_and_stale_requeue(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        tr = _queued_training(s, job_id)
        claimed = claim_next_training(s, "dead", now=utcnow() - timedelta(hours=1))
        assert claimed.id == tr.id
        assert requeue_stale(s, timeout_s=60).trainings_requeued == [tr.id]
        assert claim_next_training(s, "r2").id == tr.id


def test_release_puts_a_training_back_without_counting_the_attempt(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        tr = _queued_training(s, job_id)
        assert claim_next_training(s, "r1").id == tr.id
        assert not release_training(s, tr.id, "r2")  # only its holder gives it back
        assert release_training(s, tr.id, "r1")
        row = s.get(Training, tr.id, populate_existing=True)
        assert (row.status, row.claimed_by, row.heartbeat_at, row.attempts) == ("queued", None, None, 0)
        assert claim_next_training(s, "r2").id == tr.id
