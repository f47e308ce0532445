"""A training submitted over HTTP runs through the runner and the Ray launcher: a tiny MoE trained for 10
steps on a small prepared dataset succeeds, its metrics series is served step by step, and its checkpoint
is written."""

from pathlib import Path

import pytest
from runner_env import make_runner, run_one_claim, session_ray, wait_no_rank_actors

from api.cli.main import main
from executor.dataset.prepare import prepare_dataset

STEPS = 10


@pytest.fixture
def dataset(data_root):
    docs = Path(__file__).resolve().parents[2] / "docs"
    return str(prepare_dataset([str(docs)], str(data_root / "alice" / "data"), heldout_fraction=0.1).path)


@pytest.mark.slow
def test_http_training_runs_through_the_runner_and_its_metrics_are_served(client, alice, keys, server_url, db_url,
                                                                          dataset, data_root, capsys):
    session_ray()
    body = {"layout": "tp1 ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": 32, "global_batch_size": 4, "data_path": dataset, "steps": STEPS,
            "checkpoint_dir": "ckpt", "warmup_steps": 2, "eval_batches": 1}
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    run_one_claim(db_url, data_root=data_root)  # a service runner: checks the paths again
    t = client.get(f"/v1/trainings/{tid}", headers=alice).json()
    assert t["status"] == "succeeded", t["error"]
    assert t["latest_metrics"]["step"] == STEPS and t["latest_metrics"]["eval_loss"] is not None
    page = client.get(f"/v1/trainings/{tid}/metrics", params={"limit": 200}, headers=alice).json()
    steps = [m["step"] for m in page["items"]]
    assert steps == list(range(1, STEPS + 1)) and page["next_after_step"] is None
    losses = [m["loss"] for m in page["items"]]
    assert all(m["tokens_per_s"] > 0 and m["lr"] > 0 for m in page["items"])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # 10 steps on real text already lower the loss
    assert any((data_root / "alice" / "ckpt").iterdir())  # the relative checkpoint_dir is in alice's directory
    assert wait_no_rank_actors() == []
    cli = ["--url", server_url, "--api-key", keys["alice"]]
    capsys.readouterr()
    assert main(["trainings", str(tid), "--wait", *cli]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out if line.startswith("step")] == [str(n) for n in range(1, STEPS + 1)]
    assert out[-1] == f"training {tid}: succeeded"
    assert main(["trainings", *cli]) == 0 and f"{STEPS}/{STEPS}" in capsys.readouterr().out
    assert main(["trainings", str(tid), "--cancel", *cli]) == 2
    assert "already succeeded" in capsys.readouterr().err


@pytest.mark.slow
def test_cancel_stops_a_running_training(client, alice, db_url, dataset):
    import threading
    import time

    session_ray()
    body = {"layout": "ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": 32, "global_batch_size": 4, "data_path": dataset, "steps": 100_000,
            "checkpoint_dir": "ckpt", "eval_batches": 1}
    tid = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    runner = make_runner(db_url)
    thread = threading.Thread(target=runner.run, kwargs={"once": True}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while (client.get(f"/v1/trainings/{tid}", headers=alice).json()["latest_metrics"] is None
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert client.post(f"/v1/trainings/{tid}/cancel", headers=alice).json()["status"] == "cancelled"
        thread.join(60)
        assert not thread.is_alive()
    finally:
        runner.stop()
        thread.join(10)
        runner.close()
    t = client.get(f"/v1/trainings/{tid}", headers=alice).json()
    assert t["status"] == "cancelled" and t["latest_metrics"]["step"] < 100_000
    assert wait_no_rank_actors() == []
