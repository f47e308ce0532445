"""Head features: blocks a model runs after its decoder, on the last pipeline stage, each its own registry entry.

A :class:`HeadFeature` bundles what the spec layer knows of one: how many blocks a model has (its depth), the
FLOPs of a block's own work, how many output heads a block adds, whether its blocks read the word embedding,
and its Hugging Face config key (its tensors are not mapped: transformers builds no MTP, so
:mod:`executor.hf.names` neither loads nor exports them). Every
block of a head feature holds one decoder layer of the model's last decoder layer's kind (dense or MoE), its
own work around it, and one output head per ``output_heads_per_block``: that contract is what the consumers
count by, so they ask :func:`head_blocks`, :func:`output_heads` and :func:`last_stage_embeds` instead of
testing the model's fields. The cost model keys its pricing of a block's own work by the same name
(``costmodel.head_pricing``) and the executor its module factory (``executor.head_modules``);
``tests/test_head_features.py`` checks that both hold exactly the features registered here. Megatron's
pipeline layout string has a letter for MTP layers only (``m``, :mod:`spec.pipeline_layout`), which the rule
book checks against ``mtp_num_layers``.

The one feature: ``mtp``, DeepSeek-V3's multi-token prediction (``ModelSpec.mtp_num_layers`` depths; the
executor's module is :mod:`executor.mtp`). Adding one: docs/architecture.md, "Extension point: head features".

This module imports no ModelSpec (``spec.flops`` and the cost model ask it about a model): ``model`` is a
ModelSpec everywhere below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec.registry import Registry

Model = Any  # a spec.model_spec.ModelSpec


@dataclass(frozen=True)
class HeadFeature:
    """One head feature's spec-level facts.

    ``label``: the feature in messages. ``depth_field``: the ``ModelSpec`` field holding the model's blocks
    of this feature (0: unused; :meth:`depth`).
    ``own_flops(model)``: model FLOPs per trained token (forward + backward, :mod:`spec.flops` conventions) of
    one block's own work, beyond its decoder layer and its output heads. ``output_heads_per_block``: logit
    GEMMs and cross-entropies one block adds. ``embeds``: whether a block reads the word embedding (the last
    stage then holds a copy of it). ``hf_config_key``: the Hugging Face
    config field holding the depth (None: no HF model has it).
    """

    name: str
    label: str
    depth_field: str
    own_flops: Callable[[Model], float]
    output_heads_per_block: int = 1
    embeds: bool = False
    hf_config_key: str | None = None

    def depth(self, model: Model) -> int:
        """The model's blocks of this feature (0: the model does not use it)."""
        return getattr(model, self.depth_field)


#: name -> feature, in registration order (the order blocks run in)
HEAD_FEATURES: Registry[HeadFeature] = Registry("head feature")


def register_head_feature(feature: HeadFeature) -> HeadFeature:
    """Add ``feature`` to :data:`HEAD_FEATURES` (one entry per name). Returns it."""
    return HEAD_FEATURES.add(feature.name, feature)


def head_features(model: Model) -> tuple[tuple[HeadFeature, int], ...]:
    """(feature, depth) of every head feature ``model`` uses, in registration order."""
    return tuple((f, d) for f in HEAD_FEATURES.values() if (d := f.depth(model)))


def head_blocks(model: Model) -> int:
    """Blocks after the decoder on the last stage, all features together (each holds one decoder layer)."""
    return sum(d for _, d in head_features(model))


def output_heads(model: Model) -> int:
    """Output heads (logit GEMM + cross-entropy) per micro-batch: the model's own and its blocks'."""
    return 1 + sum(f.output_heads_per_block * d for f, d in head_features(model))


def last_stage_embeds(model: Model) -> bool:
    """Whether a head block reads the word embedding, so the last stage holds it too."""
    return any(f.embeds for f, _ in head_features(model))


# ---- multi-token prediction (DeepSeek-V3) -------------------------------------------------------------------
def _mtp_own_flops(model: Model) -> float:
    # the 2h -> h projection's GEMM (2h² multiply-adds) and, as Megatron counts them, the block's 3 norms
    h = model.hidden_size
    return 3 * 2 * (3 * h + 2 * h * h)


MTP = register_head_feature(HeadFeature(
    name="mtp", label="multi-token prediction (MTP)", depth_field="mtp_num_layers", own_flops=_mtp_own_flops,
    output_heads_per_block=1, embeds=True, hf_config_key="num_nextn_predict_layers"))
