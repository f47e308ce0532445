"""executor.microbench.host_probe: the host probe's worker on a CPU rank, and how measure_host uses it."""

import pytest
import torch

from executor.launch_local import LaunchResult, launch
from executor.microbench import host_probe as probe
from spec.catalog import get_model
from spec.errors import FoldtuneError
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def test_the_worker_times_pairs_of_both_lengths_on_a_cpu_rank():
    spec = get_model("tiny-moe")
    training = TrainingSpec(seq_length=32, global_batch_size=2, precision="fp32")
    config = ParallelConfig(world_size=1, recompute_granularity="full")
    result = launch(probe.host_probe_worker, 1, (spec, training, config, 1, 2), backend="gloo",
                    timeout_s=300, start_method="fork")
    assert result.ok, result.failure_reason
    report = result.results[0]
    assert set(report["steps_s"]) == {1, 2} and all(v > 0 for v in report["steps_s"].values())
    assert isinstance(report["host_s"], float)


def _fake_launch(monkeypatch, host_s: dict[str, float]):
    calls = []

    def fake(fn, world_size, args, timeout_s):
        spec, training, config, micro, repeats = args
        calls.append((fn, world_size, config.recompute_granularity, training.seq_length, micro, repeats))
        h = host_s[config.recompute_granularity]
        return LaunchResult(ok=True, results=[{"steps_s": {micro: 0.05 + micro * h, 2 * micro: 0.05 + 2 * micro * h},
                                               "host_s": h}])

    monkeypatch.setattr(probe, "launch", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_measure_host_runs_both_recompute_settings_on_one_rank(monkeypatch):
    calls = _fake_launch(monkeypatch, {"none": 0.020, "full": 0.032})
    base, full, steps = probe.measure_host(get_model("tiny-moe"), "bf16", micro_batches=4, repeats=3)
    assert (base, full) == (0.020, 0.032)
    assert [c[1:] for c in calls] == [(1, "none", 256, 4, 3), (1, "full", 256, 4, 3)]
    assert all(c[0] is probe.host_probe_worker for c in calls)
    assert steps == {"none@4": pytest.approx(0.13), "none@8": pytest.approx(0.21), "full@4": pytest.approx(0.178),
                     "full@8": pytest.approx(0.306)}


def test_a_longer_step_that_is_not_slower_is_refused(monkeypatch):
    _fake_launch(monkeypatch, {"none": -0.001, "full": 0.01})
    with pytest.raises(FoldtuneError, match="not slower"):
        probe.measure_host(get_model("tiny-moe"), "bf16")


def test_a_failed_rank_is_reported(monkeypatch):
    monkeypatch.setattr(probe, "launch",
                        lambda fn, world_size, args, timeout_s: LaunchResult(ok=False, failure_reason="out of memory"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(FoldtuneError, match="out of memory"):
        probe.measure_host(get_model("tiny-moe"), "bf16")


def test_no_probe_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FoldtuneError, match="needs a CUDA GPU"):
        probe.measure_host(get_model("tiny-moe"), "bf16")
