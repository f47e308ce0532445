"""A training whose runner is killed (SIGKILL) mid-run: its heartbeat goes stale, ``requeue_stale`` puts it
back in the queue, another runner claims it and the training resumes from its latest checkpoint: the steps
up to the checkpoint are kept as stored, the steps after it are run again with the same losses (the data
order and RNG states are restored), and the series ends at the step budget without restarting at step 1."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from runner_env import owner_session, rank_actor_pids, run_one_claim, runner_process, session_ray, wait_no_rank_actors
from sqlalchemy import select

from db.engine import make_engine, make_sessionmaker
from db.models import Training, TrainingMetric
from db.queue import requeue_stale
from executor.dataset.prepare import prepare_dataset
from executor.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow
STALE_AFTER_S = 3.0
STEPS = 14
CHECKPOINT_EVERY = 4
KILL_AFTER_STEP = 6  # past a checkpoint, and a few steps past it


def _submit(db_url: str, data: str, ckpt: str, data_root: Path) -> int:
    from api.schemas.trainings import TrainingCreate
    from api.service.trainings import submit_training

    with owner_session(db_url) as (session, owner):
        request = TrainingCreate.model_validate({
            "layout": "tp1 ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": 32, "global_batch_size": 4, "data_path": data, "steps": STEPS, "checkpoint_dir": ckpt,
            "checkpoint_every": CHECKPOINT_EVERY, "warmup_steps": 2, "eval_batches": 1})
        return submit_training(session, owner, request, data_root=data_root).id


def _descendants(pids: list[int]) -> list[int]:
    """Those of ``pids`` started under this test process (its Ray's rank actors, not another session's)."""
    def parent(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return 0

    mine = []
    for pid in pids:
        up = pid
        while up > 1 and up != os.getpid():
            up = parent(up)
        if up == os.getpid():
            mine.append(pid)
    return mine


def _metrics(sessions, training_id: int) -> dict[int, tuple[int, float]]:
    """step -> (row id, loss) of the stored series."""
    with sessions() as session:
        rows = session.scalars(select(TrainingMetric).where(TrainingMetric.training_id == training_id))
        return {m.step: (m.id, m.loss) for m in rows}


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_a_training_whose_runner_died_resumes_from_its_checkpoint_under_another_runner(db_url, tmp_path):
    session_ray()
    docs = Path(__file__).resolve().parents[2] / "docs"
    root = tmp_path / "data-root"  # the service's FOLDTUNE_DATA_ROOT: both runners check the paths against it
    data = str(prepare_dataset([str(docs)], str(root / "alice" / "data"), heldout_fraction=0.1).path)
    ckpt = root / "alice" / "ckpt"
    training_id = _submit(db_url, data, "ckpt", root)  # relative: in alice's directory
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with runner_process(db_url, "doomed", tmp_path / "runner1.log", FOLDTUNE_DATA_ROOT=str(root)) as first:
        deadline = time.monotonic() + 120
        while max(_metrics(sessions, training_id), default=0) < KILL_AFTER_STEP:
            assert first.poll() is None, (tmp_path / "runner1.log").read_text()
            assert time.monotonic() < deadline, f"the first runner never reached step {KILL_AFTER_STEP}"
            time.sleep(0.05)
        # The machine goes down: the runner and its ranks at once (Ray would reap the ranks of a dead driver
        # too, but a second later, and rank 0 would go on storing steps meanwhile).
        for pid in [first.pid, *_descendants(rank_actor_pids())]:
            os.kill(pid, signal.SIGKILL)
        first.wait(10)
        assert wait_no_rank_actors() == []
        before = _metrics(sessions, training_id)
        killed_at = max(before)
        assert killed_at < STEPS, "the training finished before its runner was killed"
        resume_step = int(latest_checkpoint(ckpt).name.split("-")[1])  # steps done when it was saved
        assert CHECKPOINT_EVERY <= resume_step < killed_at and resume_step % CHECKPOINT_EVERY == 0

        with sessions() as session:
            assert requeue_stale(session, STALE_AFTER_S).trainings_requeued == []  # its heartbeat is still fresh
            assert session.get(Training, training_id).status == "running"
        time.sleep(STALE_AFTER_S + 1)
        with sessions() as session:
            report = requeue_stale(session, STALE_AFTER_S)
            assert report.trainings_requeued == [training_id]
            requeued = session.get(Training, training_id)
            assert (requeued.status, requeued.claimed_by) == ("queued", None)

        run_one_claim(db_url, data_root=root)  # another runner (id test-runner)
        with sessions() as session:
            training = session.get(Training, training_id)
        after = _metrics(sessions, training_id)
    engine.dispose()

    assert training.status == "succeeded", training.error
    assert (training.claimed_by, training.attempts) == ("test-runner", 2)
    assert sorted(after) == list(range(1, STEPS + 1))  # one series, no restart at step 1, nothing missing
    for step in range(1, resume_step + 1):  # up to the checkpoint: the first runner's rows, untouched
        assert after[step] == before[step]
    for step in range(resume_step + 1, killed_at + 1):  # after it: run again, from the restored state
        assert after[step][0] != before[step][0]
        assert after[step][1] == pytest.approx(before[step][1], rel=1e-4)
    assert int(latest_checkpoint(ckpt).name.split("-")[1]) == STEPS
    assert wait_no_rank_actors() == []
