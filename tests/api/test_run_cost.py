"""``--tokens``/``--price-per-gpu-hour`` (plan, best) and ``tokens``/``price_per_gpu_hour`` (POST /v1/plans,
GET /v1/best): the time and cost to train N tokens, on numbers worked by hand; bad values are one line / a 422
naming the rule."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from db.queue import claim_next_job
from db.trials import finish_trial, start_trial

TINY = ["plan", "--model", "tiny-moe", "--gpus", "8", "--gpu", "cpu", "--seq", "128", "--gbs", "16"]
PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 2}


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_answers_time_and_cost_of_each_ranked_layout(capsys):
    code, out, _ = _cli(capsys, *TINY, "--top", "3", "--json", "--tokens", "1M", "--price-per-gpu-hour", "2.5")
    assert code == 0
    data = json.loads(out)
    runs = data["training_runs"]
    assert [r["layout"] for r in runs] == [e["layout"] for e in data["ranked"]]
    for run, estimate in zip(runs, data["ranked"]):
        # 16 x 128 = 2,048 tokens a step; 1,000,000 / 2,048 = 488.3 -> 489 steps
        assert run["tokens"] == 10**6 and run["tokens_per_step"] == 2048 and run["steps"] == 489
        assert run["wall_s"] == pytest.approx(489 * estimate["step_time_s"])
        assert run["gpu_hours"] == pytest.approx(8 * run["wall_s"] / 3600)
        assert run["cost_usd"] == pytest.approx(2.5 * run["gpu_hours"])


def test_plan_text_prints_the_answer_below_the_table(capsys):
    code, out, _ = _cli(capsys, *TINY, "--top", "2", "--tokens", "300B", "--price-per-gpu-hour", "3")
    assert code == 0
    assert ("time and cost to train 300B tokens (300,000,000,000): global batch 16 x seq 128 = 2,048 tokens per "
            "step, 146,484,375 steps on 8 GPUs, at 3 USD per GPU-hour") in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("time and cost"))
    assert lines[start + 1].split() == ["#", "step", "wall", "time", "GPU-hours", "cost", "layout"]
    # "1  13.969 ms  568.4 h (23.68 days)  4547.2  13641.62 USD  tp1 ..." without its thousands separators
    first = lines[start + 3].replace(",", "").split()
    assert first[0] == "1" and first[4] == "h" and first[5] == "(" + first[5][1:] and first[6] == "days)"
    wall_h, gpu_h, cost = float(first[3]), float(first[7]), float(first[8])
    assert gpu_h == pytest.approx(8 * wall_h, rel=1e-3) and cost == pytest.approx(3 * gpu_h, rel=1e-3)
    assert float(first[5][1:]) == pytest.approx(wall_h / 24, rel=1e-3) and first[10].startswith("tp")
    # without a price: time only, no cost column
    code, out, _ = _cli(capsys, *TINY, "--top", "1", "--tokens", "1e9")
    heading = next(line for line in out.splitlines() if line.startswith("time and cost"))
    assert "USD" not in heading and " cost " not in out.split(heading)[1].splitlines()[0]


def test_plan_explain_answers_for_the_explained_layout(capsys):
    code, out, _ = _cli(capsys, *TINY, "--explain", "tp1 ep8 mbs1", "--json", "--tokens", "2048000")
    data = json.loads(out)
    assert code == 0 and data["training_run"]["steps"] == 1000
    assert data["training_run"]["wall_s"] == pytest.approx(1000 * data["estimate"]["step_time_s"])


@pytest.mark.parametrize("flags, message", [
    (["--tokens", "1.5X"], "--tokens takes a number of tokens such as 1e12, 300B or 1.5T"),
    (["--tokens", "0"], "--tokens must be at least 1 token"),
    (["--tokens", "1e20"], "--tokens must be at most 1e+16 tokens"),
    (["--tokens", "1T", "--price-per-gpu-hour", "-1"], "--price-per-gpu-hour must be more than 0 and at most 1000"),
    (["--tokens", "1T", "--price-per-gpu-hour", "nan"], "--price-per-gpu-hour must be more than 0"),
    (["--price-per-gpu-hour", "2"], "--price-per-gpu-hour needs --tokens"),
])
def test_bad_values_are_one_line_naming_the_flag(capsys, flags, message):
    code, out, err = _cli(capsys, *TINY, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err


def test_http_plan_answers_tokens_and_price(client, alice):
    r = client.post("/v1/plans", json={**PLAN, "tokens": 1e6, "price_per_gpu_hour": 4.0}, headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["training_runs"]) == len(body["ranked"]) > 0
    for run, estimate in zip(body["training_runs"], body["ranked"]):
        # 8 x 64 = 512 tokens a step; 1,000,000 / 512 = 1,953.1 -> 1,954 steps on 4 GPUs
        assert run["layout"] == estimate["layout"] and (run["tokens_per_step"], run["steps"]) == (512, 1954)
        assert run["wall_s"] == pytest.approx(1954 * estimate["step_time_s"])
        assert run["cost_usd"] == pytest.approx(4 * run["wall_s"] / 3600 * 4.0)
    assert client.post("/v1/plans", json=PLAN, headers=alice).json()["training_runs"] is None


@pytest.mark.parametrize("extra, loc, rule", [
    ({"tokens": 0}, "body.tokens", "greater_than_equal"),
    ({"tokens": 10**17}, "body.tokens", "less_than_equal"),
    ({"tokens": 1.5}, "body.tokens", "int_from_float"),
    ({"tokens": 1000, "price_per_gpu_hour": 0}, "body.price_per_gpu_hour", "greater_than"),
    ({"tokens": 1000, "price_per_gpu_hour": 1e6}, "body.price_per_gpu_hour", "less_than_equal"),
    ({"price_per_gpu_hour": 2.0}, "body", "price_needs_tokens"),
])
def test_http_plan_bad_values_are_422_naming_the_rule(client, alice, extra, loc, rule):
    r = client.post("/v1/plans", json={**PLAN, **extra}, headers=alice)
    assert r.status_code == 422
    (error,) = r.json()["errors"]
    assert (error["loc"], error["rule"]) == (loc, rule)


QUERY = {"model": "tiny-moe", "gpu": "cpu", "num_gpus": 4, "seq_length": 64, "global_batch_size": 8}


def _measured(app, job_id, step_time):
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, job_id, 0, {"tp": 1, "ep": 2}, runner_id="r", label="tp1 ep2")
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": step_time}, step_time_s=step_time)


def test_http_best_prices_the_measured_step(client, alice, job_body, app):
    job = client.post("/v1/jobs", json=job_body, headers=alice).json()
    _measured(app, job["id"], 0.25)
    # 8 x 64 = 512 tokens a step; 5,120 tokens = 10 steps x 0.25 s = 2.5 s on 4 GPUs = 10 GPU-seconds; at 3.6 USD
    # per GPU-hour (0.001 USD per GPU-second): 0.01 USD
    r = client.get("/v1/best", params={**QUERY, "tokens": 5120, "price_per_gpu_hour": 3.6}, headers=alice)
    run = r.json()["training_run"]
    assert (run["steps"], run["wall_s"], run["num_gpus"]) == (10, 2.5, 4)
    assert run["gpu_hours"] == pytest.approx(10 / 3600) and run["cost_usd"] == pytest.approx(0.01)
    by_signature = client.get("/v1/best", params={"signature": job["signature"], "tokens": 5120}, headers=alice)
    assert by_signature.json()["training_run"]["wall_s"] == 2.5
    assert client.get("/v1/best", params=QUERY, headers=alice).json()["training_run"] is None
    r = client.get("/v1/best", params={**QUERY, "price_per_gpu_hour": 3.6}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "price_needs_tokens"
    r = client.get("/v1/best", params={**QUERY, "tokens": 5120, "price_per_gpu_hour": "inf"}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == "query.price_per_gpu_hour"


def test_cli_best_prints_time_and_cost(capsys, server_url, keys, job_body, client, app):
    job = client.post("/v1/jobs", json=job_body, headers={"Authorization": f"Bearer {keys['alice']}"}).json()
    _measured(app, job["id"], 0.25)
    code, out, err = _cli(capsys, "best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--seq", "64",
                          "--gbs", "8", "--tokens", "5.12K", "--price-per-gpu-hour", "360",
                          "--url", server_url, "--api-key", keys["alice"])
    assert code == 0, err
    assert ("time and cost to train 5.12K tokens (5,120): 512 tokens per step, 10 steps on 4 GPUs, at 360 USD "
            "per GPU-hour") in out
    # 10 steps x 0.25 s = 2.5 s (0.000694 h) on 4 GPUs: 10 GPU-seconds (0.00278 GPU-hours) x 0.1 USD/GPU-s
    assert "wall time 0.0006944 h, 0.00278 GPU-hours, cost 1.00 USD" in out
