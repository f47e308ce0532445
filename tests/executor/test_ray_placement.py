"""The Ray launcher's placement arithmetic and settings, without a Ray cluster: node bundles in the planner's
rank order, how many trials fit side by side, the network settings forwarded to the ranks, the runner's
node boundary from Ray or its override."""

from __future__ import annotations

import pytest

from executor.launch_ray import ClusterShape, RayNode, forwarded_env, node_bundles
from spec.catalog import get_hardware
from spec.errors import SpecError
from spec.hardware import ClusterSpec
from spec.rank_groups import node_of_rank


def _shape(resource: str, *slots: int) -> ClusterShape:
    return ClusterShape(resource, tuple(RayNode(f"n{i}", "10.0.0.1", s) for i, s in enumerate(slots)))


def test_bundles_hold_the_ranks_the_planner_puts_on_each_node():
    assert node_bundles(8, 4) == [4, 4]
    assert node_bundles(2, 8) == [2]  # a world smaller than a node: one node
    assert node_bundles(6, 4) == [4, 2]
    # rank r's bundle is its planner node, and bundle b holds exactly the ranks of node b
    sizes = node_bundles(16, 8)
    for b, size in enumerate(sizes):
        assert [r for r in range(16) if node_of_rank(r, 8) == b] == list(range(b * 8, b * 8 + size))


@pytest.mark.parametrize(("slots", "world", "per_node", "trials"), [
    ((2, 2), 2, 2, 2),        # two 2-GPU trials, one per node
    ((2, 2), 1, 1, 4),        # four 1-GPU trials, never two on one GPU
    ((2, 2), 4, 2, 1),        # a trial spanning both nodes
    ((2, 2, 2), 4, 2, 1),     # the third node alone cannot hold another 2-node trial
    ((8, 8, 8, 8), 16, 8, 2),
    ((8, 4), 8, 8, 1),        # the small node holds no 8-rank bundle
    ((2,), 4, 2, 0),          # no room at all: the launcher explains why when the trial runs
])
def test_trials_side_by_side_on_devices(slots, world, per_node, trials):
    assert _shape("GPU", *slots).concurrent_trials(world, per_node) == trials


def test_cpu_trials_take_their_nodes_whole():
    # CPU ranks share their node's cores: one machine runs one CPU trial at a time, N machines run N
    assert _shape("CPU", 8).concurrent_trials(2, 8) == 1
    assert _shape("CPU", 8, 8, 8).concurrent_trials(2, 8) == 3
    assert _shape("CPU", 4, 4).concurrent_trials(8, 4) == 1
    assert _shape("fake_gpu", 8).concurrent_trials(2, 8) == 4  # a device-like resource is counted by its units


def test_network_settings_reach_the_ranks_and_nothing_else_does():
    env = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0", "HOME": "/root",
           "MY_SETTING": "1", "OTHER": "x", "FOLDTUNE_RANK_ENV": "MY_SETTING, MISSING"}
    assert forwarded_env(env) == {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0",
                                  "MY_SETTING": "1"}


def test_the_planner_node_boundary_comes_from_ray_unless_overridden():
    from api.worker.runner import RunnerSettings, cluster_on_ray

    h100 = get_hardware("h100-sxm")
    cluster = ClusterSpec(hardware=h100, num_gpus=8)
    assert cluster_on_ray(cluster, None) is cluster  # no Ray nodes of that kind: the profile's 8 stand
    on_ray = cluster_on_ray(cluster, 4)
    assert (on_ray.gpus_per_node, on_ray.num_nodes, on_ray.hardware.name) == (4, 2, "h100-sxm")
    with pytest.raises(SpecError, match=r"on this Ray cluster \(3 per node\).*multiple of gpus_per_node"):
        cluster_on_ray(cluster, 3)
    settings = RunnerSettings.from_env("sqlite:///x.db", "r", {"FOLDTUNE_GPUS_PER_NODE": "2"})
    assert settings.gpus_per_node == 2
    assert RunnerSettings.from_env("sqlite:///x.db", "r", {}).gpus_per_node is None
    with pytest.raises(SpecError, match="FOLDTUNE_GPUS_PER_NODE must be >= 1"):
        RunnerSettings.from_env("sqlite:///x.db", "r", {"FOLDTUNE_GPUS_PER_NODE": "0"})


class _Actor:
    """A rank actor handle whose ``last_step.remote()`` returns a ping token."""

    def __init__(self, rank: int) -> None:
        self.last_step = type("M", (), {"remote": staticmethod(lambda: f"ping{rank}")})()


def test_a_silent_rank_on_a_node_ray_then_declares_dead_is_a_lost_node(monkeypatch):
    from executor import launch_ray

    placement = [{"node": "A" * 40, "ip": "10.0.0.1", "gpus": []}, {"node": "B" * 40, "ip": "10.0.0.2", "gpus": []}]
    polls = []

    def wait(refs, num_returns, timeout):  # rank 1 never answers: its node vanished
        return [r for r in refs if r == "ping0"], [r for r in refs if r != "ping0"]

    def alive():  # Ray declares node B dead at its third look
        polls.append(1)
        return {"A" * 40} | ({"B" * 40} if len(polls) < 3 else set())

    monkeypatch.setattr(launch_ray.ray, "wait", wait)
    monkeypatch.setattr(launch_ray, "_alive_nodes", alive)
    actors = [_Actor(0), _Actor(1)]
    kind, reason = launch_ray._lost_node(actors, [0, 1], {}, placement)
    assert kind.value == "node_lost" and len(polls) == 3
    assert reason == "node lost: Ray node BBBBBBBBBBBB (10.0.0.2) holding rank 1 went away mid-run"
    # ranks that answer are alive: no wait for a verdict, and no lost node
    polls.clear()
    monkeypatch.setattr(launch_ray.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(launch_ray, "_alive_nodes", lambda: polls.append(1) or {"A" * 40, "B" * 40})
    assert launch_ray._lost_node(actors, [0, 1], {}, placement) is None and len(polls) == 1
    # a rank already known dead with its node settles it
    lost = {1: ("lost", "node lost: Ray node B", "")}
    assert launch_ray._lost_node(actors, [0], lost, placement) == (launch_ray.FailureKind.NODE_LOST,
                                                                      "node lost: Ray node B")


def test_the_job_start_line_says_what_ray_reported_and_what_the_planner_assumes():
    import io

    from api.cli.tune_cmd import TrialPrinter

    out = io.StringIO()
    TrialPrinter(out)("job_started", {
        "job_id": 3, "model": "tiny-moe", "gpus": 4, "gpu": "cpu", "max_trials": 2,
        "candidates": {"valid": 10, "fitting": 9, "searched": 8},
        "ray_cluster": {"resource": "fake_gpu", "nodes": 2, "slots_per_node": [2, 2], "gpus_per_node": 2,
                        "parallel_trials": 1}})
    assert out.getvalue().splitlines()[1] == ("  Ray: 2 node(s) with 2, 2 fake_gpu slot(s) each; the planner assumes "
                                              "2 per node; 1 trial(s) at a time")


def test_the_job_start_line_says_how_many_cores_a_local_rays_cpu_slots_share(monkeypatch):
    import io

    from api.cli import tune_cmd

    # a local Ray gets at least 8 CPU slots whatever the machine: the line says the cores the ranks share
    monkeypatch.delenv("FOLDTUNE_RAY_ADDRESS", raising=False)
    monkeypatch.setattr(tune_cmd, "cpu_cores", lambda: 2)
    event = {"job_id": 1, "model": "tiny-moe", "gpus": 4, "gpu": "cpu", "max_trials": 6,
             "candidates": {"valid": 10, "fitting": 9, "searched": 8},
             "ray_cluster": {"resource": "CPU", "nodes": 1, "slots_per_node": [8], "gpus_per_node": 4,
                             "parallel_trials": 1}}
    out = io.StringIO()
    tune_cmd.TrialPrinter(out)("job_started", event)
    assert out.getvalue().splitlines()[1] == ("  Ray: 1 node(s) with 8 CPU slot(s) each (2 cores on this machine, "
                                              "shared by the ranks); the planner assumes 4 per node; 1 trial(s) at a "
                                              "time")
    # a Ray cluster elsewhere: this machine's cores say nothing about its nodes
    monkeypatch.setenv("FOLDTUNE_RAY_ADDRESS", "head:6379")
    out = io.StringIO()
    tune_cmd.TrialPrinter(out)("job_started", event)
    assert "cores on this machine" not in out.getvalue()


def test_a_gpus_per_node_override_below_one_is_refused_by_the_cli(monkeypatch, tmp_path, capsys):
    from api.cli.main import main

    monkeypatch.setenv("FOLDTUNE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FOLDTUNE_GPUS_PER_NODE", "")  # restored after the runner command sets it
    for argv in (["tune", "--gpus-per-node", "0"], ["runner", "--gpus-per-node", "-1", "--once"]):
        assert main(argv) == 2
        assert "must be >= 1" in capsys.readouterr().err
