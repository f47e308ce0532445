"""The Ray launcher on this machine: a real profiled run of the MoE step on CPU ranks (gloo), per-step
times streamed while it runs, a consistent stop of all ranks, failures with launch_local's reasons."""

from __future__ import annotations

import functools
import os

import pytest

from spec.catalog import get_model
from spec.errors import SpecError
from spec.failure import FailureKind
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from executor import progress

TRAINING = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32")


@pytest.fixture(scope="module")
def ray_launch():
    from executor import launch_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    launch_ray.attach_ray()
    return launch_ray.launch


def _profile(launcher, steps: int, **kwargs):
    from executor.profile import profile_layout

    return profile_layout(get_model("tiny-moe"), TRAINING, ParallelConfig(world_size=2, ep=2), warmup_steps=1,
                          timed_steps=steps, timeout_s=120, device="cpu",
                          launcher=functools.partial(launcher, **kwargs))


@pytest.mark.slow
def test_steps_stream_to_the_driver_and_a_stop_ends_every_rank_at_the_same_step(ray_launch):
    seen: list[tuple[int, float]] = []

    def on_step(step: int, seconds: float) -> bool:
        seen.append((step, seconds))
        return True  # stop after the first timed step

    m = _profile(ray_launch, steps=100, on_step=on_step)  # the stop must land long before step 100
    assert m.ok, m.failure_reason
    assert m.pruned and len(m.step_times) < 100  # both ranks left the loop early, at the same step
    assert seen and seen[0][0] == 0 and seen[0][1] == pytest.approx(m.step_times[0])
    assert [s for s, _ in seen] == list(range(len(m.step_times)))


@pytest.fixture(scope="module")
def named_full_run(ray_launch):
    """One named run of two timed steps that never asks to stop, and what its on_step saw: the steps streamed,
    and (the first time) the placement group and rank actors as the Ray dashboard and `ray list` show them.
    Both tests below read it: each Ray run starts rank actors that import torch afresh."""
    import ray
    from ray.util import placement_group_table

    seen: list[int] = []
    named: list[tuple[str, bool]] = []

    def on_step(step: int, seconds: float) -> bool:
        seen.append(step)
        if not named:
            for group in placement_group_table().values():
                if group["name"].startswith("foldtune-job-3-trial-0-") and group["state"] == "CREATED":
                    actors = [ray.get_actor(f"{group['name']}-rank{r}") for r in range(2)]
                    named.append((group["name"], len(actors) == 2))
        return False

    m = _profile(ray_launch, steps=2, on_step=on_step, name="job-3-trial-0")
    return m, seen, named


@pytest.mark.slow
def test_the_placement_group_and_rank_actors_carry_the_run_name(named_full_run):
    """What the Ray dashboard and `ray list` show: foldtune-<name>-<hex> and its -rank<r> actors."""
    m, _, named = named_full_run
    assert m.ok, m.failure_reason
    assert len(named) == 1 and named[0][1], named


@pytest.mark.slow
def test_a_full_run_reports_every_step_and_is_not_pruned(named_full_run):
    m, seen, _ = named_full_run
    assert m.ok and not m.pruned and len(m.step_times) == 2 and seen == [0, 1]


@pytest.mark.slow
def test_two_trials_run_at_once_when_the_cluster_has_room(ray_launch):
    import threading

    # Each trial's first streamed step waits for the other trial's first step. Run one after the other,
    # the first trial would wait in vain (the barrier breaks); run at once, both pass it. Comparing step
    # time spans instead was flaky: steps take milliseconds next to seconds of rank start-up.
    meet = threading.Barrier(2, timeout=90)
    broken: list[int] = []
    results = {}

    def trial(i: int) -> None:
        def on_step(step: int, seconds: float) -> bool:
            if step == 0:
                try:
                    meet.wait()
                except threading.BrokenBarrierError:
                    broken.append(i)
            return False

        results[i] = _profile(ray_launch, steps=8, on_step=on_step)

    threads = [threading.Thread(target=trial, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(results[i].ok for i in range(2)), [results[i].failure_reason for i in range(2)]
    assert not broken, f"trials {broken} never saw the other trial running: placement groups ran one at a time"


def test_a_world_larger_than_the_cluster_fails_at_once(ray_launch):
    import ray

    cpus = int(ray.cluster_resources()["CPU"])
    result = ray_launch(print, cpus + 1, backend="gloo", timeout_s=5)
    assert not result.ok and result.failure_reason.startswith(f"layout needs {cpus + 1} CPU bundles")
    assert result.failure_kind == FailureKind.ERROR


def test_rank_0_answers_a_rendezvous_port_it_already_holds(ray_launch):
    """The port rank 0 answers is bound before the driver hears it: nothing beside the run (another trial's
    ranks, NCCL's sockets) can take it between picking and binding, as a port picked free and bound later
    could (CI saw such a run fail with EADDRINUSE). The other ranks answer no port."""
    import socket

    import ray

    from executor.launch_ray import RankActor

    actor_cls = ray.remote(RankActor)
    actors = [actor_cls.options(num_cpus=0).remote(r, 2, {}, 1) for r in range(2)]
    try:
        (ip, port, *_), (_, other_port, *_) = ray.get([a.address.remote() for a in actors], timeout=120)
        assert port > 0 and other_port == 0
        with socket.socket() as s, pytest.raises(OSError):
            s.bind((ip, port))
        assert ray.get(actors[0].address.remote(), timeout=60)[1] == port  # asked again: the same store
    finally:
        for a in actors:
            ray.kill(a)


def test_fault_specs_parse_and_bad_ones_name_the_part():
    assert progress.parse_faults("kill:rank=1:step=2, hang:rank=0:step=0") == [
        progress.Fault("kill", 1, 2), progress.Fault("hang", 0, 0)]
    assert progress.parse_faults("") == []
    with pytest.raises(SpecError, match="explode"):
        progress.parse_faults("explode:rank=1:step=0")
    with pytest.raises(SpecError, match="rank=x"):
        progress.parse_faults("kill:rank=x")


def test_without_a_sink_nothing_stops():
    previous = progress.install(None)
    try:
        assert progress.report_step(0, 0.1) is False
        calls = []
        progress.install(lambda step, seconds: calls.append(step) or step >= 1)
        assert progress.report_step(0, 0.1) is False and progress.report_step(1, 0.1) is True
        assert calls == [0, 1]
    finally:
        progress.install(previous)


def test_rank_processes_run_at_the_drivers_niceness(ray_launch):
    """The local Ray's workers run at the driver's niceness, as the calibration's local ranks do (Ray's default
    would put them at 15: less CPU than the calibration that priced them on shared cores)."""
    import ray

    @ray.remote(num_cpus=1)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(niceness.remote(), timeout=120) == os.getpriority(os.PRIO_PROCESS, 0)


class _Progress:
    """A rank actor's stand-in: ``last_step.remote()`` answers the step it is set to."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.last_step = self

    def remote(self) -> int:
        return self.step


def test_a_rank_left_a_step_behind_for_the_limit_is_hung_and_progress_resets_the_clock(monkeypatch):
    from executor import launch_ray

    now = [100.0]
    monkeypatch.setattr(launch_ray.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(launch_ray.ray, "get", lambda refs, timeout=None: list(refs))
    actors = [_Progress(0), _Progress(-1), _Progress(0)]
    watch = launch_ray._StallWatch(actors)

    def at(t: float) -> str | None:
        now[0] = 100.0 + t
        return watch.check([0, 1, 2], limit_s=15.0)

    assert at(1.0) is None  # asked at most every STALL_POLL_S
    assert at(2.0) is None  # rank 1 behind since t = 2
    assert at(16.0) is None
    assert at(18.0) == "hung: rank 1 stuck before its first timed step while others finished step 0, for 15 s"
    actors[1].step, actors[0].step, actors[2].step = 0, 1, 1  # it moved on, and is behind again: a new clock
    assert at(20.0) is None and at(30.0) is None
    assert at(35.0) == "hung: rank 1 stuck after step 0 while others finished step 1, for 15 s"
    actors[1].step = 1  # all level: nothing lags
    assert at(60.0) is None


def test_ranks_at_the_same_step_never_stall(monkeypatch):
    from executor import launch_ray

    now = [0.0]
    monkeypatch.setattr(launch_ray.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(launch_ray.ray, "get", lambda refs, timeout=None: list(refs))
    watch = launch_ray._StallWatch([_Progress(-1), _Progress(-1)])  # both still in warm-up, however long
    for t in range(2, 200, 2):
        now[0] = float(t)
        assert watch.check([0, 1], limit_s=15.0) is None
