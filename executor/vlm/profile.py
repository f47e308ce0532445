"""Profile one multimodal layout (homogeneous or colocated, the LLM at pp = 1): warm-up then timed optimizer
steps of :class:`executor.vlm.train.VLTrainer` on synthetic image+text batches → a Measurement, as
:func:`executor.profile.profile_layout` measures a text-only layout (same launchers, same report shape).

The FLOPs behind TFLOP/s and MFU are the LLM's alone (spec.flops counts no encoder): the encoder's share is left
out of them, not guessed.
"""

from __future__ import annotations

import time

import torch

from spec.errors import FoldtuneError
from spec.failure import FailureKind
from spec.flops import flops_per_step
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.validity import executor_multimodal_rules
from executor import progress
from executor.launch_local import launch as launch_local
from executor.measurement import Measurement
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.profile import DTYPES, _sync, measurement_from_reports
from executor.vlm.boundary import encoder_groups
from executor.vlm.model import VisionLanguageMoE
from executor.vlm.train import VLTrainer, mrope_section_for, synthetic_micro_batches


def build_vl_rank(spec: VisionLanguageSpec, training: TrainingSpec, layout: MultimodalLayout, rank: int,
                  options: ExecutorOptions, device, lr: float = 1e-3) -> tuple[VisionLanguageMoE, VLTrainer]:
    """This rank's model and trainer: the LLM's groups of ``layout.llm``, the encoder's TP and DP groups over
    the same ranks (homogeneous: the LLM's tp; colocated: its own enc_tp). Every rank must call it (it creates
    every process group)."""
    if training.precision not in DTYPES or training.precision == "fp8":
        raise FoldtuneError(f"precision {training.precision!r}: the vision-language step runs fp32, bf16 or fp16")
    state = build_parallel_state(layout.llm, rank)
    enc_tp, enc_dp = encoder_groups(layout.llm.world_size, layout.encoder_tp, rank)
    torch.manual_seed(options.seed)  # every encoder replica starts from the same weights
    model = VisionLanguageMoE(spec, state, options, training.seq_length,
                              mrope_section_for(spec.llm.rotary_head_dim // 2), device=device,
                              dtype=DTYPES[training.precision], encoder_group=enc_tp)
    return model, VLTrainer(model, enc_dp, lr=lr)


def vl_profile_worker(rank: int, world_size: int, spec: VisionLanguageSpec, training: TrainingSpec,
                      images: ImageInputs, layout: MultimodalLayout, options: ExecutorOptions, warmup_steps: int,
                      timed_steps: int, use_cuda: bool) -> dict:
    """One rank: build, run warm-up and timed steps, report as :func:`executor.profile.profile_worker` does."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    model, trainer = build_vl_rank(spec, training, layout, rank, options, device)
    groups_at, first_timed_at = time.time(), None
    dp = model.state.dp
    step_times, losses, counts = [], [], None
    for step in range(warmup_steps + timed_steps):
        micro = synthetic_micro_batches(spec, images, training.seq_length, training.global_batch_size,
                                        layout.llm.micro_batch_size, dp.size, dp.rank, options.seed, step, device)
        timed = step >= warmup_steps
        _sync(device)
        if world_size > 1:
            torch.distributed.barrier()
        if timed and first_timed_at is None:
            first_timed_at = time.time()
        start = time.perf_counter()
        result = trainer.step(micro)
        _sync(device)
        elapsed = time.perf_counter() - start
        if timed:
            step_times.append(elapsed)
            losses.append(result.loss)
            counts = result.tokens_per_expert if counts is None else [a + b for a, b in
                                                                       zip(counts, result.tokens_per_expert)]
            if progress.step_done(step - warmup_steps, elapsed):
                break
    report = {"step_times": step_times, "phases": [{} for _ in step_times], "losses": losses,
              "tokens_per_expert": counts or [], "pruned": len(step_times) < timed_steps,
              "static_before_step": None, "static_after_step": None, "groups_at": groups_at,
              "first_timed_at": first_timed_at}
    if use_cuda:
        report.update(peak_allocated=torch.cuda.max_memory_allocated(device),
                      peak_reserved=torch.cuda.max_memory_reserved(device),
                      device_name=torch.cuda.get_device_name(device))
    return report


def profile_vl_layout(spec: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs,
                      layout: MultimodalLayout, options: ExecutorOptions | None = None, warmup_steps: int = 2,
                      timed_steps: int = 5, timeout_s: float = 600.0, device: str = "auto",
                      hardware: str | None = None, launcher=None) -> Measurement:
    """Measure ``layout`` of ``spec`` (never raises for run failures; a layout the executor does not run comes
    back failed with the rule it breaks). Arguments as :func:`executor.profile.profile_layout`'s."""
    options = options or ExecutorOptions.for_training(training, model=spec.llm)
    world = layout.world_size
    context = {"model": spec.name, "layout": layout.label(), "world_size": world, "precision": training.precision,
               "seq_length": training.seq_length, "global_batch_size": training.global_batch_size}
    refused = executor_multimodal_rules(layout)
    if refused:
        return Measurement.failed("; ".join(f"{r.rule}: {r.reason}" for r in refused), FailureKind.ERROR,
                                  **context)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available()
                                    and torch.cuda.device_count() >= world)
    dispatched_at = time.time()
    launched = (launcher or launch_local)(vl_profile_worker, world,
                                          (spec, training, images, layout, options, warmup_steps, timed_steps,
                                           use_cuda), backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s)
    if not launched.ok:
        return Measurement.failed(launched.failure_reason, launched.failure_kind or FailureKind.ERROR,
                                  placement=list(getattr(launched, "placement", None) or []),
                                  run_window=list(getattr(launched, "run_window", None) or []),
                                  reused_ranks=getattr(launched, "reused", None), **context)
    flops = flops_per_step(spec.llm, training.seq_length, training.global_batch_size)
    return measurement_from_reports(launched, training, world, flops, hardware, use_cuda, dispatched_at, context)
