"""Router flags on the CLI: the same flags on profile, train, tune and submit, read into RouterOptions (train
over the recipe's loss defaults), sent in API bodies (submit, train --job), bounds as one-line errors."""

from __future__ import annotations

import json

import pytest

from api.cli._router_args import router_body_from, router_options_from
from api.cli.main import build_parser, main
from api.cli.train_job import training_request
from api.worker.runner import job_router, job_specs
from api.worker.trials import TrialExecutor, TrialSettings
from spec.catalog import get_model
from spec.recipe import DEFAULT_RECIPE
from spec.router_options import RouterOptions
from db.models import Job

FLAGS = ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
         "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"]
COMMANDS = {
    "profile": ["profile", "--model", "tiny-moe"],
    "train": ["train", "--data", "/tmp/d", "--model", "tiny-moe", "--steps", "1"],
    "tune": ["tune"],
    "submit": ["submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "2", "--seq", "64", "--gbs", "4"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reads_the_same_router_flags(command):
    args = build_parser().parse_args(COMMANDS[command] + FLAGS)
    want = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01,
            "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4}
    assert router_body_from(args) == want
    assert router_options_from(args) == RouterOptions(**want)
    none = build_parser().parse_args(COMMANDS[command] + ["--no-moe-router-enable-expert-bias"])
    assert router_body_from(none) == {"moe_router_enable_expert_bias": False}


def test_train_starts_from_the_recipes_loss_coefficients():
    args = build_parser().parse_args(COMMANDS["train"] + ["--moe-z-loss-coeff", "0"])
    router = router_options_from(args, DEFAULT_RECIPE.router_defaults())
    assert (router.moe_aux_loss_coeff, router.moe_z_loss_coeff) == (DEFAULT_RECIPE.moe_aux_loss_coeff, 0.0)


def test_train_job_sends_the_router_flags_in_the_training_body(tmp_path):
    args = build_parser().parse_args(["train", "--data", str(tmp_path), "--job", "3", "--steps", "5", *FLAGS])
    request = training_request(args, str(tmp_path / "ckpt"))
    assert request.given_router_options()["moe_router_bias_update_rate"] == 0.01
    assert request.recipe()["moe_router_load_balancing_type"] == "seq_aux_loss"


@pytest.mark.parametrize("argv, field", [
    (COMMANDS["profile"] + ["--moe-router-bias-update-rate", "2"], "moe_router_bias_update_rate"),
    (COMMANDS["train"] + ["--moe-z-loss-coeff", "-1"], "moe_z_loss_coeff"),
])
def test_out_of_bounds_flags_are_one_line_errors(capsys, argv, field):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and field in err and "[0, " in err


def test_submit_sends_router_flags_that_reach_the_trials(capsys, server_url, keys, app, tmp_path):
    spec = {**get_model("tiny-moe").to_dict(), "name": "tiny-sigmoid", "moe_router_score_function": "sigmoid"}
    path = tmp_path / "tiny-sigmoid.json"
    path.write_text(json.dumps(spec))
    code = main(["submit", "--model-file", str(path), "--gpu", "cpu", "--gpus", "2", "--seq", "64", "--gbs", "4",
                 *FLAGS, "--url", server_url, "--api-key", keys["alice"]])
    assert code == 0, capsys.readouterr().err
    with app.state.sessions() as s:
        job = s.query(Job).one()
        options = TrialExecutor(*job_specs(job), TrialSettings(), None, job_router(job)).options
    assert (options.moe_router_enable_expert_bias, options.moe_router_bias_update_rate) == (True, 0.01)
    assert (options.moe_router_load_balancing_type, options.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-4)
