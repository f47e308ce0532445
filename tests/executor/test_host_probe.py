"""executor.microbench.step_components.measure_host: which steps it runs and how it turns them into seconds."""

import pytest
import torch

from executor.measurement import Measurement
from executor.microbench import step_components
from spec.catalog import get_model
from spec.errors import FoldtuneError


def _fake_runs(monkeypatch, per_mb: dict[str, float], fixed: float = 0.05):
    """profile_layout replaced by steps of ``fixed + micro-batches x per_mb[recompute]`` seconds; the calls kept."""
    calls = []

    def fake(spec, training, config, warmup_steps, timed_steps, timeout_s, device):
        micro = training.global_batch_size // config.micro_batch_size
        calls.append((config.recompute_granularity, micro, training.seq_length, device))
        step = fixed + micro * per_mb[config.recompute_granularity]
        return Measurement(ok=True, step_time=step, step_times=[step])

    monkeypatch.setattr(step_components, "profile_layout", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_per_micro_batch_seconds_from_two_step_lengths(monkeypatch):
    calls = _fake_runs(monkeypatch, {"none": 0.020, "full": 0.032})
    base, full, steps = step_components.measure_host(get_model("tiny-moe"), "bf16", micro_batches=4)
    assert base == pytest.approx(0.020) and full == pytest.approx(0.032)
    assert calls == [("none", 4, 256, "cuda"), ("none", 8, 256, "cuda"), ("full", 4, 256, "cuda"),
                     ("full", 8, 256, "cuda")]
    assert steps == {"none@4": pytest.approx(0.13), "none@8": pytest.approx(0.21), "full@4": pytest.approx(0.178),
                     "full@8": pytest.approx(0.306)}


def test_a_longer_step_that_is_not_slower_is_refused(monkeypatch):
    _fake_runs(monkeypatch, {"none": 0.0, "full": 0.01})
    with pytest.raises(FoldtuneError, match="not slower"):
        step_components.measure_host(get_model("tiny-moe"), "bf16")


def test_no_probe_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FoldtuneError, match="needs a CUDA GPU"):
        step_components.measure_host(get_model("tiny-moe"), "bf16")
