"""Train a vision-language MoE model on an image+text dataset (:mod:`executor.vlm.dataset`) under a multimodal
layout (homogeneous, colocated or separate): the LLM's cosine learning-rate schedule
(:class:`executor.train.loop.TrainConfig`) applied to every optimizer of the rank's trainer
(:mod:`executor.vlm.train`), one global gradient norm over the LLM's and the encoder's parameters clipped and
reported (:class:`executor.vlm.train.VLGradClipper`), a held-out evaluation at ``eval_every`` and at the end,
every step's :class:`~executor.train.loop.StepMetrics` handed to ``on_step``, and checkpoints every
``checkpoint_every`` steps and at the end (:mod:`executor.vlm.checkpoint`, the newest ``keep_last`` kept); a run
whose checkpoint directory holds one resumes from it."""

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
from executor.train.checkpoint import latest_checkpoint
from executor.train.loop import StepMetrics, TrainConfig, TrainReport, step_metrics
from executor.train.optim_state import set_lr
from executor.train.retention import prune_checkpoints
from executor.vlm.checkpoint import load_vl_checkpoint, save_vl_checkpoint
from executor.vlm.dataset import VLDataset
from executor.vlm.profile import build_vl_rank
from executor.vlm.separate import llm_eval_microbatch


def _micro(dataset: VLDataset, spec: VisionLanguageSpec, split: str, position: int, cfg: TrainConfig, dp_size: int,
           dp_rank: int, mbs: int, device) -> list:
    rows = dataset.rank_rows(split, position, cfg.global_batch_size, dp_size, dp_rank)
    return [dataset.batch(spec, rows[i:i + mbs], device) for i in range(0, len(rows), mbs)]


def _rank_micro(trainer, dataset: VLDataset, spec: VisionLanguageSpec, split: str, position: int, cfg: TrainConfig,
                layout: MultimodalLayout, device) -> list[list]:
    """The micro-batches of every LLM data-parallel rank whose samples this rank reads (``data_dp_ranks``)."""
    return [_micro(dataset, spec, split, position, cfg, layout.llm.dp, d, layout.llm.micro_batch_size, device)
            for d in trainer.data_dp_ranks]


def _evaluate(model, trainer, dataset: VLDataset, spec: VisionLanguageSpec, cfg: TrainConfig,
              layout: MultimodalLayout, device) -> float | None:
    """Mean cross-entropy (nats/token) over the held-out split's first ``cfg.eval_batches`` global batches
    (at least one), averaged over the LLM's DP·CP ranks; None on an encoder rank of the separate placement
    (it encodes the images for the LLM's ranks)."""
    batches = max(1, min(cfg.eval_batches, dataset.heldout // cfg.global_batch_size))
    if model.llm is None:
        model.eval()
        for position in range(batches):
            trainer.evaluate_data(_rank_micro(trainer, dataset, spec, "heldout", position, cfg, layout, device))
        model.train()
        return None
    state = model.state
    separate = layout.placement == "separate"
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    for position in range(batches):
        micro = _rank_micro(trainer, dataset, spec, "heldout", position, cfg, layout, device)[0]
        if trainer.pipelined:  # the model runs inside the schedule only: its gradients are dropped
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()
            stats = trainer.forward_backward(micro)  # the last stage's mean ce, zero elsewhere
            trainer.reducer.reduce()
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()
            total += all_reduce_(stats[0].detach().double(), state["pp"])
            continue
        with torch.no_grad():
            if separate:
                ces = [llm_eval_microbatch(model, trainer.placement, trainer.rank, b).ce for b in micro]
            else:
                ces = [model(b).ce for b in micro]
            total += sum(ce.double() for ce in ces) / len(micro)
    with torch.no_grad():
        total = all_reduce_(total / batches, state["dp_cp"]) / state["dp_cp"].size
    model.train()
    return float(total)


def vl_train_worker(rank: int, world_size: int, spec: VisionLanguageSpec, layout: MultimodalLayout,
                    options: ExecutorOptions, cfg: TrainConfig,
                    on_step: Callable[[int, StepMetrics], None] | None = None, use_cuda: bool = False) -> TrainReport:
    """One rank of a run (fp32 on CPU, bf16 on CUDA) over the layout's whole world (separate: the LLM's ranks,
    then the encoder's). ``on_step(rank, metrics)`` is called after each step on the LLM's ranks (an encoder
    rank of the separate placement knows no loss); the report of such a rank holds no metrics."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dataset = VLDataset.load(cfg.data_path)
    dataset.check(spec)
    training = TrainingSpec(seq_length=cfg.seq_length, global_batch_size=cfg.global_batch_size,
                            precision="bf16" if use_cuda else "fp32")
    model, trainer = build_vl_rank(spec, training, layout, rank, options, device, lr=cfg.lr)
    trainer.enable_clipping(cfg.max_grad_norm)
    schedule = cfg.schedule()
    report = TrainReport(0, None, None)
    latest = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if latest is not None:
        resumed = load_vl_checkpoint(latest, model, trainer, spec.name)
        report.start_step, report.resumed_from, report.resumed_layout = resumed.step, resumed.path, resumed.saved_layout
    else:
        report.initial_eval_loss = _evaluate(model, trainer, dataset, spec, cfg, layout, device)
    flops = flops_per_step(spec.llm, cfg.seq_length, cfg.global_batch_size)  # the LLM's: spec.flops has no encoder
    for step in range(report.start_step, cfg.steps):
        lr = schedule.at(step)
        for optimizer in trainer.optimizers:
            set_lr(optimizer, lr)
        micro = _rank_micro(trainer, dataset, spec, "train", step, cfg, layout, device)
        start = time.perf_counter()
        result = trainer.step_data(micro)
        elapsed = time.perf_counter() - start
        last = step + 1 == cfg.steps
        evaluate = last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
        if result is None:  # an encoder rank: its part of the evaluation, no metrics
            if evaluate:
                _evaluate(model, trainer, dataset, spec, cfg, layout, device)
        else:
            metrics = step_metrics(step, result, lr, trainer.grad_norm, elapsed, cfg, flops, world_size,
                                   list(model.llm.moe_layer_numbers),
                                   torch.cuda.max_memory_allocated(device) if use_cuda else None)
            if evaluate:
                metrics.eval_loss = _evaluate(model, trainer, dataset, spec, cfg, layout, device)
            if report.metrics:
                report.metrics[-1].moe_layers, report.metrics[-1].expert_tokens = [], []
            report.metrics.append(metrics)
            if on_step is not None:
                on_step(rank, metrics)
        if cfg.checkpoint_dir and (last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
            path = save_vl_checkpoint(cfg.checkpoint_dir, step + 1, model, trainer, layout.label(), spec.name)
            report.checkpoints.append(str(path))
            if rank == 0:  # after the save: `latest` names the new checkpoint on every rank's return
                prune_checkpoints(cfg.checkpoint_dir, cfg.keep_last)
    if model.llm is not None:
        trainer.finish_param_gather()
    return report
