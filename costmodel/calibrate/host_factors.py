"""Host factors of one model: the host probe's measured seconds per micro-batch against the host floor.

The cost model floors each micro-batch at the host's time to issue it: ops counted on CPU ranks for a small
GQA model (costmodel/host.py) times a per-op cost from a small-model MoE layer. On 2 H200s
(docs/benchmarks.md) the steps of real model shapes issued at a short sequence, where every kernel ends before
the host queues the next, took 1.5-3.4x that floor per micro-batch (33 of 35 layouts, median 2.47) for
Qwen3-30B-A3B and DeepSeek-V2-Lite proxies, and full recomputation added 3.4-6.7x the host seconds the model gave
it: the layouts with many small micro-batches per rank and full recomputation were the ones the model
under-predicted by 14-41 %.

``foldtune calibrate --model`` therefore runs a host probe (executor.microbench.host_probe.measure_host):
the model's 1-GPU step at a short sequence with M and 2M micro-batches, without and with full recomputation.
This module turns the two per-micro-batch seconds into the two correction keys the step-time model reads
(costmodel.step_time.HOST_FACTOR, HOST_RECOMPUTE_FACTOR), stored with the model's component factors.

The probe's premise (the host, not the device, sets the pace at the short sequence) does not hold for every
model: a Mixtral-8x7B proxy reads 2.8 B expert parameters per micro-batch whatever the sequence, and its probe
(2 x H200, docs/benchmarks.md) measured 15.99 ms per micro-batch where the model's device time alone is
15.6 ms. Such a probe says nothing about the host, so a factor is kept only where the measurement exceeds the
model's device time by DEVICE_BOUND_MARGIN.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR, host_seconds_per_micro_batch, stage_times
from spec.hardware import ClusterSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

#: a measured recomputation increment below this share of the base is noise, not a factor (seconds / seconds)
MIN_RECOMPUTE_SHARE = 0.02
#: a probe step under this multiple of the model's device time may be device-bound: no host factor from it.
#: The device time is uncorrected (the component factors are measured at seq 4096, not at the probe's
#: sequence), and 1.3 leaves room for its error: the probes on 2 x H200 measured 1.45-2.9x it where
#: the host set the pace (Qwen3, DeepSeek) and 1.02x (1.28x with full recomputation) where it did not (Mixtral).
DEVICE_BOUND_MARGIN = 1.3


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


def device_seconds(spec: ModelSpec, probe: HostProbe, precision: str, hardware: HardwareProfile) -> tuple[float, float]:
    """The model's device seconds per micro-batch of the probe's two steps (without, with full recomputation),
    with no host floor and no component factor."""
    training = TrainingSpec(seq_length=probe.seq_length, global_batch_size=probe.micro_batch_size,
                            precision=precision)
    cluster = ClusterSpec(hardware=hardware, num_gpus=1)
    none, full = _configs(probe)
    return stage_times(spec, training, cluster, none)[0], stage_times(spec, training, cluster, full)[0]


def _configs(probe: HostProbe) -> tuple[ParallelConfig, ParallelConfig]:
    return (ParallelConfig(world_size=1, micro_batch_size=probe.micro_batch_size),
            ParallelConfig(world_size=1, micro_batch_size=probe.micro_batch_size, recompute_granularity="full"))


def host_factors(spec: ModelSpec, probe: HostProbe, precision: str, hardware: HardwareProfile) -> dict[str, float]:
    """{HOST_FACTOR: measured / predicted host seconds per micro-batch, HOST_RECOMPUTE_FACTOR: measured /
    predicted seconds full recomputation adds} for ``spec`` on ``hardware`` at the probe's shape. A key is left
    out where its step may be device-bound (under DEVICE_BOUND_MARGIN times the model's device time: both keys
    when the step without recomputation is), and the recompute key where the probe saw no increment above noise
    (MIN_RECOMPUTE_SHARE of the base). ValueError for a probe that is not positive."""
    if not (probe.base_s > 0 and probe.full_s > 0):
        raise ValueError(f"host probe of {spec.name}: seconds per micro-batch must be > 0, got "
                         f"{probe.base_s} and {probe.full_s}")
    training = TrainingSpec(seq_length=probe.seq_length, global_batch_size=probe.micro_batch_size,
                            precision=precision)
    cluster = ClusterSpec(hardware=hardware, num_gpus=1)
    none, full = _configs(probe)
    device_base, device_full = device_seconds(spec, probe, precision, hardware)
    if probe.base_s < DEVICE_BOUND_MARGIN * device_base:
        return {}
    base, _ = host_seconds_per_micro_batch(spec, training, cluster, none)
    _, extra = host_seconds_per_micro_batch(spec, training, cluster, full)
    out = {HOST_FACTOR: probe.base_s / base}
    added = probe.full_s - probe.base_s
    if extra > 0 and added > MIN_RECOMPUTE_SHARE * probe.base_s and probe.full_s >= DEVICE_BOUND_MARGIN * device_full:
        out[HOST_RECOMPUTE_FACTOR] = added / extra
    return out
