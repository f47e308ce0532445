"""The executor's q/k norm module per scope of ``spec.norm_scopes``, registered under the scope's name.

:func:`make_qk_norm` builds the one a model's ``qk_layernorm_scope`` names (None without ``qk_layernorm``).
A module holds the two weights, named ``layers.{layer}.attention.q_norm.weight`` / ``k_norm.weight`` (the
Hugging Face names map one to one), and its ``forward(q, k)`` normalises this rank's projected q
[s, b, heads/tp · d] and k [s, b, kv_heads/tp · d] before the head split, returning both in the same shape.
``tests/test_feature_registry.py`` checks that this registry holds exactly the spec's scopes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.kernels.base import KernelBackend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.parallel.groups import ParallelState
from executor.tp_rms_norm import tp_rms_norm
from spec.model_spec import ModelSpec
from spec.norm_scopes import qk_norm_scope
from spec.registry import Registry


class PerHeadQKNorm(torch.nn.Module):
    """Qwen3: one RMSNorm over each head's d values; weights [d], whole on every TP rank (their gradients
    cover this rank's heads only: ``tp_partial``)."""

    def __init__(self, spec: ModelSpec, param: Callable, kernels: KernelBackend, state: ParallelState,
                 eps: float, fused: bool = True) -> None:
        super().__init__()
        # the fused kernel where it runs: torch's path keeps an fp32 copy and casts each way
        self.rms_norm, self.eps, self.d = pick_rms_norm(fused, kernels), eps, spec.head_dim
        self.q_norm = param("q_norm.weight", (self.d,), "ones", tp_partial=True)
        self.k_norm = param("k_norm.weight", (self.d,), "ones", tp_partial=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, b = q.shape[:2]
        q = self.rms_norm(q.view(s, b, -1, self.d), self.q_norm, self.eps)
        k = self.rms_norm(k.view(s, b, -1, self.d), self.k_norm, self.eps)
        return q.view(s, b, -1), k.view(s, b, -1)


class WholeWidthQKNorm(torch.nn.Module):
    """OLMoE: one RMSNorm over a token's whole q (heads·d) and whole k (kv_heads·d); the weights split over TP
    with the heads and every row's mean square summed over TP (:mod:`executor.tp_rms_norm`)."""

    def __init__(self, spec: ModelSpec, param: Callable, kernels: KernelBackend, state: ParallelState,
                 eps: float, fused: bool = True) -> None:
        super().__init__()
        self.tp, self.eps = state.tp, eps  # its own norm (a mean square summed over TP): ``fused`` has no say
        self.q_width, self.k_width = qk_norm_scope(spec).weight_widths(spec)
        self.q_norm = param("q_norm.weight", (self.q_width,), "ones", tp_dim=0)
        self.k_norm = param("k_norm.weight", (self.k_width,), "ones", tp_dim=0)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (tp_rms_norm(q, self.q_norm, self.q_width, self.eps, self.tp),
                tp_rms_norm(k, self.k_norm, self.k_width, self.eps, self.tp))


#: scope name -> module class, called as ``cls(spec, param, kernels, state, eps, fused)`` with ``param(name,
#: shape, init, **shard_kwargs)`` making one of the attention's parameters and ``fused`` the executor's
#: ``fused_rms_norm``
QK_NORM_MODULES: Registry[type[torch.nn.Module]] = Registry("q/k norm module")
QK_NORM_MODULES.add("head", PerHeadQKNorm)
QK_NORM_MODULES.add("all", WholeWidthQKNorm)


def make_qk_norm(spec: ModelSpec, param: Callable, kernels: KernelBackend, state: ParallelState,
                 eps: float, fused: bool = True) -> torch.nn.Module | None:
    """The q/k norms of ``spec``'s scope, or None when the model has none (``qk_layernorm`` off); ``fused``:
    the fused RMSNorm kernel where it runs (``ExecutorOptions.fused_rms_norm``)."""
    if not spec.qk_layernorm:
        return None
    return QK_NORM_MODULES[qk_norm_scope(spec).name](spec, param, kernels, state, eps, fused)
