"""Host factors of one model: the host probe's measured seconds per micro-batch against the host floor.

The cost model floors each micro-batch at the host's time to issue it: ops counted on CPU ranks for a small
GQA model (costmodel/host.py) times a per-op cost from a small-model MoE layer. On 2 H200s (2026-11-27,
docs/benchmarks.md) the steps of real model shapes issued at a short sequence, where every kernel ends before
the host queues the next, took 1.5-3.4x that floor per micro-batch (33 of 35 layouts, median 2.47) for
Qwen3-30B-A3B and DeepSeek-V2-Lite proxies, and full recomputation added 3.4-6.7x the host seconds the model gave
it: the layouts with many small micro-batches per rank and full recomputation were the ones the model
under-predicted by 14-41 %.

``foldtune calibrate --model`` therefore runs a host probe (executor.microbench.host_probe.measure_host):
the model's 1-GPU step at a short sequence with M and 2M micro-batches, without and with full recomputation.
This module turns the two per-micro-batch seconds into the two correction keys the step-time model reads
(costmodel.step_time.HOST_FACTOR, HOST_RECOMPUTE_FACTOR), stored with the model's component factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR, host_seconds_per_micro_batch
from spec.hardware import ClusterSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

#: a measured recomputation increment below this share of the base is noise, not a factor (seconds / seconds)
MIN_RECOMPUTE_SHARE = 0.02


@dataclass(frozen=True)
class HostProbe:
    """Measured host seconds per micro-batch of a 1-GPU step: ``base_s`` without recomputation, ``full_s`` with
    full recomputation, at ``seq_length`` and ``micro_batch_size``."""

    seq_length: int
    micro_batch_size: int
    base_s: float
    full_s: float
    steps_s: dict[str, float] = field(default_factory=dict)  # the probe's median steps, '<recompute>@<micro>'

    @classmethod
    def from_record(cls, record: dict) -> HostProbe:
        """The probe of a stored component record's 'host_probe' entry (unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def host_factors(spec: ModelSpec, probe: HostProbe, precision: str, hardware: HardwareProfile) -> dict[str, float]:
    """{HOST_FACTOR: measured / predicted host seconds per micro-batch, HOST_RECOMPUTE_FACTOR: measured /
    predicted seconds full recomputation adds} for ``spec`` on ``hardware`` at the probe's shape. The
    recompute factor is left out when the probe saw no increment above noise (MIN_RECOMPUTE_SHARE of the base).
    ValueError for a probe that is not positive."""
    if not (probe.base_s > 0 and probe.full_s > 0):
        raise ValueError(f"host probe of {spec.name}: seconds per micro-batch must be > 0, got "
                         f"{probe.base_s} and {probe.full_s}")
    training = TrainingSpec(seq_length=probe.seq_length, global_batch_size=probe.micro_batch_size,
                            precision=precision)
    cluster = ClusterSpec(hardware=hardware, num_gpus=1)
    none = ParallelConfig(world_size=1, micro_batch_size=probe.micro_batch_size)
    full = ParallelConfig(world_size=1, micro_batch_size=probe.micro_batch_size, recompute_granularity="full")
    base, _ = host_seconds_per_micro_batch(spec, training, cluster, none)
    _, extra = host_seconds_per_micro_batch(spec, training, cluster, full)
    out = {HOST_FACTOR: probe.base_s / base}
    added = probe.full_s - probe.base_s
    if extra > 0 and added > MIN_RECOMPUTE_SHARE * probe.base_s:
        out[HOST_RECOMPUTE_FACTOR] = added / extra
    return out
