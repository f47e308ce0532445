"""Tuning on a multi-node Ray cluster, simulated on this machine: ``ray.cluster_utils.Cluster`` with a head
without CPUs and two worker nodes of 2 CPUs and 2 units of ``fake_gpu`` each (the rank resource standing in
for GPUs, ``FOLDTUNE_RAY_RANK_RESOURCE``), gloo ranks.

- a tuning job whose trials span both nodes completes with real measurements, its planner told the
  cluster's shape by Ray, and the Ray node of every rank agrees with the planner's rank -> node map,
  group by group of each measured layout;
- a node removed mid-trial fails that trial with ``node_lost``, the trial beside it (on the other node, at
  the same time) succeeds, the job finishes and no actor or reservation is left.

The module shares one cluster; the node-loss test runs last because it removes a node. Any local Ray an
earlier test module started is shut down first; the simulated clusters' modules (marker ``ray_cluster``) run
after every other (tests/conftest.py), so that the session's local Ray starts once.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
from runner_env import TINY_JOB, make_runner, simulated_ray_cluster

from spec.parallel_config import ParallelConfig
from spec.rank_groups import FoldedGroups, node_of_rank, nodes_spanned

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster]

SLOTS = 2  # fake GPUs (and CPUs) per worker node


@pytest.fixture(scope="module")
def cluster():
    from executor import launch_ray

    # The head only runs the GCS; its fast health check declares a removed node dead within ~2 s.
    with simulated_ray_cluster(2, SLOTS, {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                                          "health_check_initial_delay_ms": 0}) as sim:
        launch_ray.attach_ray(sim.address)
        yield sim


def _job(client, alice, num_gpus: int, max_trials: int) -> int:
    body = copy.deepcopy(TINY_JOB)
    body["cluster"]["num_gpus"] = num_gpus
    body["budget"]["max_trials"] = max_trials
    submitted = client.post("/v1/jobs", json=body, headers=alice)
    assert submitted.status_code == 201, submitted.text
    return submitted.json()["id"]


def _trials(client, alice, job_id: int) -> list[dict]:
    items = client.get(f"/v1/jobs/{job_id}/trials", headers=alice, params={"limit": 50}).json()["items"]
    return sorted(items, key=lambda t: t["number"])


def _nothing_left(resource: str = "fake_gpu", timeout_s: float = 20.0) -> dict:
    """What is still reserved after ``timeout_s``: units of ``resource`` in use and live placement groups."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        used = ray.cluster_resources().get(resource, 0) - ray.available_resources().get(resource, 0)
        groups = [g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if (used == 0 and not groups) or time.monotonic() > deadline:
            return {"used": used, "groups": groups}
        time.sleep(0.2)


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_a_job_whose_trials_span_two_nodes_completes_with_ranks_where_the_planner_put_them(cluster, client, alice,
                                                                                          db_url):
    from executor import launch_ray

    shape = launch_ray.cluster_shape("fake_gpu")
    assert (shape.num_nodes, shape.slots_per_node) == (2, SLOTS)
    # one trial: its four ranks over both nodes check the rank -> node map and every group of its layout
    job_id = _job(client, alice, num_gpus=4, max_trials=1)
    runner = make_runner(db_url)
    try:
        assert runner.run_job_id(job_id) == "succeeded"
    finally:
        runner.close()
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    # the planner was told Ray's shape (2 per node, not the cpu profile's 64) and one trial fits at a time
    assert job["calibration"]["ray_cluster"] == {"resource": "fake_gpu", "nodes": 2, "slots_per_node": [2, 2],
                                                 "gpus_per_node": 2, "parallel_trials": 1}
    trials = _trials(client, alice, job_id)
    assert [t["status"] for t in trials] == ["succeeded"], [t["failure_reason"] for t in trials]
    for t in trials:
        m = t["measurement"]  # a real measurement of the training step, gloo across both nodes
        assert m["ok"] and m["world_size"] == 4 and m["step_time"] > 0 and m["losses"][0] > 0
        ray_node = [p["node"] for p in m["placement"]]
        assert len(set(ray_node)) == 2
        # two ranks share a Ray node exactly when the planner put them on one node ...
        for r in range(4):
            for s in range(4):
                assert (ray_node[r] == ray_node[s]) == (node_of_rank(r, SLOTS) == node_of_rank(s, SLOTS)), (r, s)
        # ... so every group of the measured layout spans as many Ray nodes as the cost model priced it for
        groups = FoldedGroups(ParallelConfig.from_dict(t["config"]))
        for name in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"):
            for group in groups.groups(name):
                assert len({ray_node[r] for r in group}) == nodes_spanned(group, SLOTS), (t["label"], name, group)
    assert _nothing_left() == {"used": 0, "groups": []}


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_a_node_removed_mid_trial_fails_that_trial_as_node_lost_and_the_job_finishes(cluster, client, alice,
                                                                                       db_url):
    import ray

    job_id = _job(client, alice, num_gpus=2, max_trials=2)
    removed: list[str] = []

    def remove_trial0_node() -> None:
        """Once trial 0 holds its node and trial 1 (beside it) is done, take trial 0's node away."""
        deadline = time.monotonic() + 240
        node = None
        while time.monotonic() < deadline and node is None:
            for g in ray.util.placement_group_table().values():
                # foldtune-job-<id>-trial-<number>-<6 hex> (executor/launch_ray.py)
                if g["name"].startswith(f"foldtune-job-{job_id}-trial-0-") and g["state"] == "CREATED":
                    node = g["bundles_to_node_id"][0]
            time.sleep(0.2)
        while time.monotonic() < deadline and not any(
                t["number"] == 1 and t["status"] == "succeeded" for t in _trials(client, alice, job_id)):
            time.sleep(0.5)
        for n in cluster.list_all_nodes():
            if n.node_id == node:
                cluster.remove_node(n, allow_graceful=False)
                removed.append(node)

    killer = threading.Thread(target=remove_trial0_node, daemon=True)
    killer.start()
    # trial 0's rank 0 hangs after its first timed step: only the node's removal can end it before its timeout
    runner = make_runner(db_url, faults="hang:rank=0:step=0:trial=0", timeout_s=300.0)
    try:
        status = runner.run_job_id(job_id)
    finally:
        runner.close()
    killer.join(10)
    assert removed, "trial 0's node was never found"
    assert status == "succeeded"
    lost, beside = _trials(client, alice, job_id)
    assert (lost["status"], lost["failure_kind"]) == ("failed", "node_lost")
    assert lost["failure_reason"].startswith("node lost: ") and removed[0][:12] in lost["failure_reason"]
    assert beside["status"] == "succeeded", beside["failure_reason"]
    # side by side on disjoint nodes: trial 1 ran on the other node while trial 0 held its own
    assert {p["node"] for p in beside["measurement"]["placement"]} != {removed[0]}
    start, end = beside["measurement"]["run_window"]
    assert lost["measurement"]["run_window"][0] < end
    assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["calibration"]["ray_cluster"]["parallel_trials"] == 2
    assert _nothing_left() == {"used": 0, "groups": []}
