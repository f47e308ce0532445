"""Where one training step of a layout spends its device time on one rank (torch.profiler, CUDA kernels): the
step's wall time, the device's busy and idle time (union of kernel intervals), NCCL kernels (their duration
includes waiting for the peer), how much of the communication and copies ran beside compute, and the top
kernels. :func:`trace_worker` runs on every rank of a launched world (``bench/layout_trace_gpu.py``,
``bench/ep_overlap_gpu.py --trace``)."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from executor.data import global_batch, micro_batches
from executor.microbench.intervals import busy_us, overlap_us
from executor.microbench.sync_debug import synchronizing_calls
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.profile import DTYPES, options_for_precision
from executor.timing import PhaseTimer
from executor.train_step import Trainer
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def _unprofiled_step(trainer: Trainer, micro, device) -> tuple[float, int]:
    """Two unprofiled steps: (ms until the device finished the first, synchronizing calls the host made in the
    second, counted by torch's sync debug mode). The profiler's own host cost lengthens a host-bound step; the
    first number is the step without it. (How long the host took to issue the step cannot be read here: the step
    ends with a host read of its loss, which waits for the device.)"""
    torch.cuda.synchronize(device)
    torch.distributed.barrier()
    start = time.perf_counter()
    trainer.step(micro)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    torch.distributed.barrier()
    syncs = len(synchronizing_calls(lambda: trainer.step(micro)))
    return wall * 1e3, syncs


def cuda_kernels(prof) -> list:
    """The CUDA kernel events of a finished ``torch.profiler.profile``: record_function ranges that show on the
    device timeline (user annotations, as FSDP's and the optimizer's) are not kernels and are left out."""
    return [e for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def kernel_times(kernels: list) -> dict[str, list[float]]:
    """Kernel name -> the device microseconds of each of its calls, over ``kernels`` (profiler events)."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    return by_name


def top_kernels(by_name: dict[str, list[float]], top: int) -> list[dict]:
    """The ``top`` names of :func:`kernel_times` by summed device time, most first: ``{'name'`` (its first 300
    characters), ``'calls', 'ms'}``."""
    rows = sorted(((n, len(v), sum(v) / 1e3) for n, v in by_name.items()), key=lambda r: -r[2])
    return [{"name": n[:300], "calls": c, "ms": round(ms, 3)} for n, c, ms in rows[:top]]


def trace_worker(rank: int, world_size: int, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                 warmup_steps: int, top: int, options: ExecutorOptions | None = None) -> dict:
    """One rank: warm up, then profile one step; wall, busy, idle, NCCL and top kernels (milliseconds), and
    how much of the NCCL kernels' time ran beside compute kernels (``nccl_under_compute_ms``; its all-to-all
    part ``a2a_ms`` / ``a2a_under_compute_ms``), and the same of the copies (``memcpy_ms``,
    ``memcpy_under_compute_ms``: the copy engines' work, which ``busy_without_nccl_ms`` leaves out too).
    ``options``: the executor options (default: the training's)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    options = options or ExecutorOptions.for_training(training, model=model)
    options = options_for_precision(options, training.precision)
    state = build_parallel_state(config, rank)
    net = MoEGPT(model, state, options, training.seq_length, device, DTYPES[training.precision],
                 PhaseTimer(enabled=False, device=device))
    trainer = Trainer(net)
    dp = state.dp
    for step in range(warmup_steps + 1):
        batch = global_batch(model.vocab_size, training.seq_length, training.global_batch_size, options.seed, step)
        micro = micro_batches(batch, dp.size, dp.rank, config.micro_batch_size, device)
        if cuda:
            torch.cuda.synchronize(device)
        torch.distributed.barrier()
        if step < warmup_steps:
            trainer.step(micro)
            continue
        plain_wall_ms, syncs = _unprofiled_step(trainer, micro, device) if cuda else (None, None)
        torch.distributed.barrier()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            trainer.step(micro)
            if cuda:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
    trainer.finish_param_gather()
    peak = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)} if cuda else {}
    kernels = cuda_kernels(prof)
    by_name = kernel_times(kernels)
    nccl = {n: v for n, v in by_name.items() if "nccl" in n.lower()}
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    # copies (the copy engines' 'Memcpy ...' entries, the copy-engine all-to-all's among them) are not compute
    copies = [(e.time_range.start, e.time_range.end) for e in kernels if e.name.startswith("Memcpy")]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels
               if "nccl" not in e.name.lower() and not e.name.startswith("Memcpy")]
    busy_no_nccl = busy_us(compute) / 1e3
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    a2a = [(e.time_range.start, e.time_range.end) for e in kernels if "sendrecv" in e.name.lower()]
    return {"rank": rank, "wall_ms": wall * 1e3, "unprofiled_wall_ms": plain_wall_ms, "host_syncs": syncs,
            "busy_ms": busy, "busy_without_nccl_ms": busy_no_nccl,
            "nccl_under_compute_ms": overlap_us(comm, compute) / 1e3, "a2a_ms": busy_us(a2a) / 1e3,
            "a2a_under_compute_ms": overlap_us(a2a, compute) / 1e3, "memcpy_ms": busy_us(copies) / 1e3,
            "memcpy_under_compute_ms": overlap_us(copies, compute) / 1e3,
            "kernels": len(kernels), "nccl_ms": {n: sum(v) / 1e3 for n, v in nccl.items()},
            "nccl_calls": {n: len(v) for n, v in nccl.items()},
            **peak, "top": top_kernels(by_name, top)}
