"""Calibration whose ranks span nodes: the collectives of one rank per node (the NIC stage) are timed and become
the profile's 'inter' curves. The nodes come from the launcher (executor/node.py): here a local launch whose
ranks 0-1 and 2-3 are told they sit on two nodes, as Ray's actors are told their Ray node id."""

from __future__ import annotations

import os

import pytest

from costmodel.calibrate.profile_builder import build_profile
from executor.launch_local import launch
from executor.microbench.runner import BenchPlan, run_benchmarks
from executor.node import NODE_ENV, node_name
from spec.catalog import get_hardware
from spec.errors import FoldtuneError

PLAN = BenchPlan(precision="fp32", quick=True, minimal=True, sustained_s=0)


def test_the_node_is_the_launcher_s_name_else_the_host(monkeypatch):
    monkeypatch.setenv(NODE_ENV, "ray-node-7")
    assert node_name() == "ray-node-7"
    monkeypatch.delenv(NODE_ENV)
    assert node_name() == os.uname().nodename


def _on_two_nodes(rank: int, world_size: int, fn, *args):
    os.environ[NODE_ENV] = f"node{rank // 2}"
    return fn(rank, world_size, *args)


def _two_node_launcher(fn, world_size, args=(), **kwargs):
    return launch(_on_two_nodes, world_size, (fn, *args), **kwargs)


@pytest.mark.slow
def test_ranks_on_two_nodes_time_one_rank_per_node_and_price_the_nic_from_it():
    raw = run_benchmarks(4, PLAN, device="cpu", timeout_s=300, launcher=_two_node_launcher)
    assert raw["nodes"] == ["node0", "node1"] and raw["ranks"] == 4
    scopes = {(r["scope"], r["group_size"]) for r in raw["collectives"]}
    # contiguous pairs inside a node, one rank per node across both, the whole world spanning both
    assert ("intra", 2) in scopes and ("inter", 2) in scopes and ("mixed", 4) in scopes
    inter = {r["collective"] for r in raw["collectives"] if r["scope"] == "inter"}
    assert inter == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}  # no p2p across the NIC stage
    profile = build_profile(get_hardware("cpu"), raw, "two-nodes")
    keys = {key for key, _ in profile.collective_efficiency}
    assert {"all_gather:inter", "all_to_all:inter"} <= keys
    assert profile.network_source.startswith("measured") and "across 2 nodes" in profile.network_source


def test_a_cluster_launcher_needs_the_device_named():
    with pytest.raises(FoldtuneError, match="needs device 'cuda' or 'cpu'"):
        run_benchmarks(4, PLAN, device="auto", launcher=_two_node_launcher)
