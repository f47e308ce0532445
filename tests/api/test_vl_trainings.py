"""A 20-step training of a vision-language MoE model over HTTP on CPU ranks: a small image+text set made here
(each sample one 16x16 image of one of four colours with pixel noise, then a caption naming the colour), the
tiny model under a colocated layout (the encoder tensor parallel over the LLM's two data-parallel ranks),
trained through the runner and the Ray launcher; its loss falls. Bad input is refused by rule."""

from __future__ import annotations

import pytest
import torch
from runner_env import make_runner, run_one_claim, session_ray, wait_no_rank_actors

from spec.multimodal_layout import MultimodalLayout
from spec.vl_catalog import get_vl_model
from executor.vlm.dataset import save_vl_dataset

SPEC = get_vl_model("tiny-vl-moe")
COLOURS = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
ANSWER = 10  # the token naming colour k is ANSWER + k
SEQ = 16
STEPS = 20  # the loss halves within about a dozen steps at this lr: 20 leave a margin
LAYOUT = "dp2 placement=colocated enc_tp2"


def colour_set(directory, samples: int = 160, heldout: int = 32) -> str:
    """BOS, the image's 4 tokens, a question token, then the colour's answer token to the end."""
    gen = torch.Generator().manual_seed(0)
    colours = torch.randint(0, 4, (samples,), generator=gen)
    images = COLOURS[colours][:, :, None, None] + 0.3 * torch.randn(samples, 3, 16, 16, generator=gen)
    ids = (ANSWER + colours)[:, None].repeat(1, SEQ)
    ids[:, 0], ids[:, 1:5], ids[:, 5] = 1, SPEC.image_token_id, 2
    save_vl_dataset(directory, ids, images[:, None], heldout)
    return str(directory)


@pytest.fixture
def vl_body(data_root):
    data = colour_set(data_root / "alice" / "vl-data")
    return {"layout": LAYOUT, "model": "tiny-vl-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": SEQ, "global_batch_size": 8, "data_path": data, "steps": STEPS, "checkpoint_dir": "ckpt",
            "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "weight_decay": 0.0, "eval_batches": 4}


def _rule(response) -> tuple[str, str]:
    assert response.status_code == 422, response.text
    return response.json()["errors"][0]["loc"], response.json()["errors"][0]["rule"]


def test_a_vl_training_is_stored_with_its_layout_and_images(client, alice, vl_body):
    r = client.post("/v1/trainings", json=vl_body, headers=alice)
    assert r.status_code == 201, r.text
    t = r.json()
    assert MultimodalLayout.parse(t["label"], 2) == MultimodalLayout.parse(LAYOUT, 2)
    assert t["config"]["placement"] == "colocated" and t["training"]["images"]["images_per_sample"] == 1
    assert t["predicted_step_time_s"] > 0


def test_a_separate_vl_training_is_priced_with_the_llm_on_its_share(client, alice, vl_body):
    from api.service.jobs import resolve_cluster
    from costmodel.estimate import estimate
    from costmodel.multimodal import estimate_multimodal
    from spec.hardware import ClusterSpec
    from spec.multimodal import ImageInputs
    from spec.training_spec import TrainingSpec

    label = "dp1 placement=separate enc_tp1 enc_dp1"
    r = client.post("/v1/trainings", json={**vl_body, "layout": label}, headers=alice)
    assert r.status_code == 201, r.text
    layout = MultimodalLayout.parse(label, 2)
    two = resolve_cluster(None, "cpu", 2)
    training = TrainingSpec.from_dict({k: v for k, v in r.json()["training"].items() if k != "images"})
    one = ClusterSpec(two.hardware, 1, two.hbm_reserved_bytes, two.min_headroom)  # the LLM's, beside the encoder's
    expected = estimate_multimodal(SPEC, training, ImageInputs(1, 16, 16), layout, two,
                                   estimate(SPEC.llm, training, one, layout.llm), one)
    assert r.json()["predicted_step_time_s"] == pytest.approx(expected.step_time)


@pytest.mark.parametrize("mutate, loc, rule", [
    (lambda b: b.update(model="tiny-moe"), "body.layout", "multimodal_label_needs_encoder"),
    (lambda b: b.update(layout="dp2 placement=colocated enc_tp4 enc_dp1"), "body.layout", "enc_world"),
    (lambda b: b.update(layout="pp2 placement=homogeneous"), "body.layout", "executor_vl_layout"),
    (lambda b: b.update(seq_length=32), "body.data_path", "vl_dataset"),
])
def test_bad_vl_training_input_names_the_rule(client, alice, vl_body, mutate, loc, rule):
    mutate(vl_body)
    assert _rule(client.post("/v1/trainings", json=vl_body, headers=alice)) == (loc, rule)


def test_a_text_dataset_is_no_vl_dataset(client, alice, vl_body, data_root):
    empty = data_root / "alice" / "text-data"
    empty.mkdir()
    vl_body["data_path"] = str(empty)
    assert _rule(client.post("/v1/trainings", json=vl_body, headers=alice)) == ("body.data_path", "vl_dataset")


@pytest.mark.slow
def test_http_vl_training_of_twenty_steps_lowers_the_loss(client, alice, db_url, data_root, vl_body):
    session_ray()
    r = client.post("/v1/trainings", json=vl_body, headers=alice)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    run_one_claim(db_url, data_root=data_root)
    t = client.get(f"/v1/trainings/{tid}", headers=alice).json()
    assert t["status"] == "succeeded", t["error"]
    items = client.get(f"/v1/trainings/{tid}/metrics", params={"limit": 200}, headers=alice).json()["items"]
    assert [m["step"] for m in items] == list(range(1, STEPS + 1))
    losses = [m["loss"] for m in items]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5  # the caption follows from the image
    assert items[-1]["eval_loss"] < 0.5 * losses[0]  # and so on held-out images
    assert wait_no_rank_actors() == []


def job_image_set(directory, samples: int = 24, heldout: int = 8) -> str:
    """Samples for test_vl_jobs.VL_JOB's question: 32 tokens, two 8x16 images (two tokens each) placed as the
    synthetic profiling batches place them, random text and pixels."""
    from executor.vlm.synthetic import image_token_layout

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 60, (samples, 32), generator=gen)
    ids[:, torch.tensor(image_token_layout([2, 2], 32))] = SPEC.image_token_id
    save_vl_dataset(directory, ids, torch.randn(samples, 2, 3, 8, 16, generator=gen), heldout)
    return str(directory)


def _from_job(client, alice, db_url, data_root, label: str, **extra) -> tuple[int, dict]:
    from test_vl_jobs import VL_JOB, _measured

    job_id = client.post("/v1/jobs", json=VL_JOB, headers=alice).json()["id"]
    _measured(db_url, job_id, label)
    data = job_image_set(data_root / "alice" / "job-data")
    return job_id, {"job_id": job_id, "data_path": data, "steps": 4, "checkpoint_dir": "ckpt", **extra}


def test_a_vl_jobs_best_trains_with_its_layout_and_images(client, alice, db_url, data_root):
    job_id, body = _from_job(client, alice, db_url, data_root, LAYOUT)
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["job_id"] == job_id and t["model"] == "tiny-vl-moe"
    assert MultimodalLayout.parse(t["label"], 2) == MultimodalLayout.parse(LAYOUT, 2)
    assert t["training"]["images"] == {"images_per_sample": 2, "image_height": 8, "image_width": 16}
    assert t["training"]["seq_length"] == 32 and t["training"]["global_batch_size"] == 4  # the job's


def test_a_vl_jobs_best_needs_the_jobs_images(client, alice, db_url, data_root, vl_body):
    _, body = _from_job(client, alice, db_url, data_root, LAYOUT)
    # the colour set: one 16x16 image per sample of 16 tokens, so seq_length is given to match it
    r = client.post("/v1/trainings", json={**body, "data_path": vl_body["data_path"], "seq_length": 16},
                    headers=alice)
    assert _rule(r) == ("body.data_path", "vl_job_images")


def _run(db_url, data_root, training_id: int) -> None:
    runner = make_runner(db_url, data_root=data_root)
    try:
        assert runner.run_training_id(training_id) is not None
    finally:
        runner.close()


@pytest.mark.slow
def test_http_training_from_a_separate_best_checkpoints_and_resumes(client, alice, db_url, data_root):
    """A job's best layout with the encoder on its own rank trains over HTTP through the Ray launcher (a world
    of two ranks), saving checkpoints; a second training with the same checkpoint directory resumes there."""
    session_ray()
    _, body = _from_job(client, alice, db_url, data_root, "dp1 placement=separate enc_tp1 enc_dp1",
                        checkpoint_every=2)
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    _run(db_url, data_root, tid)  # the training by id: the job stays claimed by its (test) runner
    t = client.get(f"/v1/trainings/{tid}", headers=alice).json()
    assert t["status"] == "succeeded", t["error"]
    items = client.get(f"/v1/trainings/{tid}/metrics", params={"limit": 50}, headers=alice).json()["items"]
    assert [m["step"] for m in items] == [1, 2, 3, 4] and all(m["grad_norm"] > 0 for m in items)
    ckpt = data_root / "alice" / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-00000004"
    r = client.post("/v1/trainings", json={**body, "steps": 6}, headers=alice)
    assert r.status_code == 201, r.text
    _run(db_url, data_root, r.json()["id"])
    again = client.get(f"/v1/trainings/{r.json()['id']}", headers=alice).json()
    assert again["status"] == "succeeded", again["error"]
    steps = client.get(f"/v1/trainings/{r.json()['id']}/metrics", params={"limit": 50}, headers=alice).json()
    assert [m["step"] for m in steps["items"]] == [5, 6]  # resumed after the fourth step
    assert wait_no_rank_actors() == []
