"""Attention kinds: one declarative entry per kind, the single source of what a kind is at the spec level.

A :class:`AttentionKind` bundles what the spec layer knows of a kind: which models select it, its head
widths, its model FLOPs, its own consistency checks, the fields its tiny proxy shrinks, its Hugging Face
tensor names, the recompute modules only it has, and which Megatron/executor rules it is subject to. The
other layers key their part by the same name: the cost model's pricing (``costmodel.attention_pricing``:
parameters, activations, collectives, time) and the executor's module factory
(``executor.attention_modules``); ``tests/test_feature_registry.py`` checks that both hold exactly the
kinds registered here. Every consumer asks :func:`attention_kind` instead of testing the model's flags.

Kinds: ``gqa`` (multi-head attention, grouped-query when ``num_query_groups`` is set; sliding windows and
attention sinks are attributes of its models: ``window_size``, ``softmax_type``) and ``mla`` (DeepSeek's
multi-latent attention, ``ModelSpec.multi_latent_attention``). Adding one: docs/architecture.md, "Extension
points".

This module imports no ModelSpec (ModelSpec asks it for its head widths): ``model`` is a ModelSpec
everywhere below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spec.errors import SpecError
from spec.norm_scopes import QK_NORM_SCOPES
from spec.registry import Registry

Model = Any  # a spec.model_spec.ModelSpec (not imported: model_spec imports this module)


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind's spec-level facts and rules.

    ``label``: the kind in messages, before the word "attention". ``selects(model)``: whether ``model`` uses
    this kind (None for the default kind, taken when no other kind selects the model). ``head_dim`` /
    ``rotary_head_dim``: per-head width of Q and K and the part RoPE rotates. ``flops(model, seq_length,
    num_layers)``: attention FLOPs per trained token over ``num_layers`` layers with Megatron's conventions
    (:mod:`spec.flops`). ``problems(model)``: readable lines for a model whose fields contradict the kind
    (``ModelSpec`` raises on them). ``tiny_fields(model)``: this kind's own width fields at test size
    (:func:`spec.proxy.tiny_proxy`). ``hf_names``: the executor's attention parameter names (after
    ``layers.{i}.attention.``) -> HF's (after ``model.layers.{i}.self_attn.``). ``recompute_modules``:
    selective-recompute modules only this kind has. ``tp_rule(model, tp)``: a (rule id, reason) pair where
    ``tp`` cannot split this kind's heads, else None. ``windows_and_sinks``: whether the executor builds
    sliding windows and attention sinks for it. ``split_qk_norms``: whether it builds q/k norms that split with
    the heads (a scope with ``split_with_heads``); where it does not, the rule book's executor_model rule says so.
    """

    name: str
    label: str
    selects: Callable[[Model], bool] | None
    head_dim: Callable[[Model], int]
    rotary_head_dim: Callable[[Model], int]
    flops: Callable[[Model, int, int], float]
    problems: Callable[[Model], list[str]] = lambda model: []
    tiny_fields: Callable[[Model], dict] = lambda model: {}
    hf_names: Mapping[str, str] = field(default_factory=dict)
    recompute_modules: tuple[str, ...] = ()
    tp_rule: Callable[[Model, int], tuple[str, str] | None] = lambda model, tp: None
    windows_and_sinks: bool = False
    split_qk_norms: bool = True


#: name -> kind, in registration order
ATTENTION_KINDS: Registry[AttentionKind] = Registry("attention kind")


def register_attention_kind(kind: AttentionKind) -> AttentionKind:
    """Add ``kind`` to :data:`ATTENTION_KINDS` (one entry per name, one default: ``selects`` None)."""
    if kind.selects is None and any(k.selects is None for k in ATTENTION_KINDS.values()):
        raise ValueError(f"attention kind {kind.name!r}: there is a default kind already")
    return ATTENTION_KINDS.add(kind.name, kind)


def attention_kind(model: Model) -> AttentionKind:
    """The attention kind ``model`` uses: the one kind whose ``selects`` holds, else the default kind;
    SpecError when two kinds claim the model."""
    default = None
    chosen = None
    for kind in ATTENTION_KINDS.values():
        if kind.selects is None:
            default = kind
        elif kind.selects(model):
            if chosen is not None:
                raise SpecError(f"model {model.name!r} selects two attention kinds: {chosen.name} and {kind.name}")
            chosen = kind
    return chosen or default


def modules_of_other_kinds(model: Model) -> dict[str, AttentionKind]:
    """Selective-recompute modules that belong to an attention kind ``model`` does not use -> that kind."""
    own = attention_kind(model)
    return {m: k for k in ATTENTION_KINDS.values() if k is not own for m in k.recompute_modules}


# ---- multi-head / grouped-query attention ------------------------------------------------------------------
def _gqa_head_dim(model: Model) -> int:
    return model.kv_channels if model.kv_channels is not None else model.hidden_size // model.num_attention_heads


# 3 GEMM passes (fwd, dgrad, wgrad) x 2 FLOPs per multiply-add x 2 GEMMs per block (up and down)
_EXPANSION = 3 * 2 * 2


def _gqa_flops(model: Model, seq_length: int, num_layers: int) -> float:
    h, n = model.hidden_size, model.num_attention_heads
    query_projection = model.head_dim * n
    return (
        _EXPANSION * num_layers * h * h
        * ((1 + model.num_kv_heads / n + seq_length / h / 2) * (query_projection / h))
    )


def _gqa_problems(model: Model) -> list[str]:
    heads = model.num_attention_heads
    if model.kv_channels is None and isinstance(heads, int) and heads >= 1 and model.hidden_size % heads:
        return [f"hidden_size ({model.hidden_size}) must be divisible by num_attention_heads ({heads}) unless "
                f"kv_channels is given"]
    return []


def _gqa_tp_rule(model: Model, tp: int) -> tuple[str, str] | None:
    groups = model.num_kv_heads
    if groups % tp and tp % groups:
        return "kv_heads_tp", f"num_query_groups ({groups}) is neither a multiple nor a divisor of tp ({tp})"
    return None


GQA = register_attention_kind(AttentionKind(
    name="gqa", label="standard", selects=None, head_dim=_gqa_head_dim, rotary_head_dim=_gqa_head_dim,
    flops=_gqa_flops, problems=_gqa_problems,
    hf_names={"wq.weight": "q_proj.weight", "wk.weight": "k_proj.weight", "wv.weight": "v_proj.weight",
              "wo.weight": "o_proj.weight", "wq.bias": "q_proj.bias", "wk.bias": "k_proj.bias",
              "wv.bias": "v_proj.bias", "wo.bias": "o_proj.bias", "q_norm.weight": "q_norm.weight",
              "k_norm.weight": "k_norm.weight", "sinks": "sinks"},
    tp_rule=_gqa_tp_rule, windows_and_sinks=True))


# ---- multi-latent attention (DeepSeek-V2/V3) ---------------------------------------------------------------
_MLA_WIDTHS = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# the tiny proxy's MLA widths (elements): ranks 32, head dims 16 (no-RoPE and V) and 8 (RoPE)
_TINY_MLA = {"kv_lora_rank": 32, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}
_TINY_Q_LORA = 32


def _mla_flops(model: Model, seq_length: int, num_layers: int) -> float:
    h, n = model.hidden_size, model.num_attention_heads
    qk, rope, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
    if model.q_lora_rank is None:
        q_term = h * n * (qk + rope)
    else:
        q_term = model.q_lora_rank * (h + n * (qk + rope) + 1)
    per_layer = (
        q_term
        + model.kv_lora_rank * (h + n * (qk + v) + 1)
        + h * rope
        + n * v * h
        + seq_length * n * (qk + rope) / 2
        + seq_length * n * v / 2
    )
    return 3 * 2 * num_layers * per_layer


def _mla_problems(model: Model) -> list[str]:
    out = []
    if model.num_query_groups is not None:
        out.append("multi_latent_attention excludes num_query_groups (GQA)")
    for name in _MLA_WIDTHS:
        value = getattr(model, name)
        if not (isinstance(value, int) and value >= 1):
            out.append(f"{name} must be a positive integer, got {value!r}")
    return out


def _mla_tiny_fields(model: Model) -> dict:
    fields = dict(_TINY_MLA)
    if model.q_lora_rank is not None:
        fields["q_lora_rank"] = _TINY_Q_LORA
    return fields


MLA = register_attention_kind(AttentionKind(
    name="mla", label="multi-latent", selects=lambda model: model.multi_latent_attention,
    head_dim=lambda model: model.qk_head_dim + model.qk_pos_emb_head_dim,
    rotary_head_dim=lambda model: model.qk_pos_emb_head_dim,
    flops=_mla_flops, problems=_mla_problems, tiny_fields=_mla_tiny_fields,
    # one to one: their row orders are the executor's (per head [nope | rope] and [nope | v]; the latent
    # then the shared RoPE key)
    hf_names={"linear_q_proj.weight": "q_proj.weight", "linear_q_down_proj.weight": "q_a_proj.weight",
              "q_layernorm.weight": "q_a_layernorm.weight", "linear_q_up_proj.weight": "q_b_proj.weight",
              "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
              "kv_layernorm.weight": "kv_a_layernorm.weight", "linear_kv_up_proj.weight": "kv_b_proj.weight",
              "linear_proj.weight": "o_proj.weight"},
    recompute_modules=("mla_up_proj",), split_qk_norms=False))
