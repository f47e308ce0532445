"""The README's everyday commands work as written: ``trainings submit ... --wait`` follows the new training to
its end."""

from __future__ import annotations

import threading
import time

from test_cli_agrees import _cli, measured  # noqa: F401 (measured is a fixture used here)

from db.queue import claim_next_training, finish_training
from db.trainings import record_training_metrics


def _run_training_when_queued(app, steps: int) -> threading.Thread:
    """A stand-in runner thread: claims the first queued training, stores ``steps`` metrics rows, succeeds."""
    def work():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with app.state.sessions() as s:
                training = claim_next_training(s, "r1")
                if training is not None:
                    record_training_metrics(s, training.id, [{"step": n, "loss": 5.0 - 0.1 * n, "step_time_s": 0.1}
                                                             for n in range(1, steps + 1)])
                    assert finish_training(s, training.id, "r1", "succeeded")
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_trainings_submit_with_wait_follows_the_new_training_to_its_end(capsys, app, measured,  # noqa: F811
                                                                         training_body):
    conn, _ = measured
    runner = _run_training_when_queued(app, steps=3)
    code, out, err = _cli(capsys, "trainings", "submit", "--job", "1", "--data", training_body["data_path"],
                          "--steps", "3", "--checkpoint-dir", training_body["checkpoint_dir"], "--wait",
                          "--poll", "0.05", *conn)
    runner.join(30)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("training 1 queued: tiny-moe")
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1", "2", "3"]
    assert lines[-1] == "training 1: succeeded"


def test_wait_without_an_id_or_submit_and_cancel_without_an_id_are_refused(capsys):
    code, _, err = _cli(capsys, "trainings", "--wait", "--api-key", "k")
    assert code == 2 and "--wait needs a training ID (or `trainings submit`)" in err, err
    code, _, err = _cli(capsys, "trainings", "submit", "--cancel", "--api-key", "k")
    assert code == 2 and "--cancel needs a training ID" in err, err
