"""Activation recomputation: which parts of a layer re-run their forward during backward.

``recompute_granularity='selective'`` checkpoints the modules named in ``recompute_modules`` (core_attn: the
attention kernel; moe_act: the experts' SwiGLU activation; layernorm: the RMSNorms; mlp: a dense layer's MLP;
shared_experts; moe: the whole MoE block). ``'full'`` checkpoints whole decoder layers: the first
``recompute_num_layers`` of each pipeline stage (0 = all of them). Checkpointing is torch's non-reentrant
``torch.utils.checkpoint``; collectives inside a recomputed region re-run in the same order on every rank.
:func:`run` also offloads a module's saved activations to the CPU instead (``executor.offload``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint

from executor import offload as _offload
from spec.parallel_config import ParallelConfig


def selective(config: ParallelConfig, module: str) -> bool:
    """Whether ``module`` (a Megatron recompute_modules name) is recomputed under ``config``."""
    return config.recompute_granularity == "selective" and module in config.recompute_modules


def full_layer(config: ParallelConfig, stage_index: int) -> bool:
    """Whether the ``stage_index``-th decoder layer of its pipeline stage is recomputed whole."""
    if config.recompute_granularity != "full":
        return False
    return config.recompute_num_layers == 0 or stage_index < config.recompute_num_layers


def run(enabled: bool, fn: Callable, *args, offload: bool = False):
    """``fn(*args)``, keeping only its inputs for backward when ``enabled`` (and autograd is recording); with
    ``offload`` instead, keeping what it saves in CPU memory (:mod:`executor.offload`)."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    if offload and torch.is_grad_enabled():
        with _offload.hooks():
            return fn(*args)
    return fn(*args)


def recomputing() -> bool:
    """True while a backward pass runs (a checkpointed forward re-running): skip side effects then."""
    return torch._C._current_graph_task_id() != -1
