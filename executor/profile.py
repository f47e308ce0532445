"""Profile one layout: warm-up then timed steps of the real training step, on local ranks → Measurement.

:func:`profile_layout` launches ``config.world_size`` local processes (NCCL on GPUs, gloo on CPU), each
running :func:`profile_worker`, and folds their reports into a :class:`Measurement`. Failures (invalid
layout, out of memory, a crashed rank, a timeout) come back as a failed Measurement with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch

from spec.catalog import get_hardware
from spec.errors import CatalogError, FoldtuneError
from spec.failure import FailureKind
from spec.flops import flops_per_step, mfu, tflops_per_gpu
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from executor import progress
from executor.buildable import check_buildable
from executor.data import global_batch, micro_batches
from executor.kernels import fp8
from executor.kernels.fp8 import expert_pick
from executor.launch_local import launch as launch_local
from executor.measurement import Measurement
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.timing import PhaseTimer
from executor.train_step import Trainer

# Parameter and activation dtype per precision; fp8 keeps them bf16 and runs the linears and expert GEMMs
# in fp8 through the 'torch-fp8' kernel backend (executor.kernels.fp8). The LM head and router stay bf16.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
FP8_BACKENDS = {"torch": "torch-fp8"}  # the fp8 variant of each kernel backend

log = logging.getLogger(__name__)


def options_for_precision(options: ExecutorOptions, precision: str) -> ExecutorOptions:
    """``options`` with the kernel backend that runs ``precision`` (fp8: the fp8 variant of the backend)."""
    if precision != "fp8" or options.kernel_backend in FP8_BACKENDS.values():
        return options
    if options.kernel_backend not in FP8_BACKENDS:
        raise FoldtuneError(f"kernel backend {options.kernel_backend!r} has no fp8 variant")
    return dataclasses.replace(options, kernel_backend=FP8_BACKENDS[options.kernel_backend])


def _fp8_report(device: torch.device) -> dict:
    """How this rank ran its fp8 GEMMs: the reason they were emulated (None: kernels), calls per path, and
    the routed experts' GEMM shapes by the path they ran (:func:`executor.kernels.fp8.expert_pick.report`:
    with ExecutorOptions.fp8_expert_gemm 'fastest', the shapes where bf16 was faster ran bf16)."""
    return {"emulated_because": fp8.emulation_reason(device), "calls": fp8.gemm_counts(),
            "expert_gemm_shapes": expert_pick.report()}


def expert_gemm_paths(reports: list[dict]) -> dict | None:
    """The ranks' expert GEMM shapes by path ('bf16', 'fp8', 'fp8 untimed': counts of distinct shapes over the
    ranks; 'bf16_shapes' / 'fp8_shapes': calls per shape, summed over ranks); None without an fp8 report."""
    found = [r["fp8"]["expert_gemm_shapes"] for r in reports if "expert_gemm_shapes" in r.get("fp8", {})]
    if not found:
        return None
    merged: dict = {"bf16_shapes": {}, "fp8_shapes": {}}
    for part in found:
        for path in ("bf16_shapes", "fp8_shapes"):
            for shape, calls in part[path].items():
                merged[path][shape] = merged[path].get(shape, 0) + calls
    merged["bf16"], merged["fp8"] = len(merged["bf16_shapes"]), len(merged["fp8_shapes"])
    merged["fp8 untimed"] = max(part["fp8 untimed"] for part in found)
    return merged


def _sync(device: torch.device) -> None:
    """Wait for the compute stream only: the distributed optimizer's overlapped parameter all-gathers run on
    NCCL's streams behind the next step's forward, and a device-wide sync would move them out of the timed
    steps (into the untimed gap between them)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def profile_worker(rank: int, world_size: int, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                   options: ExecutorOptions, warmup_steps: int, timed_steps: int, use_cuda: bool) -> dict:
    """One rank: build its slice, run warm-up and timed steps, report times, phases, memory and counts.

    ``groups_at`` and ``first_timed_at`` (unix seconds) are when this rank had built the layout's process
    groups and when its first timed step started: the driver splits the trial's fixed cost with them.
    """
    first_timed_at = None
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if training.precision not in DTYPES:
        raise FoldtuneError(f"precision {training.precision!r} is not supported by the executor yet "
                            f"(supported: {', '.join(DTYPES)})")
    options = options_for_precision(options, training.precision)
    state = build_parallel_state(config, rank)
    groups_at = time.time()
    timer = PhaseTimer(enabled=False, device=device)
    net = MoEGPT(model, state, options, training.seq_length, device, DTYPES[training.precision], timer)
    trainer = Trainer(net)
    # Static memory, to split a peak-memory error into static vs activation terms: weights, grads and
    # whatever the optimizer allocates up front, then the same after one step (lazily built optimizer
    # states, main grads and grad-reduce buckets exist by then; the step's activations are freed).
    static_before = torch.cuda.memory_allocated(device) if use_cuda else None
    static_after = None
    dp = state.dp  # CP ranks share their micro-batches (each keeps its part of the sequence)
    step_times, phases, losses = [], [], []
    counts = None
    for step in range(warmup_steps + timed_steps):
        batch = global_batch(model.vocab_size, training.seq_length, training.global_batch_size, options.seed, step)
        micro = micro_batches(batch, dp.size, dp.rank, config.micro_batch_size, device)
        timed = step >= warmup_steps
        timer.enabled = timed
        _sync(device)
        if state.config.world_size > 1:
            torch.distributed.barrier()
        if timed and first_timed_at is None:
            first_timed_at = time.time()
        timer.start_step()
        start = time.perf_counter()
        result = trainer.step(micro)  # ends with a host read of the loss: the step is complete
        _sync(device)
        elapsed = time.perf_counter() - start
        step_phases = timer.end_step()
        if step == 0 and use_cuda:
            static_after = torch.cuda.memory_allocated(device)
        if timed:
            step_times.append(elapsed)
            phases.append(step_phases)
            losses.append(result.loss)
            counts = result.tokens_per_expert if counts is None else [a + b for a, b in
                                                                       zip(counts, result.tokens_per_expert)]
            if progress.step_done(step - warmup_steps, elapsed):
                break  # the driver stopped the run (pruned, cancelled): every rank leaves after this step
    trainer.finish_param_gather()  # overlap_param_gather: no collective left running when the rank leaves
    report = {"step_times": step_times, "phases": phases, "losses": losses, "tokens_per_expert": counts or [],
              "pruned": len(step_times) < timed_steps, "static_before_step": static_before,
              "static_after_step": static_after, "groups_at": groups_at, "first_timed_at": first_timed_at}
    if training.precision == "fp8":
        report["fp8"] = _fp8_report(device)
    if use_cuda:
        report.update(peak_allocated=torch.cuda.max_memory_allocated(device),
                      peak_reserved=torch.cuda.max_memory_reserved(device),
                      device_name=torch.cuda.get_device_name(device))
    return report


RANK_MEMORY_KEYS = ("peak_allocated", "peak_reserved", "static_before_step", "static_after_step")


def rank_memory(reports: list[dict]) -> list[dict[str, int | None]]:
    """Every rank's memory figures (bytes, rank order; None where a report lacks one)."""
    return [{k: r.get(k) for k in RANK_MEMORY_KEYS} for r in reports]


def _max_of(reports: list[dict], key: str) -> int | None:
    """The largest value of ``key`` over ranks (the rank that bounds memory), None where none reported it."""
    values = [r[key] for r in reports if r.get(key) is not None]
    return max(values) if values else None


def peak_flops(device_name: str, precision: str, hardware: str | None) -> float | None:
    """The datasheet peak (FLOP/s per GPU) at ``precision`` of the hardware profile ``hardware``, else of
    the one ``device_name`` (a torch device name, or "cpu") points to; None for an unknown device."""
    name = hardware
    if name is None:
        lowered = device_name.lower()
        name = "h200" if "h200" in lowered else "h100" if "h100" in lowered else "a100" if "a100" in lowered \
            else "cpu" if device_name == "cpu" else None
    if name is None:
        return None
    try:
        return get_hardware(name).gpu.peak(precision)
    except CatalogError:
        return None


def _say_how_fp8_ran(reports: list[dict], device_name: str) -> None:
    """Log whether fp8 GEMMs ran on the scaled-GEMM kernels or were emulated (fp8 numerics at fp32 speed)."""
    reasons = sorted({r["fp8"]["emulated_because"] for r in reports if r["fp8"]["emulated_because"]})
    emulated = sum(r["fp8"]["calls"].get("emulated", 0) for r in reports)
    total = sum(sum(r["fp8"]["calls"].values()) for r in reports)
    if reasons:
        log.warning("precision fp8 on %s: GEMMs EMULATED (quantise → dequantise → fp32 matmul; fp8 numerics, "
                    "not fp8 speed): %s", device_name, "; ".join(reasons))
    elif emulated:
        log.warning("precision fp8 on %s: %d of %d fp8 GEMM calls emulated (grouped GEMM dims not multiples "
                    "of 16)", device_name, emulated, total)
    else:
        log.info("precision fp8 on %s: %d fp8 GEMM calls through torch._scaled_mm/_scaled_grouped_mm",
                 device_name, total)
    paths = expert_gemm_paths(reports)
    if paths and paths["bf16"]:
        log.warning("precision fp8 on %s: %d of %d GEMM shapes ran in bf16, where bf16 timed faster "
                    "(ExecutorOptions.fp8_expert_gemm 'fastest' for the routed experts, FOLDTUNE_FP8_DENSE for the "
                    "dense linears): %s", device_name, paths["bf16"],
                    paths["bf16"] + paths["fp8"], "; ".join(paths["bf16_shapes"]))


def profile_layout(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                   options: ExecutorOptions | None = None, warmup_steps: int = 2, timed_steps: int = 5,
                   timeout_s: float = 600.0, device: str = "auto", hardware: str | None = None,
                   launcher=None) -> Measurement:
    """Measure ``config`` on this machine (``device`` 'cuda', 'cpu' or 'auto'); never raises for run failures.

    ``hardware`` names the catalog GPU whose peak MFU is taken against (default: guessed from the device).
    ``launcher`` replaces :func:`executor.launch_local.launch` (same signature), e.g. the Ray launcher.
    """
    options = options or ExecutorOptions.for_training(training, model=model)  # the model's router defaults
    context = {"model": model.name, "layout": config.label(), "world_size": config.world_size,
               "precision": training.precision, "seq_length": training.seq_length,
               "global_batch_size": training.global_batch_size}
    try:
        check_buildable(model, training, config)  # the rule book, once, before any rank starts
        options_for_precision(options, training.precision)  # a backend without an fp8 variant fails here
    except FoldtuneError as exc:
        return Measurement.failed(str(exc), **context)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available()
                                    and torch.cuda.device_count() >= config.world_size)
    if use_cuda and launcher is None and torch.cuda.device_count() < config.world_size:
        return Measurement.failed(f"layout needs {config.world_size} GPUs, this machine has "
                                  f"{torch.cuda.device_count()}", **context)
    dispatched_at = time.time()
    launched = (launcher or launch_local)(profile_worker, config.world_size,
                      (model, training, config, options, warmup_steps, timed_steps, use_cuda),
                      backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s)
    if not launched.ok:
        return Measurement.failed(launched.failure_reason, launched.failure_kind or FailureKind.ERROR,
                                  placement=list(getattr(launched, "placement", None) or []),
                                  run_window=list(getattr(launched, "run_window", None) or []),
                                  reused_ranks=getattr(launched, "reused", None), **context)
    reports = launched.results
    if training.precision == "fp8":
        _say_how_fp8_ran(reports, device_name=reports[0].get("device_name", "cpu"))
    flops = flops_per_step(model, training.seq_length, training.global_batch_size,
                           training.document_attention_share())
    return measurement_from_reports(launched, training, config.world_size, flops, hardware, use_cuda, dispatched_at,
                                    context)


def measurement_from_reports(launched, training: TrainingSpec, world_size: int, flops: float, hardware: str | None,
                             use_cuda: bool, dispatched_at: float, context: dict) -> Measurement:
    """Fold the ranks' :func:`profile_worker`-shaped reports of a successful launch into a Measurement: the
    step time is each step's slowest rank, then the median over steps (seconds); ``flops`` per optimizer step
    gives TFLOP/s and MFU."""
    reports = launched.results
    per_step = [max(r["step_times"][i] for r in reports) for i in range(min(len(r["step_times"]) for r in reports))]
    step_time = statistics.median(per_step)
    by_rank = []
    for report in reports:
        names = sorted({k for p in report["phases"] for k in p})
        by_rank.append({k: statistics.median(p.get(k, 0.0) for p in report["phases"]) for k in names})
    phases = by_rank[0]
    device_name = reports[0].get("device_name", "cpu")
    peak = peak_flops(device_name, training.precision, hardware)
    return Measurement(
        ok=True, device=device_name, step_time=step_time, step_times=per_step, phases=phases,
        tokens_per_s_per_gpu=training.global_batch_size * training.seq_length / step_time / world_size,
        tflops_per_gpu=tflops_per_gpu(flops, step_time, world_size),
        mfu=mfu(flops, step_time, world_size, peak) if peak else None,
        peak_allocated_bytes=max(r["peak_allocated"] for r in reports) if use_cuda else None,
        peak_reserved_bytes=max(r["peak_reserved"] for r in reports) if use_cuda else None,
        static_allocated_bytes=_max_of(reports, "static_before_step"),
        static_after_step_allocated_bytes=_max_of(reports, "static_after_step"),
        tokens_per_expert=reports[0]["tokens_per_expert"], phases_by_rank=by_rank, losses=reports[0]["losses"],
        memory_by_rank=rank_memory(reports) if use_cuda else [],
        pruned=any(r.get("pruned", False) for r in reports),
        placement=list(getattr(launched, "placement", None) or []),
        run_window=list(getattr(launched, "run_window", None) or []),
        reused_ranks=getattr(launched, "reused", None),
        fp8_expert_gemms=expert_gemm_paths(reports) if training.precision == "fp8" else None,
        **fixed_cost(reports, dispatched_at), **context)


def fixed_cost(reports: list[dict], dispatched_at: float) -> dict[str, float | None]:
    """A trial's fixed cost from the ranks' reports (seconds; see :class:`Measurement`): dispatch to the
    last rank's first timed step, split at the moment the last rank had its process groups. Clocks of
    several nodes may disagree by a little: each part is clamped at 0."""
    began = [r.get("groups_at") for r in reports]
    first = [r.get("first_timed_at") for r in reports]
    if not reports or None in began or None in first:
        return {"fixed_cost_s": None, "startup_s": None, "warmup_s": None}
    startup = max(0.0, max(began) - dispatched_at)
    total = max(startup, max(first) - dispatched_at)
    return {"fixed_cost_s": total, "startup_s": startup, "warmup_s": total - startup}
