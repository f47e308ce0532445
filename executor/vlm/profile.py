"""Profile one multimodal layout (homogeneous, colocated or separate, within executor_vl_layout's limits):
warm-up then timed optimizer steps of :mod:`executor.vlm.train`'s trainers on synthetic image+text batches → a
Measurement, as :func:`executor.profile.profile_layout` measures a text-only layout (same launchers, same report
shape).

A separate layout runs on its whole world (the LLM's ranks, then the encoder's): per GPU figures divide by it,
and each step's time is its slowest rank's. The FLOPs behind TFLOP/s and MFU are the LLM's alone (spec.flops
counts no encoder): the encoder's share is left out of them, not guessed.
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
from executor.vlm.separate import SeparatePlacement, encoder_groups as separate_encoder_groups
from executor.vlm.train import (SeparateEncoderTrainer, SeparateLLMTrainer, VLTrainer, mrope_section_for,
                                synthetic_micro_batches)


def build_vl_rank(spec: VisionLanguageSpec, training: TrainingSpec, layout: MultimodalLayout, rank: int,
                  options: ExecutorOptions, device, lr: float = 1e-3):
    """This rank's model and trainer: the LLM's groups of ``layout.llm``, the encoder's TP and DP groups over
    the same ranks (homogeneous: the LLM's tp; colocated: its own enc_tp), or, separate, over the encoder's
    own ranks after the LLM's: there an LLM rank builds the LLM alone (:class:`SeparateLLMTrainer`), an encoder
    rank the encoder alone (:class:`SeparateEncoderTrainer`). Every rank must call it (it creates every
    process group). The encoder's weights are drawn from ``options.seed``, the LLM's from ``options.seed + 1``:
    alike whichever ranks hold them."""
    if training.precision not in DTYPES or training.precision == "fp8":
        raise FoldtuneError(f"precision {training.precision!r}: the vision-language step runs fp32, bf16 or fp16")
    state = build_parallel_state(layout.llm, rank)
    kw = dict(device=device, dtype=DTYPES[training.precision], llm_seed=options.seed + 1)
    rope = mrope_section_for(spec.llm.rotary_head_dim // 2)
    if layout.placement == "separate":
        placement = SeparatePlacement(layout.llm.world_size, layout.encoder_tp, layout.encoder_dp)
        enc_tp, enc_dp = separate_encoder_groups(placement, rank)
        torch.manual_seed(options.seed)
        if placement.is_encoder(rank):
            model = VisionLanguageMoE(spec, state, options, training.seq_length, rope, encoder_group=enc_tp,
                                      parts="encoder", **kw)
            return model, SeparateEncoderTrainer(model, placement, rank, layout.llm, enc_tp, enc_dp, lr=lr)
        model = VisionLanguageMoE(spec, state, options, training.seq_length, rope, parts="llm", **kw)
        return model, SeparateLLMTrainer(model, placement, rank, lr=lr)
    enc_tp, enc_dp = encoder_groups(layout.llm.world_size, layout.encoder_tp, rank)
    torch.manual_seed(options.seed)  # every encoder replica starts from the same weights
    model = VisionLanguageMoE(spec, state, options, training.seq_length, rope, encoder_group=enc_tp, **kw)
    return model, VLTrainer(model, enc_dp, lr=lr)


def rank_micro_batches(trainer, spec: VisionLanguageSpec, images: ImageInputs, training: TrainingSpec,
                       layout: MultimodalLayout, seed: int, step: int, device) -> list[list]:
    """The synthetic micro-batches of step ``step`` for each LLM data-parallel rank whose samples ``trainer``
    reads (:attr:`data_dp_ranks`)."""
    return [synthetic_micro_batches(spec, images, training.seq_length, training.global_batch_size,
                                    layout.llm.micro_batch_size, layout.llm.dp, dp_rank, seed, step, device)
            for dp_rank in trainer.data_dp_ranks]


def vl_profile_worker(rank: int, world_size: int, spec: VisionLanguageSpec, training: TrainingSpec,
                      images: ImageInputs, layout: MultimodalLayout, options: ExecutorOptions, warmup_steps: int,
                      timed_steps: int, use_cuda: bool) -> dict:
    """One rank: build, run warm-up and timed steps, report as :func:`executor.profile.profile_worker` does."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    model, trainer = build_vl_rank(spec, training, layout, rank, options, device)
    groups_at, first_timed_at = time.time(), None
    step_times, losses, counts = [], [], None
    for step in range(warmup_steps + timed_steps):
        micro = rank_micro_batches(trainer, spec, images, training, layout, options.seed, step, device)
        timed = step >= warmup_steps
        _sync(device)
        if world_size > 1:
            torch.distributed.barrier()
        if timed and first_timed_at is None:
            first_timed_at = time.time()
        start = time.perf_counter()
        result = trainer.step_data(micro)
        _sync(device)
        elapsed = time.perf_counter() - start
        if timed:
            step_times.append(elapsed)
            if result is not None:  # an encoder rank of the separate placement knows no loss
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
    refused = executor_multimodal_rules(layout, spec)
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
