"""``foldtune calibrate --ray`` on a multi-node Ray cluster, simulated on this machine: ``ray.cluster_utils.Cluster``
with two worker nodes of 2 CPUs and 2 units of ``fake_gpu`` (the rank resource standing in for GPUs), gloo ranks.
The ranks land on both nodes, time the collectives of one rank per node, and the saved profile carries the
measured NIC-stage curves; a cluster too small for the ranks is one error line. What stays simulated: both
"nodes" share this host, so the 'inter' curves time loopback sockets, not a NIC."""

from __future__ import annotations

import json

import pytest
from runner_env import simulated_ray_cluster

from api.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster]


@pytest.fixture(scope="module")
def cluster():
    with simulated_ray_cluster(nodes=2, slots=2) as sim:
        yield sim


@pytest.fixture
def minimal_sweeps(monkeypatch):
    """``calibrate --quick`` with the plan's ``minimal`` sweeps (the two smallest sizes of each, no overlap run;
    tests/executor/test_calibrate_across_nodes.py measures with the same plan): what this file checks is the
    command's path over Ray nodes and the NIC stage it measures, not the sweeps --quick keeps
    (tests/executor/test_microbench.py times those)."""
    import functools

    from executor.microbench import runner

    monkeypatch.setattr(runner, "BenchPlan", functools.partial(runner.BenchPlan, minimal=True))


def test_calibrate_over_two_ray_nodes_measures_the_nic_stage(cluster, tmp_path, capsys, minimal_sweeps):
    out = tmp_path / "two-nodes.json"
    assert main(["calibrate", "--ray", "--ray-address", cluster.address, "--gpu", "cpu", "--gpus", "4",
                 "--gpus-per-node", "2", "--quick", "--precision", "fp32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 CPU rank(s), gloo over Ray: 2 node(s) x 2" in printed
    assert "ranks ran on 2 node(s); network (NIC stage): measured" in printed
    stored = json.loads(out.read_text())
    assert len(stored["raw"]["nodes"]) == 2
    assert any(r["scope"] == "inter" and r["group_size"] == 2 for r in stored["raw"]["collectives"])
    curves = stored["profile"]["collective_efficiency"]
    assert any(key.endswith(":inter") for key in curves)
    assert "across 2 nodes" in stored["profile"]["network_source"]


def test_a_cluster_too_small_for_the_ranks_is_one_error_line(cluster, tmp_path, capsys):
    assert main(["calibrate", "--ray", "--ray-address", cluster.address, "--gpu", "cpu", "--gpus", "6",
                 "--gpus-per-node", "2", "--quick", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 3 Ray node(s) with 2 fake_gpu each; the cluster has 2 of 2" in err[0]
    assert main(["calibrate", "--ray", "--ray-address", cluster.address, "--gpu", "cpu", "--gpus", "3",
                 "--gpus-per-node", "2", "--quick", "--out", str(tmp_path / "x.json")]) == 2
    assert "must be a multiple of the ranks per node (2)" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_ray_arguments_are_checked_before_ray_starts(capsys):
    assert main(["calibrate", "--gpus-per-node", "2", "--gpu", "cpu"]) == 2
    assert "need --ray" in capsys.readouterr().err
    assert main(["calibrate", "--ray", "--gpu", "cpu"]) == 2
    assert "--ray needs --gpus" in capsys.readouterr().err
    assert main(["calibrate", "--ray", "--gpus", "2", "--gpu", "cpu", "--model", "tiny-moe", "--seq", "64"]) == 2
    assert "run it without --ray" in capsys.readouterr().err
