"""CUDA graphs (``cuda_graphs``) at the front doors: the label token through `foldtune plan --explain` (accepted on
GPUs, refused by name on CPU ranks and with full recompute), Megatron's flags, `foldtune profile`'s --cuda-graphs
switch and POST /v1/trainings and /v1/plans."""

from __future__ import annotations

import json

from api.cli.main import main
from problem_rules import validation_rules

TINY_H100 = ["plan", "--model", "tiny-moe", "--gpus", "1", "--gpu", "h100-sxm", "--seq", "256", "--gbs", "8",
             "--json", "--top", "3"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_takes_the_token_and_names_the_rules(capsys):
    code, out, _ = run(capsys, TINY_H100 + ["--explain", "mbs1 cuda_graphs=on"])
    data = json.loads(out)
    assert code == 0 and data["valid"], data["rejections"]
    assert data["estimate"]["config"]["cuda_graphs"] is True and "cuda_graphs=on" in data["estimate"]["layout"]
    code, out, _ = run(capsys, TINY_H100 + ["--explain", "mbs1 recompute=full cuda_graphs=on"])
    assert [r["rule"] for r in json.loads(out)["rejections"]] == ["cuda_graphs_recompute"]
    cpu = ["plan", "--model", "tiny-moe", "--gpus", "1", "--gpu", "cpu", "--json", "--explain", "mbs1 cuda_graphs=on"]
    code, out, _ = run(capsys, cpu)
    assert [r["rule"] for r in json.loads(out)["rejections"]] == ["cuda_graphs_device"]


def test_explained_layout_exports_megatrons_graph_flags(capsys):
    code, out, _ = run(capsys, TINY_H100 + ["--explain", "mbs1 cuda_graphs=on", "--megatron-args"])
    args = " ".join(json.loads(out)["megatron_args"])
    assert code == 0 and "--cuda-graph-impl transformer_engine" in args and "--cuda-graph-scope attn moe_router" in args


def test_profile_switch_is_the_labels_knob_and_refused_on_cpu_ranks(capsys):
    code, _, err = run(capsys, ["profile", "--model", "tiny-moe", "--gpu", "cpu", "--cuda-graphs"])
    assert code != 0 and "[cuda_graphs_device]" in err
    code, _, err = run(capsys, ["profile", "--model", "tiny-moe", "--gpu", "cpu", "--layout", "dp1",
                                "--cuda-graphs"])
    assert code != 0 and "--cuda-graphs" in err and "label" in err


def test_http_training_refuses_graphs_on_cpu_ranks(client, alice, training_body):
    body = {**training_body, "layout": "tp1 ep2 dp2 mbs1 cuda_graphs=on"}
    assert ("body.layout", "cuda_graphs_device") in validation_rules(
        client.post("/v1/trainings", json=body, headers=alice))
    body["layout"] = "tp1 ep2 dp2 mbs1 cuda_graphs=maybe"
    assert ("body.layout", "layout_parses") in validation_rules(client.post("/v1/trainings", json=body, headers=alice))


def test_http_plan_ranks_graphed_layouts_on_gpus_only(client, alice):
    plan = {"model": "tiny-moe", "training": {"seq_length": 256, "global_batch_size": 8},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 1}, "top": 5}
    r = client.post("/v1/plans", json=plan, headers=alice)
    assert r.status_code == 200, r.text
    ranked = r.json()["ranked"]
    assert ranked[0]["config"]["cuda_graphs"] and "cuda_graphs=on" in ranked[0]["layout"] and ranked[0]["executable"]
    cpu = {**plan, "training": {"seq_length": 64, "global_batch_size": 8}, "cluster": {"gpu": "cpu", "num_gpus": 1}}
    r = client.post("/v1/plans", json=cpu, headers=alice)
    assert r.status_code == 200, r.text
    assert not any(e["config"]["cuda_graphs"] for e in r.json()["ranked"])


def test_plan_tries_graphs_on_gpus_unless_told_not_to(capsys):
    plan = ["plan", "--model", "tiny-moe", "--gpus", "1", "--gpu", "h100-sxm", "--seq", "256", "--gbs", "8", "--json",
            "--top", "3"]
    code, out, _ = run(capsys, plan)
    assert code == 0 and json.loads(out)["ranked"][0]["config"]["cuda_graphs"]
    code, out, _ = run(capsys, plan + ["--no-cuda-graphs"])
    assert code == 0 and not any(e["config"]["cuda_graphs"] for e in json.loads(out)["ranked"])
