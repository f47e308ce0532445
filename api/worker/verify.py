"""Verify jobs and ``foldtune verify``: a plan's top layouts checked by one-rank slices on this machine.

:func:`run_verify` binds the executor's slice (:func:`executor.slices.measure_slice`) to the device at hand and
hands it to :func:`planner.verify.verify_plan`, which plans, slices and re-ranks. The slices run in this process
(``foldtune verify``, ``bench/verify_slices.py``: torch and the repository, no Ray, no database) or, for the
runner, each layout in a child process of its own (:func:`executor.launch_local.launch`), so that a slice that
runs out of memory or crashes fails that layout, not the runner. :func:`slice_cluster` prices the slices'
compute on the hardware they run on; the target cluster prices what they do not run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from executor.failure import is_out_of_memory
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.slices import SliceTiming, measure_slice
from planner.enumerate import SearchSpace
from planner.verify import LayoutCheck, Measure, VerifyReport, verify_plan
from spec.errors import FoldtuneError
from spec.hardware import ClusterSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.router_options import RouterOptions
from spec.shape_defaults import is_cpu
from spec.training_spec import TrainingSpec

log = logging.getLogger("foldtune.verify")

#: decoder layers of each kind a slice builds at most (the time per layer is their mean)
DEFAULT_SLICE_LAYERS = 2
#: calls per timing window on a GPU; the CPU (tests, smoke runs) takes one window of one call
GPU_TIMING = SliceTiming(calls=8, windows=3, warmup=2)
CPU_TIMING = SliceTiming(calls=1, windows=3, warmup=1)
DEFAULT_SLICE_TIMEOUT_S = 600.0


def slice_device(slice_hardware: HardwareProfile) -> str:
    """Where slices run: the CPU for the 'cpu' hardware, else the first CUDA device."""
    return "cpu" if is_cpu(slice_hardware.gpu.name) else "cuda"


def slice_cluster(cluster: ClusterSpec, slice_hardware: HardwareProfile) -> ClusterSpec:
    """The target ``cluster`` on the slices' hardware: same GPUs and node boundary, the device's rates (only its
    compute prices a slice)."""
    hardware = dataclasses.replace(slice_hardware, gpus_per_node=cluster.gpus_per_node)
    return ClusterSpec(hardware=hardware, num_gpus=cluster.num_gpus, min_headroom=cluster.min_headroom)


def _slice_worker(rank: int, world_size: int, model: ModelSpec, config: ParallelConfig, seq_length: int,
                  precision: str, loads: dict, cap: int, device: str, options: ExecutorOptions,
                  timing: SliceTiming) -> dict:
    """One layout's slice in a child process (executor.launch_local runs it as rank 0 of a world of one)."""
    return measure_slice(model, config, seq_length, precision, loads, cap=cap, device=device, options=options,
                         timing=timing)


def slice_measure(model: ModelSpec, training: TrainingSpec, device: str, *, cap: int = DEFAULT_SLICE_LAYERS,
                  timing: SliceTiming | None = None, isolated: bool = False, router: RouterOptions | None = None,
                  timeout_s: float = DEFAULT_SLICE_TIMEOUT_S) -> Measure:
    """The ``measure`` callable of :func:`planner.verify.verify_plan` for ``device`` ('cpu' or 'cuda'): in this
    process, or with ``isolated`` in a child process per layout; the router's options those the training would
    run with (``router``; default: the model's). A failure (out of memory, a module the executor lacks, a
    timeout) becomes a FoldtuneError naming it."""
    timing = timing or (CPU_TIMING if device == "cpu" else GPU_TIMING)
    options = ExecutorOptions.for_training(training, router, model=model)

    def in_process(config: ParallelConfig, loads: dict) -> dict:
        try:
            return measure_slice(model, config, training.seq_length, training.precision, loads, cap=cap,
                                 device=device, options=options, timing=timing)
        except FoldtuneError:
            raise
        except Exception as exc:  # out of memory, or a layout the modules refuse: that layout fails, not the run
            kind = "out of memory" if is_out_of_memory(exc) else type(exc).__name__
            if device == "cuda":
                torch.cuda.empty_cache()
            raise FoldtuneError(f"slice of {config.label()} failed: {kind}: {str(exc).strip().splitlines()[0]}"
                                if str(exc).strip() else f"slice of {config.label()} failed: {kind}") from None

    def in_child(config: ParallelConfig, loads: dict) -> dict:
        launched = launch(_slice_worker, 1, (model, config, training.seq_length, training.precision, loads, cap,
                                             device, options, timing), backend="nccl" if device == "cuda" else "gloo",
                          timeout_s=timeout_s)
        if not launched.ok:
            raise FoldtuneError(f"slice of {config.label()} failed: {launched.failure_reason}")
        return launched.results[0]

    return in_child if isolated else in_process


def run_verify(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, slice_hardware: HardwareProfile, *,
               top: int = 3, space: SearchSpace | None = None, hot_factor: float | None = None,
               cap: int = DEFAULT_SLICE_LAYERS, isolated: bool = False, timing: SliceTiming | None = None,
               router: RouterOptions | None = None,
               on_layout: Callable[[LayoutCheck], None] | None = None) -> VerifyReport:
    """Check the top ``top`` layouts of ``model`` on ``cluster`` by slices run on this machine's
    ``slice_hardware`` (planner.verify.verify_plan)."""
    device = slice_device(slice_hardware)
    if device == "cuda" and not torch.cuda.is_available():
        raise FoldtuneError(f"slices on {slice_hardware.gpu.name} need a CUDA device, and this machine has none "
                            "(--slice-gpu cpu runs them on the CPU)")
    measure = slice_measure(model, training, device, cap=cap, timing=timing, isolated=isolated, router=router)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    kwargs = {} if hot_factor is None else {"hot_factor": hot_factor}
    return verify_plan(model, training, cluster, slice_cluster(cluster, slice_hardware), measure, top=top,
                       space=space, device=name, on_layout=on_layout, **kwargs)
