"""Megatron's pipeline placement options through `foldtune plan` and POST /v1/plans, and the executor's
filter of the searched knobs it does not build (EP overlap, mla_up_proj recompute)."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from planner.rank import plan
from planner.runnable import runnable_plan
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec
from spec.validity import check

QWEN = ["plan", "--model", "qwen3-235b-a22b", "--gpus", "256", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "1024"]
ACCOUNT = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_94_layers_on_pp32_vpp3_with_embedding_and_loss_accounted(capsys):
    explain = ["--explain", "tp2 pp32 vpp3 ep8", "--json", "--megatron-args"]
    code, out, _ = run(capsys, QWEN + explain)
    plain = json.loads(out)
    assert code == 1 and [r["rule"] for r in plain["rejections"]] == ["layers_pp"]
    code, out, _ = run(capsys, QWEN + explain + ACCOUNT)
    data = json.loads(out)
    assert data["valid"] and data["rejections"] == [] and data["estimate"]["step_time_s"] > 0
    assert data["estimate"]["layout"].endswith("pp_account=embedding+loss")
    argv = data["megatron_args"]
    assert "--account-for-embedding-in-pipeline-split" in argv and "--account-for-loss-in-pipeline-split" in argv
    assert argv[argv.index("--num-virtual-stages-per-pipeline-rank") + 1] == "3"


def test_plan_with_a_layout_string_fixes_pp_times_vpp(capsys):
    # tiny-moe has 2 layers: 4 chunks, the first holding only the embedding and the last only the loss
    argv = ["plan", "--model", "tiny-moe", "--gpus", "4", "--gpu", "cpu", "--seq", "64", "--gbs", "8", "--json",
            "--top", "50", "--pipeline-model-parallel-layout", "E|t|t|L"]
    code, out, _ = run(capsys, argv)
    data = json.loads(out)
    assert code == 0 and "vpp from the layout's 4 chunks" in data["search_space"]
    pps = {(e["config"]["pp"], e["config"]["vpp"]) for e in data["ranked"]}
    assert pps <= {(1, 4), (2, 2), (4, 1)} and {p for p, _ in pps} - {1}  # pp1 cannot interleave
    assert all(e["config"]["pipeline_layout"] == "E|t|t|L" for e in data["ranked"])


@pytest.mark.parametrize("extra,message", [
    (["--decoder-first-pipeline-num-layers", "2", "--account-for-loss-in-pipeline-split"], "exclude account_for"),
    (["--pipeline-model-parallel-layout", "E|tx|L"], "unknown symbol 'x'"),
    (["--vpp-max", "0"], "--vpp-max must be in 1..64"),
])
def test_bad_pipeline_options_are_one_error_line(capsys, extra, message):
    code, out, err = run(capsys, QWEN + extra)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 5}


def test_http_plan_takes_the_pipeline_options(client, alice):
    body = {**PLAN, "pipeline": {"account_for_embedding_in_pipeline_split": True,
                                 "account_for_loss_in_pipeline_split": True}, "vpp_max": 2}
    r = client.post("/v1/plans", json=body, headers=alice)
    assert r.status_code == 200, r.text
    ranked = r.json()["ranked"]
    assert ranked and all(e["config"]["account_for_loss_in_pipeline_split"] for e in ranked)
    bad = {**PLAN, "pipeline": {"pipeline_model_parallel_layout": "E|t|t|L", "decoder_first_pipeline_num_layers": 1}}
    r = client.post("/v1/plans", json=bad, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "pipeline_options"
    huge = {**PLAN, "pipeline": {"pipeline_model_parallel_layout": "E" + "t" * 5000 + "L"}}
    assert client.post("/v1/plans", json=huge, headers=alice).status_code == 422
    assert client.post("/v1/plans", json={**PLAN, "vpp_max": 65}, headers=alice).status_code == 422


def test_runnable_plan_never_ranks_the_knobs_the_executor_does_not_build():
    """`plan` prices and searches EP all-to-all overlap with any pp where Megatron runs it (vpp > 1 when pp > 1),
    and the executor runs it there too (combined 1F1B, executor/pipeline.py): a tuning job's candidates
    include the pipelined overlap, and never a layout the executor refuses."""
    model = get_model("tiny-moe-shared")  # 4 layers: pp2·vpp2 (which the overlap needs with a pipeline) fits
    training = TrainingSpec(seq_length=64, global_batch_size=8)
    cluster = ClusterSpec(get_hardware("cpu"), 4)
    ranked = plan(model, training, cluster, top=200).ranked
    assert any(e.config.overlap_moe_expert_parallel_comm and e.config.pp > 1 for e in ranked)
    result = runnable_plan(model, training, cluster, top=200)
    overlapped = [e.config for e in result.runnable if e.config.overlap_moe_expert_parallel_comm]
    assert any(c.pp > 1 and c.vpp > 1 for c in overlapped)
    assert all(not check(model, training, e.config) for e in result.runnable)
    assert not result.not_executable