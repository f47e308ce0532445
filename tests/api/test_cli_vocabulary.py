"""One argument vocabulary (api/cli/arguments.py): a walk over every command's parser, and the behaviours it
stands for: no prefix matching, renamed flags refused with their new name, the CLI and the service agreeing
on the default precision of a GPU type, ``profile`` taking every layout dimension, whole names in tables."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest
from test_cli_agrees import _cli

from api.cli import profile_cmd
from api.cli.arguments import FLAGS, Parser, retired_flags
from api.cli.main import COMMANDS, build_parser
from api.cli.plan_cmd import add_request_arguments
from db.queue import claim_next_job
from db.trials import finish_trial, start_trial
from spec.parallel_config import ParallelConfig
from spec.router_options import FIELDS as ROUTER_FIELDS

ROUTER_FLAGS = {f"--{name.replace('_', '-')}" for name in ROUTER_FIELDS} | {"--no-moe-router-enable-expert-bias"}


def _group_flags(add_group) -> set[str]:
    """The flags one shared function adds (a group several commands take whole)."""
    parser = Parser()
    add_group(parser)
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


# a plan request's flags: `plan` and `verify` take them from one function (api.cli.plan_cmd.add_request_arguments)
PLAN_REQUEST_FLAGS = _group_flags(add_request_arguments)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of ``foldtune``: the top one, each command's and each nested action's (``keys create``)."""
    found = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}".strip(), sub)

    walk("", build_parser())
    return found


def _options() -> dict[str, list[tuple[str, argparse.Action]]]:
    """Live flag -> [(parser name, action)] over every parser (retired flags, help and version left out)."""
    by_flag = defaultdict(list)
    for name, parser in _parsers().items():
        retired = retired_flags(parser)
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help", "--version") and option not in retired:
                    by_flag[option].append((name, action))
    return by_flag


def test_every_command_is_walked_and_no_parser_matches_prefixes():
    parsers = _parsers()
    assert set(COMMANDS) <= set(parsers) and {"keys create", "data prepare", "calibrate merge"} <= set(parsers)
    assert [name for name, p in parsers.items() if p.allow_abbrev] == []


def test_a_flag_of_the_vocabulary_has_its_one_dest_type_default_and_meaning_everywhere():
    checked = 0
    for flag, uses in _options().items():
        if flag not in FLAGS:
            continue
        spec = FLAGS[flag]
        for command, action in uses:
            where = f"foldtune {command} {flag}"
            assert action.dest == flag[2:].replace("-", "_"), where
            assert action.default == spec.default, where
            assert action.type is spec.type, where
            assert (tuple(action.choices) if action.choices else None) == spec.choices, where
            assert action.help.startswith(spec.meaning.removesuffix(")")), (where, action.help)  # a note joins its ()
            checked += 1
    assert checked > 100


def test_a_flag_in_two_commands_is_in_the_vocabulary_or_one_shared_group():
    """A flag two commands share has one definition: the vocabulary's, or a shared group's (one function each:
    the router options, a plan request)."""
    loose = {}
    for flag, uses in _options().items():
        commands = {command for command, _ in uses}
        if len(commands) > 1 and flag not in FLAGS and flag not in ROUTER_FLAGS | PLAN_REQUEST_FLAGS:
            loose[flag] = sorted(commands)
    assert loose == {}
    for flag in ROUTER_FLAGS:  # the same help in every command but for the default it names
        helps = {action.help.split(" (default")[0] for _, action in _options()[flag]}
        assert len(helps) == 1, (flag, helps)
    for flag in PLAN_REQUEST_FLAGS - set(FLAGS):  # one definition: the same help and default everywhere
        assert len({(action.help, repr(action.default)) for _, action in _options()[flag]}) == 1, flag


def test_no_two_flags_mean_one_thing():
    meanings = defaultdict(list)
    for flag, spec in FLAGS.items():
        meanings[spec.meaning].append(flag)
    assert [flags for flags in meanings.values() if len(flags) > 1] == []
    for flag, uses in _options().items():  # no alias: each action answers to one spelling (and its --no- form)
        for command, action in uses:
            assert len(action.option_strings) == 1 or isinstance(action, argparse.BooleanOptionalAction), \
                (command, action.option_strings)


def test_every_retired_flag_names_a_live_flag_of_its_command():
    found = 0
    for name, parser in _parsers().items():
        live = {o for a in parser._actions for o in a.option_strings} - set(retired_flags(parser))
        for old, new in retired_flags(parser).items():
            assert new in live, (name, old, new)
            assert old not in live
            found += 1
    assert found >= 12


@pytest.mark.parametrize("argv, says", [
    (["tune", "--trial-timeout", "30"], "--trial-timeout is now --timeout"),
    (["tune", "--steps", "2"], "--steps is now --timed-steps"),
    (["profile", "--model", "tiny-moe", "--warmup", "1"], "--warmup is now --untimed-steps"),
    (["train", "--data", "d", "--steps", "3", "--warmup", "1"], "--warmup is now --lr-warmup"),
    (["trainings", "submit", "--warmup", "1"], "--warmup is now --lr-warmup"),
    (["train", "--data", "d", "--steps", "3", "--device", "cpu"], "--device is now --gpu"),
    (["calibrate", "--ranks", "2"], "--ranks is now --gpus"),
    (["calibrate", "merge", "--components", "a,b"], "--components is now --component-runs"),
    (["export-hf", "ck", "--model", "tiny-moe", "--out", "o", "--dtype", "bfloat16"], "--dtype is now --precision"),
    (["submit", "--model", "tiny-moe", "--gpus", "2", "--aux-loss-coeff", "0.1"],
     "--aux-loss-coeff is now --moe-aux-loss-coeff"),
])
def test_a_renamed_flag_is_one_error_line_naming_the_new_one(capsys, argv, says):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and err.startswith(f"foldtune: error: {says}") and err.count("\n") == 1, err


def test_gpu_is_the_hardware_in_train_too_never_a_prefix_of_gpus(capsys):
    code, _, err = _cli(capsys, "train", "--data", "d", "--model", "tiny-moe", "--steps", "1", "--gpu", "2")
    assert code == 2 and "unknown GPU '2'" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--mbs-m", "2"], "unrecognized arguments: --mbs-m"),
    (["plan", "--mod", "tiny-moe", "--gpu", "cpu", "--gpus", "4"], "one of the arguments --model"),
    (["jobs", "--stat", "queued"], "invalid int value: 'queued'"),  # --stat is no flag; queued no job ID
])
def test_a_prefix_is_never_read_as_a_longer_flag(capsys, argv, says):
    with pytest.raises(SystemExit) as done:
        _cli(capsys, *argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_profile_takes_every_layout_dimension_as_a_flag():
    parser = build_parser()
    args = parser.parse_args(["profile", "--model", "tiny-moe", "--tp", "2", "--cp", "2", "--pp", "2", "--vpp", "2",
                              "--ep", "4", "--etp", "1", "--mbs", "2", "--dispatcher", "allgather"])
    config = profile_cmd._config(args)
    assert (config.tp, config.cp, config.pp, config.vpp, config.ep, config.etp) == (2, 2, 2, 2, 4, 1)
    assert config.world_size == 8 and config.micro_batch_size == 2
    assert config.moe_token_dispatcher_type == "allgather"
    same = profile_cmd._config(parser.parse_args(["profile", "--model", "tiny-moe", "--layout",
                                                  "tp2 cp2 pp2 vpp2 ep4 etp1 mbs2 dispatcher=allgather"]))
    assert same == config
    args = parser.parse_args(["profile", "--model", "tiny-moe", "--pp", "2", "--dp", "3"])
    assert profile_cmd._config(args).world_size == 6


def test_a_cpu_job_posted_without_a_precision_is_the_one_best_finds(capsys, client, alice, keys, server_url, app,
                                                                      job_body):
    """POST /v1/jobs on cpu without a precision stores what every CLI command defaults to there (fp32), so
    `foldtune best` with the CPU defaults finds it; a lookup that finds nothing names what it looked for."""
    job_body["training"] = {"seq_length": 64, "global_batch_size": 8}  # no precision: the shared default
    job = client.post("/v1/jobs", json=job_body, headers=alice).json()
    assert job["training"]["precision"] == "fp32", job
    conn = ["--url", server_url, "--api-key", keys["alice"]]
    best = ["best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", *conn]
    code, _, err = _cli(capsys, *best)
    assert code == 2 and err.count("\n") == 1
    assert "model tiny-moe on 4 x cpu, seq 64, global batch 8, fp32" in err, err
    config = ParallelConfig(world_size=4, tp=2, ep=2)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, job["id"], 0, config.to_dict(), runner_id="r", label=config.label(),
                        predicted_step_time_s=0.2)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.25}, step_time_s=0.25)
    code, out, err = _cli(capsys, *best)
    assert code == 0 and f"job {job['id']} trial 0" in out, err
    assert "0.25 s measured, 0.2 s predicted" in out  # durations in seconds, as everywhere
    served = client.get("/v1/best", params={"model": "tiny-moe", "gpu": "cpu", "num_gpus": 4, "seq_length": 64,
                                            "global_batch_size": 8}, headers=alice)
    assert served.status_code == 200 and served.json()["job_id"] == job["id"]  # the service's default: fp32 too
    h100 = client.post("/v1/jobs", json={**job_body, "cluster": {"gpu": "h100", "num_gpus": 8}}, headers=alice)
    assert h100.status_code == 201 and h100.json()["training"]["precision"] == "bf16"


def test_tables_print_whole_model_names_and_layouts(capsys, client, alice, keys, server_url, job_body):
    job_body["model"], job_body["proxy"] = "deepseek-v2-lite", "tiny"
    job_body["cluster"] = {"gpu": "cpu", "num_gpus": 2}
    created = client.post("/v1/jobs", json=job_body, headers=alice)
    assert created.status_code == 201, created.text
    name = created.json()["model"]
    assert len(name) > 20  # longer than the column once was
    code, out, err = _cli(capsys, "jobs", "--url", server_url, "--api-key", keys["alice"])
    assert code == 0 and name in out.splitlines()[1], err
    assert "BEST STEP (s)" in out.splitlines()[0]
