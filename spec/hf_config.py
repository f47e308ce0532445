"""A Hugging Face ``config.json`` → ModelSpec (and the executor's numbers a ModelSpec does not hold).

Pure Python and ``json`` only: planning a model from its Hugging Face directory needs no ``transformers``.
One mapper per architecture (``model_type``): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3
and GPT-OSS. Every key of the file is either

- **read** by the family's mapper (into the ModelSpec, or into :class:`HFModel`'s executor numbers),
- **ignored on purpose** (:data:`IGNORED`, each with the reason it does not change the computed model:
  ``torch_dtype``, ``transformers_version``, token ids, the training-time aux-loss coefficient, ...), or
- **unknown**, which raises a SpecError naming the field: nothing is dropped silently.

A value the mapper reads but foldtune cannot represent (``hidden_act`` other than silu, a Qwen3 bias on the
output projection, ...) raises a SpecError naming the field too. A value the cost model can plan with but the
executor cannot reproduce exactly (YaRN RoPE scaling, quantised weights, ...)
is accepted and listed in :attr:`HFModel.executor_issues`: ``foldtune plan`` works, loading the weights into
the executor refuses with those reasons.

Conventions (what the executor does, so the mapping makes them equal):

- routing: HF's softmax → top-k → renormalise (``norm_topk_prob`` true, Mixtral, GPT-OSS's top-k of logits then
  softmax) is the executor's default top-k-then-softmax; softmax → top-k without renormalising
  (``norm_topk_prob`` false: Qwen2-MoE, OLMoE, DeepSeek-V2) is ``moe_router_pre_softmax``; DeepSeek's
  ``routed_scaling_factor`` is ``moe_router_topk_scaling_factor``;
- HF's ``sliding_window`` N attends to N keys, the query's own included: Megatron's window_size (N − 1, 0).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spec.errors import SpecError
from spec.head_features import MTP
from spec.limits import MAX_LAYERS
from spec.model_spec import ModelSpec
from spec.norm_scopes import qk_norm_scope

#: The largest config.json read (bytes); published ones are a few KiB.
MAX_CONFIG_BYTES = 1 << 20

#: Keys that do not change the model foldtune computes, and why.
IGNORED: dict[str, str] = {
    "architectures": "model_type names the architecture",
    "auto_map": "remote code is never run; model_type picks the mapper",
    "torch_dtype": "the training precision is TrainingSpec.precision",
    "dtype": "the training precision is TrainingSpec.precision",
    "transformers_version": "the version that wrote the file",
    "_name_or_path": "where the file came from",
    "use_cache": "inference KV cache",
    "bos_token_id": "a tokenizer id (foldtune data prepare --tokenizer)",
    "eos_token_id": "a tokenizer id (foldtune data prepare --tokenizer); kept in HFModel.eos_token_id",
    "pad_token_id": "a tokenizer id",
    "initializer_range": "initialisation of new weights: ExecutorOptions.init_method_std",
    "output_router_logits": "what HF's forward returns",
    "router_aux_loss_coef": "a training choice: the router options' moe_aux_loss_coeff",
    "aux_loss_alpha": "a training choice: the router options' moe_aux_loss_coeff",
    "seq_aux": "a training choice: the router options' moe_router_load_balancing_type",
    "pretraining_tp": "how the original run was laid out",
    "ep_size": "how the original run was laid out",
    "generation_config": "inference settings",
    "tokenizer_class": "a tokenizer setting",
    "quantization_config": "quantised weights: planning is unaffected, the executor loader refuses them",
    "initial_context_length": "YaRN's original length (rope_scaling), see executor_issues",
    "max_window_layers": "read only with use_sliding_window, which must be false",
}

#: Families (HF model_type) this module maps, and the catalog entries published as their examples.
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face config mapped for foldtune.

    ``spec``: the architecture; ``family``: HF's model_type; ``rotary_base`` (RoPE θ) and ``norm_epsilon`` (RMSNorm
    ε): the executor's ExecutorOptions numbers; ``expert_bias``: the router carries DeepSeek-V3's
    e_score_correction_bias (aux-loss-free balancing); ``eos_token_id``: the separator ``data prepare`` uses;
    ``executor_issues``: why the executor cannot reproduce this model's reference forward (empty when it can).
    """

    spec: ModelSpec
    family: str
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    expert_bias: bool = False
    eos_token_id: int | None = None
    executor_issues: tuple[str, ...] = field(default=())

    def executor_options(self) -> dict[str, Any]:
        """ExecutorOptions fields this model fixes (RoPE θ, RMSNorm ε, the expert bias)."""
        out: dict[str, Any] = {"rotary_base": self.rotary_base, "norm_epsilon": self.norm_epsilon}
        if self.expert_bias:
            out["moe_router_enable_expert_bias"] = True
        return out


class _Fields:
    """The config's keys, each taken at most once; what is left at the end is unknown."""

    def __init__(self, config: dict[str, Any], where: str):
        self.config, self.where, self.taken = config, where, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.taken.add(key)
        return self.config.get(key, default)

    def need(self, key: str) -> Any:
        self.taken.add(key)
        if key not in self.config or self.config[key] is None:
            raise SpecError(f"{self.where}: field {key!r} is required for model_type {self.config.get('model_type')!r}")
        return self.config[key]

    def int(self, key: str, default: Any = None, *, required: bool = True) -> int | None:
        value = self.need(key) if required and default is None else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.where}: field {key!r} must be an integer, got {value!r}")
        return value

    def expect(self, key: str, allowed: tuple, default: Any, why: str) -> Any:
        """Read ``key`` (``default`` when absent); a value outside ``allowed`` raises naming the field."""
        value = self.get(key, default)
        if value not in allowed:
            raise SpecError(f"{self.where}: field {key!r} = {value!r} is not supported ({why})")
        return value

    def check_unknown(self) -> None:
        unknown = sorted(set(self.config) - self.taken - set(IGNORED) - {"model_type"})
        if unknown:
            raise SpecError(f"{self.where}: field(s) not understood by the {self.config.get('model_type')} mapping: "
                            f"{', '.join(unknown)} (foldtune never drops a field silently; see docs/huggingface.md)")


def _rope(f: _Fields, issues: list[str]) -> float:
    """RoPE θ from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5); scaling other than the default
    (YaRN, linear, ...) goes to the executor issues."""
    params = f.get("rope_parameters") or {}
    scaling = f.get("rope_scaling")
    if not isinstance(params, dict) or (scaling is not None and not isinstance(scaling, dict)):
        raise SpecError(f"{f.where}: rope_parameters / rope_scaling must be mappings")
    theta = f.get("rope_theta", params.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise SpecError(f"{f.where}: field 'rope_theta' must be a positive number, got {theta!r}")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or params.get("rope_type", "default")
    if kind != "default":
        issues.append(f"rope scaling {kind!r} (rope_scaling / rope_parameters): the executor's RoPE is unscaled")
    return float(theta)


def _common(f: _Fields, name: str, issues: list[str], *, gqa: bool = True, act: bool = True) -> dict[str, Any]:
    """Fields every family shares, as ModelSpec keyword arguments (``act``: hidden_act must be silu)."""
    if act:
        f.expect("hidden_act", ("silu",), "silu", "the executor's gated MLP is SwiGLU")
    heads = f.int("num_attention_heads")
    kv = f.int("num_key_value_heads", heads, required=False)
    dropout = f.get("attention_dropout", 0.0) or 0.0
    out = dict(name=name, num_layers=f.int("num_hidden_layers"), hidden_size=f.int("hidden_size"),
               num_attention_heads=heads, ffn_hidden_size=f.int("intermediate_size"),
               vocab_size=f.int("vocab_size"), max_position_embeddings=f.int("max_position_embeddings"),
               untie_embeddings_and_output_weights=not f.get("tie_word_embeddings", False),
               attention_dropout=float(dropout))
    if gqa and kv != heads:
        out["num_query_groups"] = kv
    return out


def _head_dim(f: _Fields, spec: dict[str, Any]) -> None:
    head_dim = f.int("head_dim", None, required=False)
    if head_dim is not None and head_dim * spec["num_attention_heads"] != spec["hidden_size"]:
        spec["kv_channels"] = head_dim


def _norm_topk(f: _Fields, spec: dict[str, Any], default: bool) -> None:
    """norm_topk_prob false: softmax over all experts, then top-k, not renormalised (moe_router_pre_softmax)."""
    if not f.expect("norm_topk_prob", (True, False), default, "a boolean"):
        spec["moe_router_pre_softmax"] = True


def _layer_types(f: _Fields, spec: dict[str, Any]) -> None:
    types = f.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise SpecError(f"{f.where}: field 'layer_types' holds {sorted(set(types))}; this family maps full attention only")


def _mixtral(f: _Fields, name: str, issues: list[str]) -> dict[str, Any]:
    spec = _common(f, name, issues)
    _head_dim(f, spec)
    window = f.int("sliding_window", None, required=False)
    if window is not None:
        spec["window_size"] = (window - 1, 0)
    f.expect("router_jitter_noise", (0, 0.0, None), 0.0, "jitter makes routing random")
    spec.update(num_experts=f.int("num_local_experts"), moe_router_topk=f.int("num_experts_per_tok"),
                moe_ffn_hidden_size=spec["ffn_hidden_size"])
    return spec


def _moe_pattern(f: _Fields, spec: dict[str, Any]) -> None:
    """Qwen's decoder_sparse_step and mlp_only_layers: MoE at layers (i + 1) % step == 0 not listed as dense."""
    step = f.int("decoder_sparse_step", 1, required=False)
    dense = f.get("mlp_only_layers") or []
    layers = spec["num_layers"]
    if step < 1 or not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise SpecError(f"{f.where}: decoder_sparse_step must be >= 1 and mlp_only_layers indices in [0, {layers})")
    pattern = tuple(0 if i in dense or (i + 1) % step else 1 for i in range(layers))
    if any(p == 0 for p in pattern):
        spec["moe_layer_freq"] = pattern


def _no_sliding(f: _Fields) -> None:
    if f.get("use_sliding_window", False):
        raise SpecError(f"{f.where}: field 'use_sliding_window' = true is not supported (Qwen's per-layer windows)")
    f.get("sliding_window")  # only read with use_sliding_window


def _qwen2_moe(f: _Fields, name: str, issues: list[str]) -> dict[str, Any]:
    spec = _common(f, name, issues)
    _no_sliding(f)
    _layer_types(f, spec)
    spec["add_qkv_bias"] = bool(f.get("qkv_bias", True))  # transformers 5 names it; earlier always True
    spec.update(num_experts=f.int("num_experts"), moe_router_topk=f.int("num_experts_per_tok"),
                moe_ffn_hidden_size=f.int("moe_intermediate_size"))
    shared = f.int("shared_expert_intermediate_size", 0, required=False)
    if shared:
        spec.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    _norm_topk(f, spec, False)
    _moe_pattern(f, spec)
    return spec


def _qwen3_moe(f: _Fields, name: str, issues: list[str]) -> dict[str, Any]:
    spec = _common(f, name, issues)
    _head_dim(f, spec)
    _no_sliding(f)
    _layer_types(f, spec)
    f.expect("attention_bias", (False,), False, "Qwen3's bias includes o_proj, which the executor adds only "
             "together with MLP biases (add_bias_linear)")
    experts = f.int("num_experts", None, required=False)  # transformers 4 spelling
    local = f.int("num_local_experts", None, required=False)  # transformers 5 spelling
    if (experts or local) is None or (experts and local and experts != local):
        raise SpecError(f"{f.where}: give 'num_experts' or 'num_local_experts' (equal when both)")
    spec.update(qk_layernorm=True, num_experts=experts or local, moe_router_topk=f.int("num_experts_per_tok"),
                moe_ffn_hidden_size=f.int("moe_intermediate_size"))
    _norm_topk(f, spec, False)
    _moe_pattern(f, spec)
    return spec


def _olmoe(f: _Fields, name: str, issues: list[str]) -> dict[str, Any]:
    spec = _common(f, name, issues)
    f.expect("attention_bias", (False,), False, "OLMoE has no attention bias")
    f.expect("clip_qkv", (None,), None, "clipping q/k/v is not built")
    # q_norm/k_norm span a token's whole q (num_heads·head_dim) and k, not one head (Qwen3's)
    spec.update(qk_layernorm=True, qk_layernorm_scope="all", num_experts=f.int("num_experts"),
                moe_router_topk=f.int("num_experts_per_tok"), moe_ffn_hidden_size=spec["ffn_hidden_size"])
    _norm_topk(f, spec, False)
    return spec


def _deepseek(f: _Fields, name: str, issues: list[str], v3: bool) -> dict[str, Any]:
    spec = _common(f, name, issues, gqa=False)
    f.get("num_key_value_heads")  # MLA: every head has its own keys and values
    f.expect("attention_bias", (False,), False, "MLA without projection biases")
    f.expect("mlp_bias", (False,), False, "MLPs without biases")
    qk_nope, rope, v = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim"), f.int("v_head_dim")
    # transformers 5 writes the derived widths back; they must agree
    for key, value in (("qk_head_dim", qk_nope + rope), ("head_dim", rope)):
        if f.get(key, value) != value:
            raise SpecError(f"{f.where}: field {key!r} = {f.get(key)!r} disagrees with qk_nope_head_dim/qk_rope_head_dim")
    if not f.get("rope_interleave", True):
        issues.append("rope_interleave false: the executor's MLA rotates adjacent pairs (HF DeepSeek's default)")
    spec.update(multi_latent_attention=True, q_lora_rank=f.int("q_lora_rank", None, required=False),
                kv_lora_rank=f.int("kv_lora_rank"), qk_head_dim=qk_nope, qk_pos_emb_head_dim=rope, v_head_dim=v)
    experts, ffn = f.int("n_routed_experts"), f.int("moe_intermediate_size")
    shared = f.int("n_shared_experts", 0, required=False) or 0
    spec.update(num_experts=experts, moe_router_topk=f.int("num_experts_per_tok"), moe_ffn_hidden_size=ffn,
                moe_first_k_dense=f.int("first_k_dense_replace", 0, required=False))
    if shared:
        spec["moe_shared_expert_intermediate_size"] = shared * ffn
    freq = f.int("moe_layer_freq", 1, required=False)
    if freq != 1:  # DeepSeek: MoE where (i >= first_k_dense) and i % freq == 0
        spec["moe_layer_freq"] = freq
    scale = f.get("routed_scaling_factor", 1.0)
    if scale != 1.0:
        spec["moe_router_topk_scaling_factor"] = float(scale)
    score = f.expect("scoring_func", ("softmax", "sigmoid"), "sigmoid" if v3 else "softmax", "softmax or sigmoid")
    spec["moe_router_score_function"] = score
    method = f.expect("topk_method", ("greedy", "group_limited_greedy", "noaux_tc"),
                      "noaux_tc" if v3 else "greedy", "greedy, group_limited_greedy or noaux_tc")
    groups, group_topk = f.get("n_group"), f.get("topk_group")
    if method != "greedy" and groups and groups > 1:
        spec.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        if method == "group_limited_greedy":
            issues.append("topk_method group_limited_greedy scores a group by its best expert; the executor by the "
                          "sum of its top (top-k / topk_group) experts")
        elif isinstance(group_topk, int) and group_topk > 0 and max(1, spec["moe_router_topk"] // group_topk) != 2:
            issues.append("noaux_tc scores a group by its top-2 experts; the executor by its top (top-k / topk_group)")
    # the top-k's weights: softmax then top-k, not renormalised (DeepSeek-V2's greedy, norm_topk_prob false) is
    # the executor's pre-softmax router; renormalised top-k is its default; sigmoid top-k is renormalised always
    norm = f.expect("norm_topk_prob", (True, False), v3, "a boolean")
    if score == "softmax" and not norm:
        spec["moe_router_pre_softmax"] = True
    elif score == "sigmoid" and not norm and spec["moe_router_topk"] > 1:
        issues.append("sigmoid scores without norm_topk_prob: the executor always renormalises sigmoid top-k")
    if v3:
        mtp = f.int(MTP.hf_config_key, 0, required=False)
        if mtp:
            spec[MTP.depth_field] = mtp
    return spec


def _gpt_oss(f: _Fields, name: str, issues: list[str]) -> dict[str, Any]:
    f.get("hidden_act")  # unused by GPT-OSS: its experts apply the clamped GLU below
    spec = _common(f, name, issues, act=False)
    _head_dim(f, spec)
    f.expect("attention_bias", (True,), True, "GPT-OSS's projections carry biases")
    topk = f.get("num_experts_per_tok", f.get("experts_per_token"))
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise SpecError(f"{f.where}: field 'num_experts_per_tok' (or 'experts_per_token') is required")
    alpha = f.get("swiglu_alpha", 1.702)
    if abs(alpha - 1.702) > 1e-9:
        raise SpecError(f"{f.where}: field 'swiglu_alpha' = {alpha!r} is not supported (quick-GeGLU's 1.702)")
    spec.update(num_experts=f.int("num_local_experts"), moe_router_topk=topk, moe_ffn_hidden_size=spec["ffn_hidden_size"],
                add_bias_linear=True, add_qkv_bias=True, swiglu=False, quick_geglu=True,
                activation_func_clamp_value=float(f.get("swiglu_limit", 7.0)), glu_linear_offset=1.0,
                softmax_type="learnable")
    window = f.int("sliding_window", None, required=False)
    types = f.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(spec["num_layers"])]
    if len(types) != spec["num_layers"] or not set(types) <= {"sliding_attention", "full_attention"}:
        raise SpecError(f"{f.where}: field 'layer_types' must name sliding_attention or full_attention per layer")
    if window and "sliding_attention" in types:
        spec["window_size"] = (window - 1, 0)
        pattern = tuple(1 if t == "sliding_attention" else 0 for t in types)
        alternating = all(p == (i % 2 == 0) for i, p in enumerate(pattern))
        spec["window_attn_skip_freq"] = 2 if alternating else pattern
    return spec


_MAPPERS = {
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
    "deepseek_v2": lambda f, n, i: _deepseek(f, n, i, v3=False),
    "deepseek_v3": lambda f, n, i: _deepseek(f, n, i, v3=True),
    "gpt_oss": _gpt_oss,
}


def model_from_hf_config(config: dict[str, Any], name: str, where: str = "hf_config") -> HFModel:
    """Map the parsed ``config`` (a config.json's object) to an :class:`HFModel` named ``name``.

    SpecError naming the field for an unknown ``model_type``, an unknown key, or a value foldtune cannot
    represent; ``where`` prefixes the messages (the file, or the request field)."""
    if not isinstance(config, dict):
        raise SpecError(f"{where}: a Hugging Face config must be a JSON object")
    family = config.get("model_type")
    if family not in _MAPPERS:
        raise SpecError(f"{where}: field 'model_type' = {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    f = _Fields(config, where)
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise SpecError(f"{where}: field 'num_hidden_layers' = {layers} exceeds {MAX_LAYERS}")
    issues: list[str] = []
    try:
        fields = _MAPPERS[family](f, name, issues)
        rotary_base = _rope(f, issues)
    except SpecError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a value of the wrong JSON type
        raise SpecError(f"{where}: a {family} field holds a value of the wrong type ({exc})") from None
    eps = f.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise SpecError(f"{where}: field 'rms_norm_eps' must be a positive number, got {eps!r}")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?") if isinstance(config["quantization_config"], dict) else "?"
        issues.append(f"quantised weights ({method}, quantization_config): the executor loads unquantised ones")
    f.check_unknown()
    try:
        spec = ModelSpec(**fields)
    except (SpecError, TypeError) as exc:
        raise SpecError(f"{where}: {exc}") from None
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return HFModel(spec, family, rotary_base, float(eps), expert_bias=family == "deepseek_v3"
                   and config.get("topk_method", "noaux_tc") == "noaux_tc",
                   eos_token_id=eos if isinstance(eos, int) else None, executor_issues=tuple(issues))


def read_hf_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(parsed config.json, default model name) of a model directory or a config file.

    The name is the directory's name (``.../mixtral-8x7b/config.json`` → ``mixtral-8x7b``), or the file's stem
    when it is not called config.json. SpecError for a missing, oversized or malformed file."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    name = (file.parent.resolve().name if file.name == "config.json" else file.stem) or "hf-model"
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SpecError(f"{str(file)!r}: {size} bytes, more than a config.json's {MAX_CONFIG_BYTES}")
        data = json.loads(file.read_text())
    except OSError as exc:
        raise SpecError(f"cannot read Hugging Face config {str(file)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise SpecError(f"{str(file)!r} is not valid JSON: {str(exc).splitlines()[0]}") from None
    return data, name.lower()


def load_hf_model(path: str | os.PathLike[str], name: str | None = None) -> HFModel:
    """The :class:`HFModel` of a Hugging Face model directory or config.json file."""
    data, default = read_hf_config(path)
    return model_from_hf_config(data, name or default, where=str(path))


# ---- the other way: a ModelSpec as a Hugging Face config ------------------------------------------------------
def _family_of(spec: ModelSpec) -> str:
    if not spec.is_moe:
        raise SpecError(f"model {spec.name!r} is dense; the Hugging Face families foldtune writes are MoE")
    if spec.quick_geglu:
        return "gpt_oss"
    if spec.multi_latent_attention:
        return "deepseek_v3" if spec.moe_router_score_function == "sigmoid" else "deepseek_v2"
    if spec.moe_shared_expert_gate:
        return "qwen2_moe"
    if spec.qk_layernorm:
        return qk_norm_scope(spec).hf_model_type
    return "mixtral"


def hf_config_from_spec(spec: ModelSpec, rotary_base: float = 10000.0, norm_epsilon: float = 1e-6) -> dict[str, Any]:
    """A config.json object of the Hugging Face family that computes ``spec`` (GPT-OSS for quick-GeGLU, DeepSeek
    for MLA, Qwen2-MoE for a gated shared expert, Qwen3-MoE for per-head q/k norms, OLMoE for
    whole-width ones, else Mixtral).

    Checked by mapping it back (:func:`model_from_hf_config`): a spec no family represents exactly (ungated
    shared experts without MLA, dense layers in a Mixtral, ...) raises a SpecError naming the fields that
    would change."""
    family = _family_of(spec)
    h, heads = spec.hidden_size, spec.num_attention_heads
    c: dict[str, Any] = {
        "model_type": family, "hidden_size": h, "num_hidden_layers": spec.num_layers, "num_attention_heads": heads,
        "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": not spec.untie_embeddings_and_output_weights, "rms_norm_eps": norm_epsilon,
        "rope_theta": rotary_base, "attention_dropout": spec.attention_dropout, "hidden_act": "silu",
        "num_experts_per_tok": spec.moe_router_topk,
    }
    if spec.kv_channels is not None and not spec.multi_latent_attention:
        c["head_dim"] = spec.kv_channels
    pattern = spec.moe_layer_pattern()
    if family == "mixtral":
        c.update(num_local_experts=spec.num_experts, intermediate_size=spec.expert_ffn_hidden_size)
        if spec.window_size is not None:
            c["sliding_window"] = spec.window_size[0] + 1
    elif family in ("qwen2_moe", "qwen3_moe"):
        c.update(num_experts=spec.num_experts, moe_intermediate_size=spec.expert_ffn_hidden_size,
                 norm_topk_prob=not spec.moe_router_pre_softmax, decoder_sparse_step=1,
                 mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
        if family == "qwen2_moe":
            c.update(qkv_bias=spec.add_qkv_bias, shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size)
    elif family == "olmoe":  # one expert width (intermediate_size), every layer MoE
        c.update(num_experts=spec.num_experts, intermediate_size=spec.expert_ffn_hidden_size,
                 norm_topk_prob=not spec.moe_router_pre_softmax, attention_bias=False, clip_qkv=None)
    elif family == "gpt_oss":
        c.update(num_local_experts=spec.num_experts, attention_bias=True, swiglu_limit=spec.activation_func_clamp_value,
                 layer_types=["sliding_attention" if spec.attention_window(i) is not None else "full_attention"
                              for i in range(spec.num_layers)])
        if spec.window_size is not None:
            c["sliding_window"] = spec.window_size[0] + 1
    else:  # DeepSeek
        ffn = spec.expert_ffn_hidden_size
        c.update(n_routed_experts=spec.num_experts, moe_intermediate_size=ffn, q_lora_rank=spec.q_lora_rank,
                 kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_head_dim,
                 qk_rope_head_dim=spec.qk_pos_emb_head_dim, v_head_dim=spec.v_head_dim,
                 n_shared_experts=spec.shared_expert_ffn_hidden_size // ffn, first_k_dense_replace=spec.moe_first_k_dense,
                 routed_scaling_factor=spec.moe_router_topk_scaling_factor or 1.0, num_key_value_heads=heads,
                 norm_topk_prob=not spec.moe_router_pre_softmax)
        if isinstance(spec.moe_layer_freq, int):
            c["moe_layer_freq"] = spec.moe_layer_freq
        if family == "deepseek_v3":
            c.update(n_group=spec.moe_router_num_groups or 1, topk_group=spec.moe_router_group_topk or 1,
                     **{MTP.hf_config_key: MTP.depth(spec)}, topk_method="noaux_tc")
        else:
            c["topk_method"] = "greedy"
    mapped = model_from_hf_config(c, spec.name, where=f"the {family} config of {spec.name!r}").spec
    # not part of the computed model: the vocabulary padding, and the dense FFN width of a model without dense layers
    unused = {"make_vocab_size_divisible_by"} | ({"ffn_hidden_size"} if not spec.num_dense_layers else set())
    differ = [f for f in spec.to_dict() if f not in unused and getattr(mapped, f) != getattr(spec, f)]
    if differ:
        raise SpecError(f"model {spec.name!r} has no exact Hugging Face {family} form: {', '.join(differ)} would "
                        f"change")
    return c
