"""In-step component measurement: a real 1-GPU training step of the model, read by its phase marks.

The isolated blocks of :mod:`executor.microbench.components` run without the step around them, so the host
is further ahead of (device-time timing) or behind (wall clock) the GPU than in a step; their factors moved
1-GPU step predictions away from the measured steps of Qwen3 and DeepSeek-V2-Lite
(docs/benchmarks.md). Here the component times come from the step itself: :func:`measure_step` runs one world-size-1
layout (no recomputation, ``micro_batches`` micro-batches of ``micro_batch_size`` sequences) through
:func:`executor.profile.profile_layout`, the path the layout tables measure with (a spawned local rank,
warm-up then timed steps, the phase timer on for the timed ones), and returns its Measurement.
:func:`costmodel.calibrate.step_phases.components_from_phases` maps its median phases to components.
"""

from __future__ import annotations

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
