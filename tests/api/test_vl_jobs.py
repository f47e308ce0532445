"""A tuning job of a vision-language MoE model over HTTP: submitted with its images per sample, searched over
multimodal layouts (homogeneous and colocated placements; separate on three ranks) by real trials on CPU ranks
through Ray, its trials
stored with their multimodal labels (which read back to the layout measured); bad input refused by rule. On
SQLite and PostgreSQL (the ``db_kind`` fixture)."""

from __future__ import annotations

import copy

import pytest
from runner_env import session_ray, submit_and_run, wait_no_rank_actors

from spec.multimodal_layout import MultimodalLayout

VL_JOB = {"model": "tiny-vl-moe", "training": {"seq_length": 32, "global_batch_size": 4, "precision": "fp32"},
          "images": {"images_per_sample": 2, "image_height": 8, "image_width": 16},
          "cluster": {"gpu": "cpu", "num_gpus": 2}, "budget": {"max_trials": 2, "max_seconds": 900}}


def _rule(response) -> tuple[str, str]:
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    return error["loc"], error["rule"]


def test_a_vl_job_is_stored_with_its_model_and_images(client, alice):
    response = client.post("/v1/jobs", json=VL_JOB, headers=alice)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["model"] == "tiny-vl-moe" and job["model_spec"]["vision"]["num_layers"] > 0
    assert job["training"]["images"] == {"images_per_sample": 2, "image_height": 8, "image_width": 16}
    other = copy.deepcopy(VL_JOB)
    other["images"]["images_per_sample"] = 1  # another question: another signature
    assert client.post("/v1/jobs", json=other, headers=alice).json()["signature"] != job["signature"]


@pytest.mark.parametrize("mutate, loc, rule", [
    (lambda b: b.update(model="tiny-moe"), "body.images", "images_need_encoder"),
    (lambda b: b.pop("images"), "body.images", "vl_needs_images"),
    (lambda b: b["images"].update(image_height=12), "body.images", "image_grid"),
    (lambda b: b["images"].update(images_per_sample=16), "body.images", "image_tokens_seq"),
    (lambda b: b.update(proxy="tiny"), "body.proxy", "vl_text_only_option"),
    (lambda b: b.update(search_precision=True), "body.search_precision", "vl_text_only_option"),
])
def test_bad_vl_input_names_the_rule(client, alice, mutate, loc, rule):
    body = copy.deepcopy(VL_JOB)
    mutate(body)
    assert _rule(client.post("/v1/jobs", json=body, headers=alice)) == (loc, rule)


@pytest.mark.parametrize("gpus, placements", [(2, {"homogeneous", "colocated", "separate"}), (3, {"separate"})])
def test_the_runner_s_candidates_include_separate_layouts(gpus, placements):
    """Every placement the executor runs is a candidate; on 3 ranks (no LLM layout of a batch of 4 on all
    three) the separate ones are the only ones."""
    from api.service.jobs import resolve_cluster
    from planner.multimodal import runnable_multimodal
    from spec.multimodal import ImageInputs
    from spec.training_spec import TrainingSpec
    from spec.vl_catalog import get_vl_model

    result = runnable_multimodal(get_vl_model("tiny-vl-moe"), TrainingSpec.from_dict(VL_JOB["training"]),
                                 ImageInputs(**VL_JOB["images"]), resolve_cluster(None, "cpu", gpus), keep=1000)
    assert {e.layout.placement for e in result.runnable} == placements
    assert all(e.layout.world_size == gpus for e in result.runnable)


@pytest.mark.slow
def test_http_vl_job_measures_multimodal_layouts_on_cpu_ranks(client, alice, db_url):
    session_ray()
    job = submit_and_run(client, copy.deepcopy(VL_JOB), alice, db_url)
    assert job["status"] == "succeeded", job["error"]
    trials = client.get(f"/v1/jobs/{job['id']}/trials", headers=alice, params={"limit": 50}).json()["items"]
    # two trials: the sampler's first proposals are the fastest predictions, one homogeneous and one colocated
    assert len(trials) == 2 and len({t["label"] for t in trials}) == 2
    done = [t for t in trials if t["status"] == "succeeded"]
    assert done, [t["failure_reason"] for t in trials]
    placements = set()
    for t in trials:  # the label and the stored config are the same multimodal layout
        layout = MultimodalLayout.parse(t["label"], 2)
        assert MultimodalLayout.from_dict(t["config"]) == layout and layout.label() == t["label"]
        assert t["predicted"]["placement"] == layout.placement and t["predicted"]["terms_s"]
        placements.add(layout.placement)
    assert placements == {"homogeneous", "colocated"}  # heterogeneous and homogeneous layouts both measured
    for t in done:
        m = t["measurement"]
        assert m["ok"] and m["layout"] == t["label"] and m["world_size"] == 2 and m["losses"][0] > 0
    assert job["calibration"]["best_layout"] == job["best_trial"]["label"]
    assert MultimodalLayout.parse(job["best_trial"]["label"], 2).placement in placements
    assert wait_no_rank_actors() == []


@pytest.mark.slow
def test_http_vl_job_on_three_ranks_measures_separate_layouts(client, alice, db_url):
    """Three CPU ranks hold no LLM layout of a batch of 4 (dp 3 does not split it): every candidate puts the
    encoder on a rank of its own beside a two-rank LLM, and the trials run there, the world sized 3."""
    session_ray()
    body = copy.deepcopy(VL_JOB)
    body["cluster"]["num_gpus"], body["budget"]["max_trials"] = 3, 1
    job = submit_and_run(client, body, alice, db_url)
    assert job["status"] == "succeeded", job["error"]
    trials = client.get(f"/v1/jobs/{job['id']}/trials", headers=alice, params={"limit": 50}).json()["items"]
    assert len(trials) == 1
    for t in trials:
        layout = MultimodalLayout.parse(t["label"], 3)
        assert layout.placement == "separate" and layout.llm.world_size == 2 and layout.encoder_world == 1
        assert MultimodalLayout.from_dict(t["config"]) == layout
    done = [t for t in trials if t["status"] == "succeeded"]
    assert done, [t["failure_reason"] for t in trials]
    for t in done:
        m = t["measurement"]
        assert m["ok"] and m["world_size"] == 3 and m["losses"][0] > 0
    assert MultimodalLayout.parse(job["best_trial"]["label"], 3).placement == "separate"
    assert wait_no_rank_actors() == []


def _measured(db_url, job_id: int, label: str, step_time_s: float = 0.5) -> None:
    """The job claimed and one trial of ``label`` measured (as a runner records it)."""
    from db.engine import make_engine, make_sessionmaker
    from db.queue import claim_job
    from db.trials import finish_trial, start_trial

    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            assert claim_job(session, job_id, "r") is not None
            layout = MultimodalLayout.parse(label, 2)
            trial = start_trial(session, job_id, 0, layout.to_dict(), runner_id="r", label=layout.label())
            assert finish_trial(session, trial.id, "succeeded", step_time_s=step_time_s,
                                measurement={"ok": True, "step_time": step_time_s})
    finally:
        engine.dispose()


def test_megatron_args_of_a_separate_encoder_layout(client, alice, db_url):
    job_id = client.post("/v1/jobs", json=VL_JOB, headers=alice).json()["id"]
    _measured(db_url, job_id, "dp1 placement=separate enc_tp1 enc_dp1")
    r = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=alice)
    assert r.status_code == 200, r.text
    args = {flag[0]: flag[1:] for flag in r.json()["args"]}
    assert args["--encoder-pipeline-model-parallel-size"] == ["1"]
    assert args["--encoder-tensor-model-parallel-size"] == ["1"]
    assert args["--img-h"] == ["8"] and args["--img-w"] == ["16"] and args["--patch-dim"] == ["4"]
    assert args["--tensor-model-parallel-size"] == ["1"] and "--encoder-pipeline-model-parallel-size 1" in r.json()["text"]


def test_megatron_refuses_a_colocated_encoder_naming_what_it_lacks(client, alice, db_url):
    job_id = client.post("/v1/jobs", json=VL_JOB, headers=alice).json()["id"]
    _measured(db_url, job_id, "dp2 placement=colocated enc_tp2")
    r = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=alice)
    assert _rule(r) == ("path.job_id", "megatron_multimodal")
    assert "no colocated encoder" in r.json()["detail"]
