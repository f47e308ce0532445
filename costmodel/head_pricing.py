"""What one block of each head feature costs beyond its decoder layer and its output heads.

One :class:`HeadPricing` per feature of ``spec.head_features``, registered under the feature's name in
:data:`PRICING`; :func:`head_pricing` returns a feature's. A head block is its own work, one decoder layer of
the model's last layer's kind and ``output_heads_per_block`` output heads (the feature contract); the cost
model's modules price the layer and the heads as they price the decoder's and ask the feature's pricing for
the rest: :mod:`costmodel.params` (parameter counts), :mod:`costmodel.memory` (stored activations) and
:mod:`costmodel.step_time` (GEMMs, element-wise passes, collectives). ``tests/test_feature_registry.py``
checks that every spec-level feature has an entry here.
"""

from __future__ import annotations

from typing import Any

from costmodel.per_model import norm_params
from spec.errors import InvalidConfigError
from spec.head_features import MTP, HeadFeature
from spec.model_spec import ModelSpec
from spec.registry import Registry
from spec.training_spec import TrainingSpec


class HeadPricing:
    """The cost model's part of one head feature's block (its own work only). ``parts`` (time) is
    costmodel.step_time's layer pricer, whose ``embedding``, ``norm``, ``tp_block_comm`` and ``linear`` add to
    ``block``."""

    def params(self, model: ModelSpec, tp: int) -> tuple[int, int]:
        """(TP-sharded, TP-replicated) parameters of one block's own work on one TP rank."""
        raise NotImplementedError

    def activation_bytes(self, model: ModelSpec, training: TrainingSpec, sp_split: int) -> float:
        """Bytes per token one block's own work stores for backward; ``sp_split`` divides what sequence
        parallelism shards (tp with SP, else 1)."""
        raise NotImplementedError

    def own_time(self, parts: Any, block: Any) -> None:
        """Add one block's own work (kernels and collectives) to ``block``."""
        raise NotImplementedError


class MTPPricing(HeadPricing):
    """A multi-token-prediction depth: the shifted tokens' embedding, enorm and hnorm over the concatenated
    ``2h``, the ``2h → h`` projection (column-parallel over TP), its final norm."""

    def params(self, model: ModelSpec, tp: int) -> tuple[int, int]:
        h = model.hidden_size
        return 2 * h * h // tp, 3 * norm_params(model, h)

    def activation_bytes(self, model: ModelSpec, training: TrainingSpec, sp_split: int) -> float:
        # h-wide tensors per token: the shifted tokens' embedding and the hidden input (the norms' inputs), their
        # concatenation (the projection's input, 2h) and the final norm's input
        return 5 * model.hidden_size * training.activation_bytes / sp_split

    def own_time(self, parts: Any, block: Any) -> None:
        h, t, ab, tp = parts.model.hidden_size, parts.tokens, parts.act_bytes, parts.tp
        parts.embedding(block)
        parts.norm(block, 2 * h, ())
        parts.tp_block_comm(block, t * 2 * h * ab, t * h * ab)
        parts.linear(block, t, h / tp, 2 * h)


#: feature name -> its pricing
PRICING: Registry[HeadPricing] = Registry("head feature pricing")
PRICING.add(MTP.name, MTPPricing())


def head_pricing(feature: HeadFeature) -> HeadPricing:
    """The pricing of ``feature``; InvalidConfigError when the cost model has none."""
    pricing = PRICING.get(feature.name)
    if pricing is None:
        raise InvalidConfigError(f"the cost model cannot price the head feature {feature.name!r} ({feature.label})")
    return pricing
