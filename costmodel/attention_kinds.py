"""Which attention path each decoder layer takes, and how many keys its queries see.

The executor runs plain causal layers on fused kernels (SDPA ``is_causal``, the CP flash path) and layers with
a sliding window or attention sinks on an explicit masked path (``executor/attention_core.py``): with sinks an
fp32 softmax over the whole [s/cp, s] score matrix, with a window only SDPA under a boolean mask, which
computes every score of that matrix too. Megatron runs both on its fused kernel
(``TrainingSpec.fused_window_sink_attention``), where a window of w keys costs ~s·w instead of s²/2.

The cost model prices one attention part shared by every layer of a kind, so the per-layer paths enter as
the model's mean (exact for GPT-OSS, whose every layer has sinks and every second a window).
"""

from __future__ import annotations

from costmodel.per_model import per_model_cache
from spec.attention_kinds import attention_kind
from spec.model_spec import ModelSpec


def has_sinks(model: ModelSpec) -> bool:
    """Whether the softmax carries a sink logit per head (GPT-OSS's 'learnable', or 'off-by-one')."""
    return model.softmax_type != "vanilla"


@per_model_cache
def masked_layer_share(model: ModelSpec) -> float:
    """Share of decoder layers the executor runs on its masked path (a window or sinks), 0..1."""
    if not attention_kind(model).windows_and_sinks:  # the executor keeps such a kind (MLA) on the causal path
        return 0.0
    if has_sinks(model):
        return 1.0
    windowed = sum(model.attention_window(i) is not None for i in range(model.num_layers))
    return windowed / model.num_layers


def window_keys(seq_length: int, window: int) -> float:
    """Mean keys a query attends to under a causal window of ``window`` keys before it (the query's own key
    included): ``min(i + 1, window + 1)`` averaged over positions ``i < seq_length``."""
    full = min(seq_length, window + 1)
    # positions below the window see i + 1 keys, the rest window + 1
    return (full * (full + 1) / 2 + (seq_length - full) * (window + 1)) / seq_length


@per_model_cache
def fused_causal_fraction(model: ModelSpec, seq_length: int) -> float:
    """Work of a flash-style kernel that skips masked-out blocks, as a share of full causal attention's,
    averaged over the decoder layers: 1 for full layers, window keys over causal keys ((s+1)/2) for windowed."""
    causal = (seq_length + 1) / 2
    total = 0.0
    for i in range(model.num_layers):
        window = model.attention_window(i)
        total += 1.0 if window is None else window_keys(seq_length, window) / causal
    return total / model.num_layers
