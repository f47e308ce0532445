"""Train a vision-language MoE model on an image+text dataset (:mod:`executor.vlm.dataset`) under a homogeneous
or colocated multimodal layout: the LLM's cosine learning-rate schedule (:class:`executor.train.loop.TrainConfig`)
applied to both optimizers of :class:`executor.vlm.train.VLTrainer`, the LLM's gradient norm clipped and reported
as the text-only loop does, a held-out evaluation at ``eval_every`` and at the end, every step's
:class:`~executor.train.loop.StepMetrics` handed to ``on_step``.

Not yet: checkpoints (a vision-language training writes none; the service refuses checkpoint_every > 0) and
clipping the encoder's gradients (its norm is not part of the reported one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from spec.flops import flops_per_step
from spec.multimodal import VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_reduce_
from executor.train.grad_norm import GradClipper
from executor.train.loop import StepMetrics, TrainConfig, TrainReport, step_metrics
from executor.train.optim_state import set_lr
from executor.vlm.dataset import VLDataset
from executor.vlm.profile import build_vl_rank


def _micro(dataset: VLDataset, spec: VisionLanguageSpec, split: str, position: int, cfg: TrainConfig, dp, mbs: int,
           device) -> list:
    rows = dataset.rank_rows(split, position, cfg.global_batch_size, dp.size, dp.rank)
    return [dataset.batch(spec, rows[i:i + mbs], device) for i in range(0, len(rows), mbs)]


def _evaluate(model, dataset: VLDataset, spec: VisionLanguageSpec, cfg: TrainConfig, mbs: int, device) -> float:
    """Mean cross-entropy (nats/token) over the held-out split's first ``cfg.eval_batches`` global batches
    (at least one), averaged over the LLM's DP·CP ranks."""
    state = model.state
    batches = max(1, min(cfg.eval_batches, dataset.heldout // cfg.global_batch_size))
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for position in range(batches):
            micro = _micro(dataset, spec, "heldout", position, cfg, state.dp, mbs, device)
            total += sum(model(b).ce.double() for b in micro) / len(micro)
        total = all_reduce_(total / batches, state["dp_cp"]) / state["dp_cp"].size
    model.train()
    return float(total)


def vl_train_worker(rank: int, world_size: int, spec: VisionLanguageSpec, layout: MultimodalLayout,
                    options: ExecutorOptions, cfg: TrainConfig,
                    on_step: Callable[[int, StepMetrics], None] | None = None, use_cuda: bool = False) -> TrainReport:
    """One rank of a run (fp32 on CPU, bf16 on CUDA). ``on_step(rank, metrics)`` is called after each step."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dataset = VLDataset.load(cfg.data_path)
    dataset.check(spec)
    training = TrainingSpec(seq_length=cfg.seq_length, global_batch_size=cfg.global_batch_size,
                            precision="bf16" if use_cuda else "fp32")
    model, trainer = build_vl_rank(spec, training, layout, rank, options, device, lr=cfg.lr)
    clipper = GradClipper(model.llm, model.state, trainer.reducer)
    norms: list[float] = []
    optimizer_step = trainer.optimizer.step

    def clipped_step(*args, **kwargs):  # the LLM's trainer calls this right after its gradient reduction
        norms.append(clipper.clip(cfg.max_grad_norm))
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = clipped_step
    schedule = cfg.schedule()
    mbs = layout.llm.micro_batch_size
    report = TrainReport(0, None, None)
    report.initial_eval_loss = _evaluate(model, dataset, spec, cfg, mbs, device)
    flops = flops_per_step(spec.llm, cfg.seq_length, cfg.global_batch_size)  # the LLM's: spec.flops has no encoder
    for step in range(cfg.steps):
        lr = schedule.at(step)
        set_lr(trainer.optimizer, lr)
        set_lr(trainer.encoder_optimizer, lr)
        micro = _micro(dataset, spec, "train", step, cfg, model.state.dp, mbs, device)
        start = time.perf_counter()
        result = trainer.step(micro)
        elapsed = time.perf_counter() - start
        metrics = step_metrics(step, result, lr, norms[-1], elapsed, cfg, flops, world_size,
                               list(model.llm.moe_layer_numbers),
                               torch.cuda.max_memory_allocated(device) if use_cuda else None)
        if step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
            metrics.eval_loss = _evaluate(model, dataset, spec, cfg, mbs, device)
        if report.metrics:
            report.metrics[-1].moe_layers, report.metrics[-1].expert_tokens = [], []
        report.metrics.append(metrics)
        if on_step is not None:
            on_step(rank, metrics)
    trainer.finish_param_gather()
    return report
