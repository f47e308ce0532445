"""A Hugging Face Qwen3-VL-MoE ``config.json`` → :class:`~spec.multimodal.VisionLanguageSpec`.

Pure Python, as :mod:`spec.hf_config`: the text part (``text_config``) goes through that module's Qwen3-MoE
mapping (every key read, ignored on purpose, or refused by name), the vision part (``vision_config``) through the
mapping here, which refuses unknown keys the same way. What the executor needs beyond the spec (RoPE θ of the
LLM, its multimodal RoPE sections, the vision RoPE θ, the norm ε) is kept in :class:`HFVisionLanguageModel`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from spec.errors import SpecError
from spec.hf_config import HFModel, IGNORED, model_from_hf_config, read_hf_config
from spec.multimodal import VisionEncoderSpec, VisionLanguageSpec

#: model_type of the families this module maps
VL_FAMILIES = ("qwen3_vl_moe",)

#: top-level keys that do not change the computed model, and why
VL_IGNORED: dict[str, str] = {
    **IGNORED,
    "video_token_id": "videos are not trained (still images only)",
    "vision_start_token_id": "a tokenizer id around each image",
    "vision_end_token_id": "a tokenizer id around each image",
}

#: the vision activations HF names, as VisionEncoderSpec.activation
_VISION_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class HFVisionLanguageModel:
    """A Qwen3-VL-MoE config mapped: ``spec``; ``text``: the LLM's HFModel (its RoPE θ, RMSNorm ε, issues);
    ``mrope_section``: the (temporal, height, width) split of the LLM's rotary frequency pairs, interleaved;
    ``vision_rotary_base``: the encoder's 2-D RoPE θ."""

    spec: VisionLanguageSpec
    family: str
    text: HFModel
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    vision_rotary_base: float = 10000.0

    @property
    def executor_issues(self) -> tuple[str, ...]:
        return self.text.executor_issues


def _vision(config: Any, where: str) -> tuple[VisionEncoderSpec, float]:
    if not isinstance(config, dict):
        raise SpecError(f"{where}: 'vision_config' must be a JSON object")
    taken: set[str] = set()

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        taken.add(key)
        if required and config.get(key) is None:
            raise SpecError(f"{where}: field 'vision_config.{key}' is required")
        return config.get(key, default)

    act = get("hidden_act", "gelu_pytorch_tanh")
    if act not in _VISION_ACTS:
        raise SpecError(f"{where}: field 'vision_config.hidden_act' = {act!r} is not supported "
                        f"(one of {', '.join(_VISION_ACTS)})")
    rope = get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") not in ("axial", "default"):
        raise SpecError(f"{where}: field 'vision_config.rope_parameters' must be the axial 2-D RoPE")
    theta = float(rope.get("rope_theta", 10000.0))
    fields = dict(num_layers=get("depth", required=True), hidden_size=get("hidden_size", required=True),
                  num_attention_heads=get("num_heads", required=True),
                  ffn_hidden_size=get("intermediate_size", required=True),
                  out_hidden_size=get("out_hidden_size", required=True), patch_size=get("patch_size", 16),
                  temporal_patch_size=get("temporal_patch_size", 2), in_channels=get("in_channels", 3),
                  spatial_merge_size=get("spatial_merge_size", 2),
                  num_position_embeddings=get("num_position_embeddings", 2304),
                  deepstack_layers=tuple(get("deepstack_visual_indexes", ()) or ()), activation=_VISION_ACTS[act])
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(fields[key], (list, tuple)):  # [t, h, w]-style sizes: square patches only
            raise SpecError(f"{where}: field 'vision_config.{key}' must be one integer (square patches)")
    unknown = sorted(set(config) - taken - set(IGNORED) - {"model_type"})
    if unknown:
        raise SpecError(f"{where}: field(s) not understood by the qwen3_vl_moe vision mapping: "
                        f"{', '.join('vision_config.' + u for u in unknown)}")
    try:
        return VisionEncoderSpec(**fields), theta
    except (SpecError, TypeError) as exc:
        raise SpecError(f"{where}: vision_config: {exc}") from None


def _mrope(text: dict[str, Any], where: str) -> tuple[int, int, int]:
    """The interleaved multimodal RoPE sections (rope_parameters in transformers 5, rope_scaling before)."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = params.get("mrope_section", [24, 20, 20]) if isinstance(params, dict) else None
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(s, int) and s >= 0 for s in section):
        raise SpecError(f"{where}: text_config rope 'mrope_section' must be three non-negative integers")
    if isinstance(params, dict) and params.get("mrope_interleaved", True) is not True:
        raise SpecError(f"{where}: text_config rope 'mrope_interleaved' = false (Qwen2-VL's blocked sections) "
                        "is not supported; Qwen3-VL interleaves")
    return tuple(section)  # type: ignore[return-value]


def vl_model_from_hf_config(config: dict[str, Any], name: str, where: str = "hf_config") -> HFVisionLanguageModel:
    """Map a parsed Qwen3-VL-MoE config.json to a vision-language model named ``name``; SpecError naming the
    field for anything foldtune cannot represent or does not know."""
    if not isinstance(config, dict):
        raise SpecError(f"{where}: a Hugging Face config must be a JSON object")
    family = config.get("model_type")
    if family not in VL_FAMILIES:
        raise SpecError(f"{where}: field 'model_type' = {family!r} is not a vision-language family; "
                        f"supported: {', '.join(VL_FAMILIES)}")
    unknown = sorted(set(config) - set(VL_IGNORED) - {"model_type", "text_config", "vision_config", "image_token_id",
                                                       "tie_word_embeddings"})
    if unknown:
        raise SpecError(f"{where}: field(s) not understood by the {family} mapping: {', '.join(unknown)}")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise SpecError(f"{where}: 'text_config' must be a JSON object")
    text = dict(text)
    # Qwen3-VL-MoE's router always renormalises its top-k (no norm_topk_prob switch in its modelling code);
    # the Qwen3-MoE mapping's default for an absent key is the opposite, so the key is made explicit here
    if text.get("norm_topk_prob", True) is not True:
        raise SpecError(f"{where}: field 'text_config.norm_topk_prob' = false is not Qwen3-VL-MoE's router")
    text["norm_topk_prob"] = True
    mrope = _mrope(text, where)
    for key in ("rope_parameters", "rope_scaling"):  # the mrope keys are read above
        if isinstance(text.get(key), dict):
            text[key] = {k: v for k, v in text[key].items() if k not in ("mrope_section", "mrope_interleaved")}
    text["model_type"] = "qwen3_moe"
    # the top-level switch decides whether the checkpoint's lm_head is the embedding (HF ties by the outer config)
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    text_model = model_from_hf_config(text, f"{name}-text", where=f"{where}: text_config")
    vision, theta = _vision(config.get("vision_config"), where)
    token = config.get("image_token_id", 151655)
    try:
        spec = VisionLanguageSpec(name=name, vision=vision, llm=text_model.spec, image_token_id=token)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return HFVisionLanguageModel(spec, family, text_model, mrope, theta)


def load_hf_vl_model(path: str | os.PathLike[str], name: str | None = None) -> HFVisionLanguageModel:
    """The vision-language model of a Hugging Face model directory or config.json file."""
    data, default = read_hf_config(path)
    return vl_model_from_hf_config(data, name or default, where=str(path))
