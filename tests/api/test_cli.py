"""The CLI against a real server: keys, submit (with --wait), jobs, best; failures are one line."""

import threading
import time

import pytest

from api.cli.main import main
from db.queue import claim_next_job, finish_job
from db.trials import finish_trial, start_trial


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def conn(server_url, keys):
    return ["--url", server_url, "--api-key", keys["alice"]]


SUBMIT = ["submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--seq", "64", "--gbs", "8",
          "--max-trials", "3"]


def test_keys_create_prints_a_working_key(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("FOLDTUNE_DATABASE_URL", raising=False)
    code, out, _ = _cli(capsys, "keys", "create", "carol")
    assert code == 0 and (tmp_path / "data" / "foldtune.sqlite3").exists()
    token = out.strip().splitlines()[-1]
    from fastapi.testclient import TestClient

    from api.http.app import create_app

    with TestClient(create_app()) as client:
        assert client.get("/v1/jobs", headers={"X-API-Key": token}).status_code == 200
        assert client.get("/v1/jobs", headers={"X-API-Key": token + "x"}).status_code == 401


def test_submit_jobs_and_best(capsys, conn, app):
    code, out, _ = _cli(capsys, *SUBMIT, *conn)
    assert code == 0 and out.startswith("job 1 queued: tiny-moe on 4x cpu")
    code, out, _ = _cli(capsys, "jobs", *conn)
    assert code == 0 and "queued" in out and "tiny-moe" in out and "1-1 of 1" in out
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, 1, 0, {"tp": 2, "ep": 2}, runner_id="r", label="tp2 ep2", predicted_step_time_s=0.2)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.25}, step_time_s=0.25)
    code, out, _ = _cli(capsys, "jobs", "1", *conn)
    assert "trial   0 succeeded tp2 ep2: 0.25 s/step (predicted 0.2 s)" in out
    code, out, _ = _cli(capsys, "best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--seq", "64",
                        "--gbs", "8", *conn)
    assert code == 0 and "job 1 trial 0" in out and "tp2 ep2" in out and "0.25 s measured" in out


def test_submit_wait_follows_trials_until_the_job_ends(capsys, conn, app):
    def runner():  # stands in for the runner process: claims, records two trials, finishes
        with app.state.sessions() as s:
            while (job := claim_next_job(s, "r")) is None:
                time.sleep(0.05)
            a = start_trial(s, job.id, 0, {"tp": 1}, runner_id="r", label="tp1")
            finish_trial(s, a.id, "failed", failure_kind="oom", failure_reason="out of memory on rank 0")
            b = start_trial(s, job.id, 1, {"tp": 2}, runner_id="r", label="tp2")
            finish_trial(s, b.id, "succeeded", measurement={"step_time_s": 0.5}, step_time_s=0.5)
            finish_job(s, job.id, "r", "succeeded")

    thread = threading.Thread(target=runner)
    thread.start()
    code, out, _ = _cli(capsys, *SUBMIT, "--wait", "--poll", "0.05", *conn)
    thread.join(10)
    assert code == 0, out
    assert "trial   0 failed tp1: out of memory on rank 0" in out
    assert "trial   1 succeeded tp2: 0.5 s/step" in out
    assert out.rstrip().endswith("best: trial 1 tp2 0.5 s/step")


def test_jobs_cancel(capsys, conn):
    _cli(capsys, *SUBMIT, *conn)
    code, out, _ = _cli(capsys, "jobs", "1", "--cancel", *conn)
    assert code == 0 and out.strip() == "job 1: cancelled"


@pytest.mark.parametrize("argv, message", [
    (["jobs", "--url", "http://127.0.0.1:9", "--api-key", "k"], "cannot reach the foldtune API at http://127.0.0.1:9"),
    (["jobs", "--url", "http://127.0.0.1:9"], "no API key"),
])
def test_connection_problems_are_one_line(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.delenv("FOLDTUNE_API_KEY", raising=False)
    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path))  # no key file, whatever `foldtune tune` left in ~
    monkeypatch.setenv("FOLDTUNE_HTTP_ATTEMPTS", "1")  # no retries: nothing listens on port 9
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("foldtune: error: ") and message in err


def test_server_problems_are_one_line(capsys, conn):
    code, _, err = _cli(capsys, "submit", "--model", "nope", "--gpu", "cpu", "--gpus", "4", "--seq", "64",
                        "--gbs", "8", *conn)
    assert code == 2 and err.count("\n") == 1 and "[known_model]" in err
    code, _, err = _cli(capsys, "jobs", "77", *conn)
    assert code == 2 and err.strip() == "foldtune: error: Not found: job 77 does not exist"
    code, _, err = _cli(capsys, "best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--seq", "64",
                        "--gbs", "8", *conn)
    assert code == 2 and "No measured layout yet" in err


def test_submit_an_inline_model_from_a_file(capsys, conn, tmp_path):
    spec = tmp_path / "my-moe.yaml"
    spec.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
                    "vocab_size: 256\nnum_experts: 4\nmoe_router_topk: 2\n")
    code, out, _ = _cli(capsys, "submit", "--model-file", str(spec), "--gpu", "cpu", "--gpus", "2", "--seq", "64",
                        "--gbs", "4", *conn)
    assert code == 0 and "my-moe on 2x cpu" in out
    spec.write_text("num_layers: [unclosed\n")
    code, _, err = _cli(capsys, "submit", "--model-file", str(spec), "--gpu", "cpu", "--gpus", "2", "--seq", "64",
                        "--gbs", "4", *conn)
    assert code == 2 and err.count("\n") == 1 and "is not valid JSON/YAML" in err


@pytest.mark.parametrize("argv", [["keys", "create", "x"], ["serve"]])
def test_unreachable_database_is_one_line(capsys, monkeypatch, argv):
    monkeypatch.setenv("FOLDTUNE_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2")
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("foldtune: error: cannot open the database postgresql+psycopg://nobody@127.0.0.1:9/none")


def test_submit_refuses_what_the_executor_cannot_run_in_one_line(capsys, conn, tmp_path):
    dropout = tmp_path / "drop-moe.yaml"
    dropout.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
                       "vocab_size: 256\nnum_experts: 4\nmoe_router_topk: 2\nhidden_dropout: 0.1\n")
    cases = [(["--model-file", str(dropout), "--gpu", "cpu", "--gpus", "2"], "[executor_model]", "dropout"),
             (["--model", "tiny-moe", "--layers", "9", "--gpu", "cpu", "--gpus", "4"], "[proxy_layers]", "[1, 2]"),
             (["--model", "mixtral-8x22b", "--gpu", "h100", "--gpus", "8", "--seq", "4096", "--gbs", "1024"],
              "[layout_fits]", "fit in GPU memory")]
    for argv, rule, says in cases:
        code, out, err = _cli(capsys, "submit", "--seq", "64", "--gbs", "8", *argv, *conn)
        assert code == 2 and out == "" and err.count("\n") == 1 and rule in err and says in err, err
    code, out, _ = _cli(capsys, "submit", "--model", "mixtral-8x7b", "--proxy", "tiny", "--layers", "1", "--gpu",
                        "cpu", "--gpus", "2", "--seq", "64", "--gbs", "4", *conn)
    assert code == 0 and "mixtral-8x7b@tiny@1L on 2x cpu" in out
