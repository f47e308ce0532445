"""The CLI agrees with itself: one meaning and default rule for --gpu/--seq/--gbs/--precision in every command,
the local API key, exports of the measured best (--format), trainings submit, --json and --version."""

from __future__ import annotations

import csv
import io
import json
import os
import stat

import pytest
import yaml

from api.cli._local_key import key_file, owner_of_local_key
from api.cli._shape_args import CPU_GBS, CPU_SEQ, PRECISIONS, resolve_shape
from api.cli.main import COMMANDS, build_parser, main
from db.queue import claim_next_job, finish_job
from db.trials import finish_trial, start_trial
from spec.errors import SpecError
from spec.parallel_config import ParallelConfig


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def _option(sub, flag):
    return next((a for a in sub._actions if flag in a.option_strings), None)


def test_every_command_shares_the_meaning_and_default_of_gpu_seq_gbs_and_precision():
    """An audit of every parser: the four flags default to "not given" (the shared rule decides), precision
    offers the same choices, and help texts say the same thing; a new command with its own default fails here."""
    subs = _subparsers()
    assert set(subs) == set(COMMANDS)
    seen = {flag: 0 for flag in ("--gpu", "--seq", "--gbs", "--precision")}
    for name, sub in subs.items():
        for flag in seen:
            action = _option(sub, flag)
            if action is None:
                continue
            seen[flag] += 1
            assert action.default is None, (name, flag, action.default)
            if flag == "--precision":
                assert tuple(action.choices) == PRECISIONS, name
                assert action.help.startswith("number format: bf16, fp16, fp8 or fp32"), name
                if name != "export-hf":  # the weights' format in the file; the training step's elsewhere
                    assert "default: fp32 with --gpu cpu, bf16 on GPUs" in action.help, name
            if flag == "--gpu":
                assert "cpu (CPU ranks with gloo" in action.help, name
    # plan, profile, submit, best, tune, trainings (and train's and calibrate's own) all carry them
    assert seen["--gpu"] >= 7 and seen["--precision"] >= 6 and seen["--seq"] >= 7 and seen["--gbs"] >= 7


def test_the_shared_rule_defaults_on_cpu_and_refuses_to_guess_on_gpus():
    parser = build_parser()
    args = parser.parse_args(["best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4"])
    shape = resolve_shape(args, "cpu", "best")
    assert (shape.seq, shape.gbs, shape.precision) == (CPU_SEQ, CPU_GBS, "fp32")  # what `tune` measures
    args = parser.parse_args(["best", "--model", "tiny-moe", "--gpu", "h100", "--gpus", "8", "--seq", "4096"])
    with pytest.raises(SpecError, match=r"give --gbs N \(sequences per step\)"):
        resolve_shape(args, "h100", "best")
    args = parser.parse_args(["best", "--model", "x", "--gpu", "h100", "--gpus", "8", "--seq", "9", "--gbs", "4"])
    assert resolve_shape(args, "h100", "best").precision == "bf16"


@pytest.mark.parametrize("argv, says", [
    (["submit", "--model", "tiny-moe", "--gpus", "4", "--api-key", "k"], "give --gpu NAME"),
    (["submit", "--model", "tiny-moe", "--gpus", "8", "--gpu", "h100", "--api-key", "k"], "give --seq N"),
    (["best", "--model", "tiny-moe", "--gpus", "4", "--api-key", "k"], "give --gpu NAME"),
    (["profile", "--model", "tiny-moe", "--layout", "tp2 bogus"], "valid tokens: tpN, cpN"),
    (["profile", "--model", "tiny-moe", "--layout", "tp2", "--ep", "2"], "drop --ep"),
    (["trainings", "submit", "--job", "1", "--api-key", "k"], "needs --data, --steps, --checkpoint-dir"),
    (["trainings", "--steps", "3", "--api-key", "k"], "--steps belong to `foldtune trainings submit`"),
    (["jobs", "--format", "yaml", "--api-key", "k"], "need a job ID"),
])
def test_refusals_name_the_value_to_give(capsys, argv, says):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and err.startswith("foldtune: error: ") and err.count("\n") == 1 and says in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("foldtune 0.")


def test_the_local_key_is_created_once_private_and_used_by_the_api_client(app, tmp_path, monkeypatch):
    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path / "home"))
    monkeypatch.delenv("FOLDTUNE_API_KEY", raising=False)
    said = []
    with app.state.sessions() as session:
        first = owner_of_local_key(session, say=said.append)
    assert first.name == "local" and len(said) == 1 and str(key_file()) in said[0]
    assert stat.S_IMODE(os.stat(key_file()).st_mode) == 0o600
    with app.state.sessions() as session:
        assert owner_of_local_key(session, say=said.append).id == first.id and len(said) == 1  # reused, silent
    from api.cli._http import ApiClient

    args = build_parser().parse_args(["jobs"])
    assert ApiClient.from_args(args)._http.headers["Authorization"] == f"Bearer {key_file().read_text().strip()}"
    monkeypatch.setenv("FOLDTUNE_API_KEY", "ft_not-a-key-of-this-database")
    with app.state.sessions() as session, pytest.raises(SpecError, match="FOLDTUNE_API_KEY is not a key"):
        owner_of_local_key(session)


@pytest.fixture
def measured(app, keys, server_url, capsys):
    """Job 1 of alice (tiny-moe on 4 CPU ranks) with a measured best trial of layout tp2 ep2 (dp2 edp2)."""
    conn = ["--url", server_url, "--api-key", keys["alice"]]
    code, _, err = _cli(capsys, "submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--max-trials", "3",
                        *conn)
    assert code == 0, err
    config = ParallelConfig(world_size=4, tp=2, ep=2)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, 1, 0, config.to_dict(), runner_id="r", label=config.label(), predicted_step_time_s=0.2)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.25}, step_time_s=0.25)
        finish_job(s, 1, "r", "succeeded")  # finish_trial set the job's best trial
    return conn, config


def test_best_and_jobs_export_the_measured_best(capsys, measured):
    conn, config = measured
    best = ["best", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", *conn]  # seq/gbs/precision: the CPU rule
    code, out, err = _cli(capsys, *best, "--format", "megatron-args")
    assert code == 0, err
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in out  # TP needs it
    assert "--tensor-model-parallel-size 2" in out and "--expert-model-parallel-size 2" in out
    assert "--sequence-parallel" in out and "--seq-length 64" in out and "--global-batch-size 8" in out
    code, out, _ = _cli(capsys, *best, "--format", "yaml")
    record = yaml.safe_load(out)
    assert ParallelConfig.parse(record["layout"]) == config and record["measured_step_time_s"] == 0.25
    assert record["training"] == {"seq_length": 64, "global_batch_size": 8, "precision": "fp32"}
    assert record["megatron"]["environment"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    code, out, _ = _cli(capsys, "jobs", "1", "--format", "json", *conn)
    assert json.loads(out) == record  # jobs ID exports the same record
    code, out, _ = _cli(capsys, "jobs", "1", "--format", "csv", *conn)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 1 and rows[0]["layout"] == config.label() and rows[0]["tp"] == "2" and rows[0]["dp"] == "2"
    code, out, _ = _cli(capsys, "jobs", "--json", *conn)
    assert json.loads(out)["items"][0]["id"] == 1
    code, out, _ = _cli(capsys, "jobs", "1", "--json", *conn)
    assert [t["label"] for t in json.loads(out)["trial_list"]] == [config.label()]


def test_no_tp_or_cp_needs_no_environment(capsys, app, keys, server_url):
    conn = ["--url", server_url, "--api-key", keys["bob"]]
    assert _cli(capsys, "submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", *conn)[0] == 0
    config = ParallelConfig(world_size=4, ep=4)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, 1, 0, config.to_dict(), runner_id="r", label=config.label(), predicted_step_time_s=0.2)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.3}, step_time_s=0.3)
    code, out, err = _cli(capsys, "jobs", "1", "--format", "megatron-args", *conn)
    assert code == 0, err
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out and "--expert-model-parallel-size 4" in out


def test_trainings_submit_and_json(capsys, measured, training_body):
    conn, _ = measured
    code, out, err = _cli(capsys, "trainings", "submit", "--job", "1", "--data", training_body["data_path"],
                          "--steps", "5", "--checkpoint-dir", training_body["checkpoint_dir"], *conn)
    assert code == 0, err
    assert out.startswith("training 1 queued: tiny-moe with tp2 cp1 pp1 vpp1 ep2 etp1 dp2 edp2 mbs1 on 4xcpu")
    code, out, err = _cli(capsys, "trainings", "submit", "--layout", "tp1 ep2 dp2 mbs1", "--model", "tiny-moe",
                          "--gpu", "cpu", "--gpus", "2", "--data", training_body["data_path"], "--steps", "3",
                          "--checkpoint-dir", training_body["checkpoint_dir"] + "2", "--json", *conn)
    assert code == 0, err
    t = json.loads(out)
    assert t["id"] == 2 and t["training"]["seq_length"] == CPU_SEQ and t["training"]["global_batch_size"] == CPU_GBS
    code, out, _ = _cli(capsys, "trainings", "--json", *conn)
    assert [x["id"] for x in json.loads(out)["items"]] == [2, 1]
    code, out, _ = _cli(capsys, "trainings", "1", "--json", *conn)
    assert json.loads(out)["job_id"] == 1


def test_a_misspelled_catalog_field_or_model_suggests_the_closest_name(capsys, tmp_path):
    catalog = tmp_path / "cat.yaml"
    catalog.write_text("models:\n  my-moe:\n    num_layer: 2\n    hidden_size: 64\n")
    code, _, err = _cli(capsys, "--catalog", str(catalog), "plan", "--model", "my-moe", "--gpus", "1",
                        "--gpu", "cpu")
    assert code == 2 and "num_layer (did you mean 'num_layers'?)" in err and err.count("\n") == 1, err
    code, _, err = _cli(capsys, "plan", "--model", "qwen3-30b", "--gpus", "8", "--gpu", "cpu")
    assert code == 2 and "(did you mean 'qwen3-30b-a3b'?)" in err, err
