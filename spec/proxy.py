"""Proxies of a model: the same architecture, cheaper to measure or to test.

Two kinds, which compose (tiny first, then layers):

- a *layers* proxy (:meth:`ModelSpec.with_layers`, ``--layers N``, ``num_layers_override``): every width
  and feature of the model with ``N`` decoder layers, named ``<model>@<N>L``. Per-layer time and memory
  are the full model's, so a tuning job on 8 GPUs can measure a model that does not fit them.
- the *tiny* proxy (:func:`tiny_proxy`, ``--proxy tiny``, ``proxy: "tiny"``): every architecture feature
  flag kept (MLA and its q/kv LoRA, shared experts, qk norm, biases, sigmoid group routing, MTP, the
  dense-first layers and the ``moe_layer_freq`` pattern, and any flag this module does not name) at the
  widths of the test models (hidden 64, vocab 256), named ``<model>@tiny``. Its sizes split evenly over
  tp2·ep2·etp2 and its layers over pp2, so one CPU test runs every catalog model under a folded layout.

:func:`proxy_model` applies both to a model and bounds what is asked for; :func:`proxy_of` reads a
proxy's name back (what a stored job shows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec.attention_kinds import attention_kind
from spec.errors import SpecError
from spec.model_spec import ModelSpec

PROXIES = ("tiny",)
TINY_SUFFIX = "@tiny"

# the tiny widths (elements): the test models' (catalog tiny-moe), each even so tp2 / etp2 split them
TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_FFN = 128
TINY_EXPERT_FFN = 32
TINY_SHARED_FFN = 48
TINY_EXPERTS = 8
TINY_VOCAB = 256
TINY_POSITIONS = 256


class ProxyError(SpecError):
    """A proxy that cannot be built: ``rule`` names the broken bound (``proxy_kind``, ``proxy_layers``)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _tiny_layers(model: ModelSpec) -> int:
    """Enough layers to hold the first MoE layer (after the dense-first ones) and at least two (pp2)."""
    pattern = model.moe_layer_pattern()
    first_moe = pattern.index(1) if 1 in pattern else 0
    return min(model.num_layers, max(2, first_moe + 1))


def _tiny_experts(model: ModelSpec) -> dict:
    if not model.is_moe:
        return {}
    experts = min(model.num_experts, TINY_EXPERTS)
    fields: dict = {"num_experts": experts, "moe_ffn_hidden_size": TINY_EXPERT_FFN}
    topk_cap = max(1, experts // 2)  # routing still chooses among experts
    if model.moe_router_num_groups is not None:
        groups = _largest_divisor_at_most(experts, model.moe_router_num_groups)
        group_topk = min(model.moe_router_group_topk or groups, groups)
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        topk_cap = min(topk_cap, group_topk * (experts // groups))
    fields["moe_router_topk"] = min(model.moe_router_topk, topk_cap)
    if model.moe_shared_expert_intermediate_size:
        fields["moe_shared_expert_intermediate_size"] = TINY_SHARED_FFN
    return fields


def _tiny_attention(model: ModelSpec) -> dict:
    fields: dict = {"num_attention_heads": TINY_HEADS}
    if model.num_query_groups is not None:  # GQA stays GQA (MHA stays MHA: no groups)
        fields["num_query_groups"] = TINY_KV_HEADS if model.num_query_groups < model.num_attention_heads else TINY_HEADS
    if model.kv_channels is not None:  # an explicit head dim stays explicit, and stays unequal to hidden/heads if it was
        decoupled = model.kv_channels * model.num_attention_heads != model.hidden_size
        fields["kv_channels"] = 2 * TINY_HIDDEN // TINY_HEADS if decoupled else TINY_HIDDEN // TINY_HEADS
    fields.update(attention_kind(model).tiny_fields(model))  # the kind's own widths (MLA's ranks, head dims)
    return fields


def tiny_proxy(model: ModelSpec) -> ModelSpec:
    """``model`` at test widths with every feature flag kept, named ``<name>@tiny``.

    Widths (elements): hidden 64, 4 heads (2 KV groups under GQA), FFN 128, expert FFN 32, shared-expert
    FFN 48, at most 8 experts (top-k and router groups cut to match), vocabulary 256, MLA ranks 32 / head
    dims 16 and 8. Layers: the first MoE layer's index + 1, at least 2 (pp2), never more than the model's;
    the dense-first count and a ``moe_layer_freq`` pattern are cut with them (:meth:`ModelSpec.with_layers`).
    Every other field (flags, norms, routing functions, MTP depth, dropout, ...) is the model's.
    """
    layers = _tiny_layers(model)
    cut = model.with_layers(layers) if layers != model.num_layers else model
    return replace(cut, name=model.name + TINY_SUFFIX, hidden_size=TINY_HIDDEN, ffn_hidden_size=TINY_FFN,
                   vocab_size=TINY_VOCAB, make_vocab_size_divisible_by=8,
                   max_position_embeddings=min(model.max_position_embeddings, TINY_POSITIONS),
                   **_tiny_attention(model), **_tiny_experts(model))


def proxy_model(model: ModelSpec, num_layers: int | None = None, proxy: str | None = None) -> ModelSpec:
    """The model a job or training runs: ``model``, its tiny proxy (``proxy="tiny"``), then cut to
    ``num_layers`` layers. ProxyError (rule ``proxy_kind`` or ``proxy_layers``) for an unknown proxy or a
    layer count outside 1..the model's layers."""
    if proxy is not None and proxy not in PROXIES:
        raise ProxyError("proxy_kind", f"proxy must be one of {', '.join(PROXIES)} (or none), got {proxy!r}")
    if num_layers is not None and not 1 <= num_layers <= model.num_layers:
        raise ProxyError("proxy_layers", f"a proxy's layer count ({num_layers}) must lie in [1, "
                                         f"{model.num_layers}] (the layers of {model.name})")
    out = tiny_proxy(model) if proxy == "tiny" else model
    if num_layers is not None and num_layers != out.num_layers:
        out = out.with_layers(num_layers)
    return out


@dataclass(frozen=True)
class ProxyInfo:
    """What a model name says about the proxy it is: the base model's name, the proxy kind (or None), and
    the layer count of a layers proxy (or None)."""

    base: str
    proxy: str | None
    num_layers: int | None

    @property
    def is_proxy(self) -> bool:
        return self.proxy is not None or self.num_layers is not None


def proxy_of(name: str) -> ProxyInfo:
    """Read ``<base>[@tiny][@<N>L]`` (the names :func:`proxy_model` gives) back into its parts."""
    base, proxy, layers = name, None, None
    head, sep, tail = base.rpartition("@")
    if sep and tail.endswith("L") and tail[:-1].isdigit():
        base, layers = head, int(tail[:-1])
    if base.endswith(TINY_SUFFIX):
        base, proxy = base[: -len(TINY_SUFFIX)], "tiny"
    return ProxyInfo(base, proxy, layers)
