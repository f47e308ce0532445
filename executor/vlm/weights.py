"""Qwen3-VL-MoE checkpoint tensors (Hugging Face names) into :class:`~executor.vlm.model.VisionLanguageMoE`.

- ``model.visual.*``: the encoder. ``patch_embed.proj.weight`` [h, C, T, p, p] (a Conv3d whose stride is its
  kernel) is the patch embedding's [h, C·T·p·p]; ``pos_embed.weight``; per block ``norm1/norm2``,
  ``attn.qkv/proj``, ``mlp.linear_fc1/fc2``; ``merger.*`` the projector, ``deepstack_merger_list.i.*`` the
  deepstack ones.
- ``model.language_model.*`` and ``lm_head.weight``: the LLM, through the Qwen3-MoE mapping of
  :mod:`executor.hf.names` once the fused experts are split per expert. ``experts.gate_up_proj`` holds gate then
  up: [E, 2F, H] as transformers 5's module and save_pretrained hold it, or [E, H, 2F] as the published
  checkpoints do (told apart by shape; when H = 2F the module's order is assumed); ``experts.down_proj``
  [E, H, F] (module) or [E, F, H] (published).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from spec.errors import SpecError
from spec.hf_vl_config import HFVisionLanguageModel
from executor.hf.names import hf_to_foldtune
from executor.hf.weights import check_loadable, copy_full_weights, read_hf_tensors
from executor.vlm.model import VisionLanguageMoE

_VISUAL, _TEXT = "model.visual.", "model.language_model."
_BLOCK = {"norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.linear_fc1",
          "fc2": "mlp.linear_fc2"}
_PROJECTOR = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def _split_experts(name: str, t: torch.Tensor, hidden: int, ffn: int) -> dict[str, torch.Tensor]:
    """Fused expert tensors → per-expert Qwen3-MoE names (``...experts.<e>.gate_proj.weight``, ...)."""
    prefix = name.rsplit(".", 1)[0]
    experts = t.shape[0]
    if name.endswith("gate_up_proj"):
        if tuple(t.shape[1:]) != (2 * ffn, hidden):  # the published [E, H, 2F]
            t = t.transpose(1, 2)
        gate, up = t[:, :ffn], t[:, ffn:]
        return {**{f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(experts)},
                **{f"{prefix}.{e}.up_proj.weight": up[e] for e in range(experts)}}
    if tuple(t.shape[1:]) != (hidden, ffn):  # the published [E, F, H]
        t = t.transpose(1, 2)
    return {f"{prefix}.{e}.down_proj.weight": t[e] for e in range(experts)}


def text_tensors(hf: Mapping[str, torch.Tensor], hidden: int, ffn: int) -> dict[str, torch.Tensor]:
    """The LLM's tensors under Qwen3-MoE's checkpoint names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name == "lm_head.weight":
            out[name] = t
        elif name.startswith(_TEXT):
            renamed = "model." + name[len(_TEXT):]
            if renamed.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out.update(_split_experts(renamed, t, hidden, ffn))
            else:
                out[renamed] = t
    return out


def vision_tensors(hf: Mapping[str, torch.Tensor], model: VisionLanguageMoE) -> dict[str, torch.Tensor]:
    """The encoder's state dict (its module names) from the checkpoint's ``model.visual.*`` tensors."""
    v = model.spec.vision
    names = {"patch_embed.weight": "patch_embed.proj.weight", "patch_embed.bias": "patch_embed.proj.bias",
             "pos_embed": "pos_embed.weight"}
    for i in range(v.num_layers):
        for ours, theirs in _BLOCK.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"blocks.{i}.{theirs}.{kind}"
    for ours, theirs in _PROJECTOR.items():
        for kind in ("weight", "bias"):
            names[f"projector.{ours}.{kind}"] = f"merger.{theirs}.{kind}"
            for j in range(len(v.deepstack_layers)):
                names[f"deepstack.{j}.{ours}.{kind}"] = f"deepstack_merger_list.{j}.{theirs}.{kind}"
    missing = [_VISUAL + theirs for theirs in names.values() if _VISUAL + theirs not in hf]
    if missing:
        raise SpecError(f"the checkpoint lacks {len(missing)} vision tensor(s): {', '.join(missing[:5])}")
    unused = sorted(set(k for k in hf if k.startswith(_VISUAL)) - {_VISUAL + t for t in names.values()})
    if unused:
        raise SpecError(f"{len(unused)} vision tensor(s) have no place in the encoder: {', '.join(unused[:5])}")
    out = {ours: hf[_VISUAL + theirs] for ours, theirs in names.items()}
    out["patch_embed.weight"] = out["patch_embed.weight"].reshape(v.hidden_size, -1)
    return out


def load_vl_tensors(model: VisionLanguageMoE, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy a Qwen3-VL-MoE checkpoint's tensors (``hf``, by HF name) into ``model``."""
    llm = model.spec.llm
    text = text_tensors(hf, llm.hidden_size, llm.expert_ffn_hidden_size)
    wanted = {p.shard_info.name for p in model.llm.parameters()}
    copy_full_weights(model.llm, model.state, hf_to_foldtune(llm, "qwen3_moe", text, wanted))
    stray = sorted(k for k in hf if not k.startswith((_VISUAL, _TEXT)) and k != "lm_head.weight")
    if stray:
        raise SpecError(f"{len(stray)} tensor(s) belong to neither the encoder nor the LLM: {', '.join(stray[:5])}")
    model.encoder.load_state_dict(vision_tensors(hf, model), strict=True)


def load_hf_vl_weights(model: VisionLanguageMoE, directory: str | Path, hf: HFVisionLanguageModel) -> None:
    """Load the Hugging Face Qwen3-VL-MoE checkpoint in ``directory`` into ``model`` (built from ``hf.spec``)."""
    check_loadable(hf.text)
    load_vl_tensors(model, read_hf_tensors(directory))
