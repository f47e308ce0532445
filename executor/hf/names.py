"""Hugging Face tensor names ↔ foldtune's full logical tensors, per family.

foldtune names every parameter by its ShardInfo name at full shape (``layers.3.experts.w13`` [E, 2, F, H],
...; :mod:`executor.parallel.sharding`), so a mapping of whole tensors serves every layout: loading cuts
them with the same rules that initialise parameters, exporting gathers them first.

The tensors are HF's as they lie in a checkpoint (what ``save_pretrained`` of transformers 5 writes):

- per-expert projections for Mixtral (``block_sparse_moe.experts.E.w1/w3/w2``: gate/up/down) and for Qwen2-MoE,
  Qwen3-MoE, OLMoE and DeepSeek (``mlp.experts.E.gate_proj/up_proj/down_proj``), stacked here into ``w13``
  [E, 2, F, H] (gate, up) and ``w2`` [E, H, F];
- GPT-OSS's fused experts: ``gate_up_proj`` [E, H, 2F] with gate and up *interleaved* along the last dim
  (gate = [..., ::2]) and ``down_proj`` [E, F, H], both in ``x @ W`` order (foldtune's are ``W @ x``), with
  biases ``gate_up_proj_bias`` [E, 2F] (interleaved) and ``down_proj_bias`` [E, H];
- the attention's tensors map one to one, by the names of the model's attention kind
  (``spec.attention_kinds``, ``hf_names``): DeepSeek's MLA projections (q_proj / q_a_proj, q_a_layernorm,
  q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) have the executor's row orders (per head
  [nope | rope] and [nope | v]; the latent then the shared RoPE key). RoPE of the decoupled dims rotates
  adjacent pairs in both.
- DeepSeek-V3's ``mlp.gate.e_score_correction_bias`` is the router's ``expert_bias`` buffer.

Multi-token-prediction depths (DeepSeek-V3's layer 61 in the published checkpoint) are not mapped:
transformers does not build them either.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from spec.attention_kinds import attention_kind
from spec.errors import SpecError
from spec.model_spec import ModelSpec

#: The MoE block's module name and its experts' (gate, up, down) names, per family.
_MOE = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "gate"),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
    "gpt_oss": ("mlp", None, "router"),
}
_SHARED = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts"}
_MLP = {"w1.weight": "gate_proj.weight", "w3.weight": "up_proj.weight", "w2.weight": "down_proj.weight",
        "w1.bias": "gate_proj.bias", "w3.bias": "up_proj.bias", "w2.bias": "down_proj.bias"}


def _one_to_one(spec: ModelSpec, family: str) -> dict[str, str]:
    """foldtune name -> HF name of every tensor that maps without reshaping (a superset: names the model
    does not have are skipped by the callers)."""
    out = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if spec.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = "lm_head.weight"
    moe_block, _, router = _MOE[family]
    pattern = spec.moe_layer_pattern()
    for i in range(spec.num_layers):
        hf, ft = f"model.layers.{i}.", f"layers.{i}."
        out[ft + "attention.norm.weight"] = hf + "input_layernorm.weight"
        out[ft + "mlp_norm.weight"] = hf + "post_attention_layernorm.weight"
        for a, b in attention_kind(spec).hf_names.items():
            out[ft + "attention." + a] = hf + "self_attn." + b
        if not pattern[i]:
            for a, b in _MLP.items():
                out[ft + "mlp." + a] = hf + "mlp." + b
            continue
        out[ft + "router.weight"] = f"{hf}{moe_block}.{router}.weight"
        out[ft + "router.bias"] = f"{hf}{moe_block}.{router}.bias"
        out[ft + "router.expert_bias"] = f"{hf}{moe_block}.{router}.e_score_correction_bias"
        if family in _SHARED:
            for a, b in _MLP.items():
                out[ft + "shared_experts." + a] = f"{hf}mlp.{_SHARED[family]}.{b}"
            out[ft + "shared_experts.gate_weight"] = f"{hf}mlp.shared_expert_gate.weight"
    return out


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2, F] (gate, up) -> [..., 2F] with gate at even and up at odd positions (GPT-OSS)."""
    return x.transpose(-1, -2).flatten(-2)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2F] interleaved -> [..., 2, F] (gate, up)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2)


def hf_to_foldtune(spec: ModelSpec, family: str, hf: Mapping[str, torch.Tensor],
                   wanted: set[str], strict: bool = True) -> dict[str, torch.Tensor]:
    """Full foldtune tensors (the names in ``wanted``: a model's parameters and persistent buffers) from the HF
    checkpoint tensors ``hf``. SpecError naming what is missing, and (``strict``: ``wanted`` is the whole
    model, not one pipeline stage's part) naming HF tensors left unused."""
    if family not in _MOE:
        raise SpecError(f"no weight mapping for model_type {family!r}")
    direct = _one_to_one(spec, family)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    moe_block, names, _ = _MOE[family]
    for name in sorted(wanted):
        if name in direct and direct[name] in hf:
            out[name] = hf[direct[name]]
            used.add(direct[name])
            continue
        layer, _, rest = name.removeprefix("layers.").partition(".")
        prefix = f"model.layers.{layer}.{moe_block}.experts."
        try:
            if rest in ("experts.w13", "experts.w2", "experts.b13", "experts.b2"):
                out[name] = _experts_in(spec, family, hf, prefix, rest, used)
                continue
        except KeyError as exc:
            missing.append(str(exc.args[0]))
            continue
        missing.append(direct.get(name, f"(no HF name for {name})"))
    if missing:
        raise SpecError(f"the Hugging Face checkpoint lacks {len(missing)} tensor(s) the model needs: "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unused = sorted(set(hf) - used)
    if unused and strict:
        raise SpecError(f"{len(unused)} Hugging Face tensor(s) have no place in the model: "
                        f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    return out


def _take(hf: Mapping[str, torch.Tensor], key: str, used: set[str]) -> torch.Tensor:
    if key not in hf:
        raise KeyError(key)
    used.add(key)
    return hf[key]


def _experts_in(spec: ModelSpec, family: str, hf, prefix: str, rest: str, used: set[str]) -> torch.Tensor:
    if family == "gpt_oss":
        if rest == "experts.w13":  # [E, H, 2F] interleaved -> [E, H, 2, F] -> [E, 2, F, H]
            return _deinterleave(_take(hf, prefix + "gate_up_proj", used)).permute(0, 2, 3, 1).contiguous()
        if rest == "experts.w2":  # [E, F, H] -> [E, H, F]
            return _take(hf, prefix + "down_proj", used).transpose(1, 2).contiguous()
        if rest == "experts.b13":
            return _deinterleave(_take(hf, prefix + "gate_up_proj_bias", used)).contiguous()
        return _take(hf, prefix + "down_proj_bias", used)
    gate, up, down = _MOE[family][1]
    experts = range(spec.num_experts)
    if rest == "experts.w13":
        return torch.stack([torch.stack([_take(hf, f"{prefix}{e}.{gate}.weight", used),
                                         _take(hf, f"{prefix}{e}.{up}.weight", used)]) for e in experts])
    if rest == "experts.w2":
        return torch.stack([_take(hf, f"{prefix}{e}.{down}.weight", used) for e in experts])
    raise KeyError(f"{prefix}*: expert biases ({rest})")


def foldtune_to_hf(spec: ModelSpec, family: str, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors from full foldtune tensors (parameters and buffers by ShardInfo-derived name)."""
    if family not in _MOE:
        raise SpecError(f"no weight mapping for model_type {family!r}")
    direct = _one_to_one(spec, family)
    moe_block, names, _ = _MOE[family]
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name in direct:
            out[direct[name]] = t
            continue
        layer, _, rest = name.removeprefix("layers.").partition(".")
        prefix = f"model.layers.{layer}.{moe_block}.experts."
        if family == "gpt_oss" and rest.startswith("experts."):
            if rest == "experts.w13":
                out[prefix + "gate_up_proj"] = _interleave(t.permute(0, 3, 1, 2))  # [E, H, 2, F] -> [E, H, 2F]
            elif rest == "experts.w2":
                out[prefix + "down_proj"] = t.transpose(1, 2)
            elif rest == "experts.b13":
                out[prefix + "gate_up_proj_bias"] = _interleave(t)
            else:
                out[prefix + "down_proj_bias"] = t
        elif rest == "experts.w13":
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{names[0]}.weight"] = t[e, 0]
                out[f"{prefix}{e}.{names[1]}.weight"] = t[e, 1]
        elif rest == "experts.w2":
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{names[2]}.weight"] = t[e]
        else:
            raise SpecError(f"foldtune tensor {name!r} has no Hugging Face name for model_type {family!r} "
                            f"(multi-token-prediction depths are not exported)")
    return {k: v.contiguous() for k, v in out.items()}
