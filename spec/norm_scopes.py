"""q/k norm scopes: what ``ModelSpec.qk_layernorm``'s RMSNorms span, one declarative entry per scope.

A :class:`NormScope` says how wide each of the two norms' weights is and whether those weights split over
TP with the heads; the cost model prices the parameters, the per-token sums over TP and the element-wise
work from that alone, and the executor builds the scope's module from its registry
(``executor.qk_norms.QK_NORM_MODULES``), keyed by the same name; ``tests/test_feature_registry.py`` checks
that it holds exactly the scopes registered here. ``ModelSpec.qk_layernorm_scope`` names the scope.

Scopes: ``head`` (Qwen3: each head's d values, weights [d] whole on every TP rank) and ``all`` (OLMoE: a
token's whole q and k before the head split, weights [heads·d] and [kv_heads·d] split with the heads, the
mean square summed over TP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec.registry import Registry

Model = Any  # a spec.model_spec.ModelSpec (not imported: model_spec imports this module)


@dataclass(frozen=True)
class NormScope:
    """``weight_widths(model)``: elements of the q norm's and the k norm's weights (whole model, all heads).
    ``split_with_heads``: the weights (and each normalised row) split over TP with the heads, so every row's
    mean square is summed over TP (one fp32 value per token and norm, forward and backward); otherwise every
    TP rank holds the whole weights and normalises rows of its own heads. ``hf_model_type``: the Hugging Face
    family whose q/k norms have this scope (the config a spec with it is written as)."""

    name: str
    summary: str
    weight_widths: Callable[[Model], tuple[int, int]]
    split_with_heads: bool
    hf_model_type: str


#: name -> scope; ``ModelSpec.qk_layernorm_scope`` must be one of these names
QK_NORM_SCOPES: Registry[NormScope] = Registry("q/k norm scope")


def qk_norm_scope(model: Model) -> NormScope:
    """The scope of ``model``'s q/k norms (``qk_layernorm_scope``; meaningful with ``qk_layernorm``)."""
    return QK_NORM_SCOPES[model.qk_layernorm_scope]


QK_NORM_SCOPES.add("head", NormScope(
    "head", "one RMSNorm over each head's d values (Qwen3)",
    weight_widths=lambda m: (m.head_dim, m.head_dim), split_with_heads=False, hf_model_type="qwen3_moe"))
QK_NORM_SCOPES.add("all", NormScope(
    "all", "one RMSNorm over a token's whole q and whole k before the head split (OLMoE)",
    weight_widths=lambda m: (m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim),
    split_with_heads=True, hf_model_type="olmoe"))
