"""Router options through the API: a job or training body's router fields reach the ExecutorOptions the
worker builds (trials and trainings), a training from a job inherits the job's, and bad values are 422
problems naming the rule. SQLite and PostgreSQL (the ``client``/``app`` fixtures)."""

from __future__ import annotations

import pytest

from api.worker.runner import job_router, job_specs
from api.worker.trainings import training_inputs
from api.worker.trials import TrialExecutor, TrialSettings
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from db.models import Job, Training
from db.queue import claim_next_job
from db.trials import finish_trial, start_trial
from problem_rules import validation_rules

# DeepSeek-V3's routing on the tiny model: sigmoid scores, four groups of two experts
SIGMOID = {**get_model("tiny-moe").to_dict(), "name": "tiny-sigmoid", "moe_router_score_function": "sigmoid",
           "moe_router_num_groups": 4, "moe_router_group_topk": 2}
ROUTER = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01,
          "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4}


def _trial_options(app, job_id):
    with app.state.sessions() as s:
        job = s.get(Job, job_id)
        model, training, cluster = job_specs(job)
        return TrialExecutor(model, training, cluster, TrialSettings(), None, job_router(job)).options


def _training_options(app, training_id):
    with app.state.sessions() as s:
        return training_inputs(s.get(Training, training_id))[2]


def test_a_jobs_router_options_reach_its_trials(client, app, alice, job_body):
    plain = client.post("/v1/jobs", json=job_body, headers=alice).json()
    job = client.post("/v1/jobs", json={**job_body, "model": None, "model_spec": SIGMOID, **ROUTER},
                      headers=alice).json()
    options = _trial_options(app, job["id"])
    assert (options.moe_router_enable_expert_bias, options.moe_router_bias_update_rate) == (True, 0.01)
    assert (options.moe_router_load_balancing_type, options.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-4)
    assert job["training"]["router"] == ROUTER and "router" not in plain["training"]
    assert _trial_options(app, plain["id"]).moe_router_enable_expert_bias is False
    # with no choice, the model decides: sigmoid scoring gets the expert bias (DeepSeek-V3's recipe)
    default = client.post("/v1/jobs", json={**job_body, "model": None, "model_spec": SIGMOID}, headers=alice).json()
    assert _trial_options(app, default["id"]).moe_router_enable_expert_bias is True
    assert len({plain["signature"], job["signature"], default["signature"]}) == 3


def test_a_trainings_router_options_reach_the_training_loop(client, app, alice, training_body):
    body = {**training_body, "model": None, "model_spec": SIGMOID, **ROUTER}
    t = client.post("/v1/trainings", json=body, headers=alice).json()
    assert t["recipe"]["moe_router_enable_expert_bias"] is True
    options = _training_options(app, t["id"])
    assert (options.moe_router_enable_expert_bias, options.moe_router_bias_update_rate) == (True, 0.01)
    assert options.moe_router_load_balancing_type == "seq_aux_loss"
    plain = client.post("/v1/trainings", json=training_body, headers=alice).json()
    options = _training_options(app, plain["id"])  # the recipe's loss defaults, no bias on softmax scores
    assert (options.moe_aux_loss_coeff, options.moe_z_loss_coeff) == (1e-2, 1e-3)
    assert options.moe_router_enable_expert_bias is False


def test_a_training_from_a_job_keeps_the_jobs_router_options_unless_given(client, app, alice, job_body,
                                                                          training_body):
    job = client.post("/v1/jobs", json={**job_body, "model": None, "model_spec": SIGMOID, **ROUTER},
                      headers=alice).json()
    config = ParallelConfig.parse("tp1 ep2 mbs1", world_size=4)
    with app.state.sessions() as s:
        claim_next_job(s, "r1")
        trial = start_trial(s, job["id"], 0, config.to_dict(), runner_id="r1", label=config.label())
        finish_trial(s, trial.id, "succeeded", measurement={"step_time_s": 0.3}, step_time_s=0.3)
    from_job = {k: training_body[k] for k in ("data_path", "steps", "checkpoint_dir")}
    inherited = client.post("/v1/trainings", json={**from_job, "job_id": job["id"]}, headers=alice).json()
    options = _training_options(app, inherited["id"])
    assert (options.moe_router_bias_update_rate, options.moe_aux_loss_coeff) == (0.01, 1e-4)
    changed = client.post("/v1/trainings", json={**from_job, "job_id": job["id"], "moe_router_bias_update_rate": 0.5},
                          headers=alice).json()
    assert _training_options(app, changed["id"]).moe_router_bias_update_rate == 0.5


@pytest.mark.parametrize("field, value, rule", [
    ("moe_router_bias_update_rate", 1.5, "less_than_equal"),
    ("moe_router_bias_update_rate", -0.1, "greater_than_equal"),
    ("moe_aux_loss_coeff", 101, "less_than_equal"),
    ("moe_z_loss_coeff", -1, "greater_than_equal"),
    ("moe_router_load_balancing_type", "sinkhorn", "literal_error"),
    ("moe_token_drop_policy", "random", "literal_error"),
])
def test_bad_router_values_are_named_problems(client, alice, job_body, training_body, field, value, rule):
    assert (f"body.{field}", rule) in validation_rules(client.post("/v1/jobs", json={**job_body, field: value}, headers=alice))
    assert (f"body.{field}", rule) in validation_rules(
        client.post("/v1/trainings", json={**training_body, field: value}, headers=alice))


def test_expert_bias_on_softmax_scores_is_refused(client, alice, job_body, training_body):
    bias = {"moe_router_enable_expert_bias": True}
    rule = ("body.moe_router_enable_expert_bias", "expert_bias_needs_sigmoid")
    assert rule in validation_rules(client.post("/v1/jobs", json={**job_body, **bias}, headers=alice))
    assert rule in validation_rules(client.post("/v1/trainings", json={**training_body, **bias}, headers=alice))
