"""The network between nodes in the hardware profile: which calibration rows price it, its label, and the
groups of one rank per node the calibration times when its ranks span nodes."""

from __future__ import annotations

import pytest

from costmodel.calibrate.profile_builder import build_profile
from costmodel.comm import link_rates
from executor.microbench.collectives import _scope, inter_node_groups
from spec import get_hardware
from spec.hardware import HardwareProfile

H100 = get_hardware("h100-sxm")


def test_groups_of_one_rank_per_node():
    hosts = ["a", "a", "a", "a", "b", "b", "b", "b"]
    assert inter_node_groups(hosts) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert inter_node_groups(["a"] * 4) == []  # one node: nothing crosses
    assert inter_node_groups(["a", "a", "b"]) == []  # unequal nodes: no clean NIC stage
    assert _scope([0, 1], hosts) == "intra" and _scope([0, 4], hosts) == "inter"
    assert _scope([0, 1, 2, 3, 4, 5, 6, 7], hosts) == "mixed"


def _raw(rows):
    return {"device_name": "gpu", "ranks": 16, "gemm": [], "grouped_gemm": [], "copy": [], "collectives": rows,
            "launch": {}, "precision": "bf16", "backend": "nccl", "measured_at": "2026-11-26T23:00:00+00:00"}


def test_inter_rows_fill_the_network_curves_and_label_intra_rows_nvlink_and_mixed_none():
    # all-gather of 64 MiB over 2 nodes (one rank each): wire 32 MiB in 1 ms = 33.6 GB/s of the NIC's 50
    inter = {"collective": "all_gather", "group_size": 2, "bytes": 64 * 2**20, "seconds": 1e-3, "scope": "inter"}
    intra = {"collective": "all_gather", "group_size": 2, "bytes": 64 * 2**20, "seconds": 1e-4, "scope": "intra"}
    mixed = {"collective": "all_reduce", "group_size": 16, "bytes": 64 * 2**20, "seconds": 9e-3, "scope": "mixed"}
    profile = build_profile(H100, _raw([inter, intra, mixed]), "two-nodes")
    curves = dict(profile.collective_efficiency)
    assert curves["all_gather:inter"](64 * 2**20) == pytest.approx(32 * 2**20 / 1e-3 / 50e9)
    assert curves["all_gather:intra"](64 * 2**20) == pytest.approx(32 * 2**20 / 1e-4 / 450e9)
    assert not any(k.startswith("all_reduce") for k in curves)  # a hierarchical composite gives no curve
    assert profile.network_source.startswith("measured 2026-11-26T23:00:00+00:00 across 2 nodes")
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
    eff, measured = link_rates(profile).efficiency("all_gather", "inter", 64 * 2**20)
    assert measured and eff == pytest.approx(32 * 2**20 / 1e-3 / 50e9)
    # a one-node calibration (rows without a scope are intra, as before) keeps the datasheet's network
    one_node = build_profile(H100, _raw([{k: v for k, v in intra.items() if k != "scope"}]))
    assert "all_gather:inter" not in dict(one_node.collective_efficiency)
    assert one_node.network_source == H100.network_source and "not measured here" in one_node.network_source
