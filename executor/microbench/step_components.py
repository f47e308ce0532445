"""In-step component measurement: a real 1-GPU training step of the model, read by its phase marks.

The isolated blocks of :mod:`executor.microbench.components` run without the step around them, so the host
is further ahead of (device-time timing) or behind (wall clock) the GPU than in a step; their factors moved
1-GPU step predictions away from the measured steps of Qwen3 and DeepSeek-V2-Lite (docs/benchmarks.md,
2026-11-27). Here the component times come from the step itself: :func:`measure_step` runs one world-size-1
layout (no recomputation, ``micro_batches`` micro-batches of ``micro_batch_size`` sequences) through
:func:`executor.profile.profile_layout`, the path the layout tables measure with (a spawned local rank,
warm-up then timed steps, the phase timer on for the timed ones), and returns its Measurement.
:func:`costmodel.calibrate.step_phases.components_from_phases` maps its median phases to components.

:func:`measure_host` is the host probe: the same 1-GPU step at a short sequence, where every kernel ends before
the host has queued the next, so the step's wall time is the host's; two step lengths give the host seconds per
micro-batch (costmodel.calibrate.host_factors).
"""

from __future__ import annotations

import torch

from executor.measurement import Measurement
from executor.profile import profile_layout
from spec.errors import FoldtuneError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

# the layout tables' step: 8 micro-batches of one sequence (global batch 8 at mbs 1), so the per-step work
# (optimizer, gradient hand-over) is amortised as in the tables the factors are checked against
STEP_MICRO_BATCHES = 8
STEP_WARMUP = 2  # the first step builds optimizer states and kernels' first use; the second settles the allocator
STEP_TIMED = 3  # phases are per-phase medians over these
# the host probe: at 256 tokens per micro-batch the 2-layer proxies' kernels (H200) take a fifth of the host's
# time to issue them; M and 2M micro-batches, their steps' medians over HOST_TIMED steps
HOST_PROBE_SEQ = 256
HOST_PROBE_MICRO_BATCHES = 8
HOST_TIMED = 5


def measure_step(spec: ModelSpec, seq_length: int, micro_batch_size: int, precision: str, device: str,
                 micro_batches: int = STEP_MICRO_BATCHES, warmup: int = STEP_WARMUP, steps: int = STEP_TIMED,
                 timeout_s: float = 600.0) -> Measurement:
    """The Measurement (step time, median seconds per phase per step) of ``spec``'s 1-GPU layout on
    ``device`` ('cuda' or 'cpu'); FoldtuneError with the run's reason when it fails (e.g. out of memory)."""
    training = TrainingSpec(seq_length=seq_length, global_batch_size=micro_batch_size * micro_batches,
                            precision=precision)
    config = ParallelConfig(world_size=1, micro_batch_size=micro_batch_size)
    measured = profile_layout(spec, training, config, warmup_steps=warmup, timed_steps=steps, timeout_s=timeout_s,
                              device=device)
    if not measured.ok:
        raise FoldtuneError(f"in-step components of {spec.name}: the 1-GPU step {config.label()} failed: "
                            f"{measured.failure_reason}")
    return measured


def measure_host(spec: ModelSpec, precision: str, micro_batch_size: int = 1, seq_length: int = HOST_PROBE_SEQ,
                 micro_batches: int = HOST_PROBE_MICRO_BATCHES, steps: int = HOST_TIMED,
                 timeout_s: float = 600.0) -> tuple[float, float, dict[str, float]]:
    """Host seconds per micro-batch of ``spec``'s 1-GPU step on CUDA: (without recomputation, with full
    recomputation, the four median step seconds by '<recompute>@<micro-batches>'). Each is the difference of
    the median steps of ``2 * micro_batches`` and ``micro_batches`` micro-batches over ``micro_batches`` (the
    once-per-step work cancels). FoldtuneError when a run fails or no GPU is present (on CPU ranks every op
    runs before the next is issued: there is no host floor to see)."""
    if not torch.cuda.is_available():
        raise FoldtuneError("the host probe needs a CUDA GPU")
    out, steps_s = [], {}
    for recompute in ("none", "full"):
        walls = []
        for m in (micro_batches, 2 * micro_batches):
            training = TrainingSpec(seq_length=seq_length, global_batch_size=micro_batch_size * m,
                                    precision=precision)
            config = ParallelConfig(world_size=1, micro_batch_size=micro_batch_size, recompute_granularity=recompute)
            measured = profile_layout(spec, training, config, warmup_steps=STEP_WARMUP, timed_steps=steps,
                                      timeout_s=timeout_s, device="cuda")
            if not measured.ok:
                raise FoldtuneError(f"host probe of {spec.name}: {config.label()} at seq {seq_length} failed: "
                                    f"{measured.failure_reason}")
            walls.append(measured.step_time)
            steps_s[f"{recompute}@{m}"] = measured.step_time
        out.append((walls[1] - walls[0]) / micro_batches)
    if not all(v > 0 for v in out):
        raise FoldtuneError(f"host probe of {spec.name}: a longer step was not slower ({out}); the machine is "
                            f"too busy to measure")
    return out[0], out[1], steps_s
