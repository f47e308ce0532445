"""The README's everyday commands work as written: ``trainings submit ... --wait`` follows the new training to
its end; ``best`` and ``plan`` take a proxy (``--layers``, ``--proxy``, or ``best --model X@NL``) as
``submit`` does."""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_cli_agrees import _cli, measured  # noqa: F401 (measured is a fixture used here)

from db.queue import claim_next_job, claim_next_training, finish_job, finish_training
from db.trainings import record_training_metrics
from db.trials import finish_trial, start_trial
from spec.parallel_config import ParallelConfig


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


QWEN = ["--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "8", "--seq", "4096", "--gbs", "64"]


@pytest.fixture
def measured_proxy(app, keys, server_url, capsys):
    """Job 1 of alice: a 4-layer proxy of qwen3-30b-a3b on 8 H100s, with a measured trial of layout ep8."""
    conn = ["--url", server_url, "--api-key", keys["alice"]]
    code, _, err = _cli(capsys, "submit", *QWEN, "--layers", "4", "--max-trials", "3", *conn)
    assert code == 0, err
    config = ParallelConfig(world_size=8, ep=8)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, 1, 0, config.to_dict(), runner_id="r", label=config.label(), predicted_step_time_s=0.2)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.25}, step_time_s=0.25)
        finish_job(s, 1, "r", "succeeded")
    return conn


@pytest.mark.parametrize("model", [["--layers", "4"], ["--model", "qwen3-30b-a3b@4L"]])
def test_best_finds_a_proxy_job_by_layers_or_by_its_name(capsys, measured_proxy, model):
    code, out, err = _cli(capsys, "best", *QWEN, *model, "--json", *measured_proxy)
    assert code == 0, err
    best = json.loads(out)
    assert best["job_id"] == 1 and best["model"] == "qwen3-30b-a3b@4L" and best["trial"]["step_time_s"] == 0.25


def test_best_of_the_full_model_or_another_proxy_is_not_the_proxy_jobs(capsys, measured_proxy):
    code, _, err = _cli(capsys, "best", *QWEN, *measured_proxy)
    assert code == 2 and "has a succeeded trial" in err, err  # the 48-layer model was never measured
    code, _, err = _cli(capsys, "best", *QWEN, "--layers", "2", *measured_proxy)
    assert code == 2 and "has a succeeded trial" in err, err
    code, _, err = _cli(capsys, "best", *QWEN[:1], "qwen3-30b-a3b@4L", *QWEN[2:], "--layers", "2", *measured_proxy)
    assert code == 2 and "names num_layers_override 4, the query gives 2 [proxy_agrees]" in err, err


def test_plan_plans_a_proxy_with_layers_or_proxy(capsys):
    code, out, err = _cli(capsys, "plan", *QWEN, "--layers", "4", "--top", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == "qwen3-30b-a3b@4L"
    code, out, err = _cli(capsys, "plan", "--model", "qwen3-30b-a3b", "--proxy", "tiny", "--gpu", "cpu", "--gpus", "4",
                          "--top", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == "qwen3-30b-a3b@tiny"
    code, _, err = _cli(capsys, "plan", *QWEN, "--layers", "999")
    assert code == 2 and "--layers: a proxy's layer count (999) must lie in [1, 48]" in err, err
