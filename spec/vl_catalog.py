"""The catalog's vision-language MoE models and vision encoders.

Two ways to name a vision-language model:

- a published family member, ``qwen3-vl-30b-a3b`` / ``qwen3-vl-235b-a22b`` (dimensions of the Hugging Face
  config.json of Qwen/Qwen3-VL-30B-A3B-Instruct and Qwen/Qwen3-VL-235B-A22B-Instruct; mapped from such a file by
  :func:`spec.hf_vl_config.vl_model_from_hf_config`), or the test-sized ``tiny-vl-moe``;
- a composition ``<encoder>+<llm>``: a catalog encoder (``qwen3-vit``, ``tiny-vit``) with any catalog MoE LLM
  (``qwen3-vit+mixtral-8x7b``); the projector's output width becomes the LLM's hidden size.
"""

from __future__ import annotations

from dataclasses import replace

from spec.catalog import get_model, model_names
from spec.errors import CatalogError, SpecError
from spec.model_spec import ModelSpec
from spec.multimodal import VisionEncoderSpec, VisionLanguageSpec
from spec.suggest import did_you_mean

#: Qwen3-VL's image token id (the text marks each image token with it)
QWEN3_VL_IMAGE_TOKEN_ID = 151655

# Encoders, their projector width left to the LLM they are composed with (out_hidden_size is replaced).
_ENCODERS: dict[str, VisionEncoderSpec] = {
    # Qwen3-VL's SigLIP-2-shaped ViT (vision_config of every Qwen3-VL MoE checkpoint)
    "qwen3-vit": VisionEncoderSpec(num_layers=27, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4304,
                                   out_hidden_size=1, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                                   num_position_embeddings=2304, deepstack_layers=(8, 16, 24)),
    "tiny-vit": VisionEncoderSpec(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                                  out_hidden_size=1, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                                  num_position_embeddings=16, deepstack_layers=(0,)),
}

_QWEN3_VL_TEXT = {
    # text_config of Qwen3-VL-30B-A3B-Instruct: qwen3-30b-a3b's shape with a 256 K position range
    "qwen3-vl-30b-a3b": ModelSpec(
        name="qwen3-vl-30b-a3b-text", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, qk_layernorm=True, max_position_embeddings=262144,
        num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    "qwen3-vl-235b-a22b": ModelSpec(
        name="qwen3-vl-235b-a22b-text", num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
        kv_channels=128, ffn_hidden_size=12288, vocab_size=151936, qk_layernorm=True,
        max_position_embeddings=262144, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536),
}


def compose(name: str, encoder: VisionEncoderSpec, llm: ModelSpec, image_token_id: int | None = None) -> VisionLanguageSpec:
    """``encoder`` with its projector sized to ``llm``'s hidden size, feeding ``llm``: a model named ``name``.
    The image token id defaults to the LLM's last vocabulary entry (a synthetic batch only needs it distinct)."""
    vision = replace(encoder, out_hidden_size=llm.hidden_size)
    token = llm.vocab_size - 1 if image_token_id is None else image_token_id
    return VisionLanguageSpec(name=name, vision=vision, llm=llm, image_token_id=token)


_VL_MODELS: dict[str, VisionLanguageSpec] = {
    name: compose(name, _ENCODERS["qwen3-vit"], text, QWEN3_VL_IMAGE_TOKEN_ID) for name, text in _QWEN3_VL_TEXT.items()
}
_VL_MODELS["tiny-vl-moe"] = compose("tiny-vl-moe", _ENCODERS["tiny-vit"], get_model("tiny-moe"))


def encoder_names() -> list[str]:
    return sorted(_ENCODERS)


def vl_model_names() -> list[str]:
    return sorted(_VL_MODELS)


def get_encoder(name: str) -> VisionEncoderSpec:
    key = name.strip().lower()
    if key not in _ENCODERS:
        raise CatalogError(f"unknown vision encoder {name!r}{did_you_mean(name, encoder_names())}; "
                           f"known encoders: {', '.join(encoder_names())}")
    return _ENCODERS[key]


def is_vl_model(name: str) -> bool:
    """Whether ``name`` names a vision-language model (a published one or an ``encoder+llm`` composition)."""
    key = name.strip().lower()
    return key in _VL_MODELS or "+" in key


def get_vl_model(name: str) -> VisionLanguageSpec:
    """The vision-language model ``name``: a catalog entry or ``<encoder>+<llm>``. CatalogError for an unknown
    name or part; SpecError when the LLM is not MoE."""
    key = name.strip().lower()
    if key in _VL_MODELS:
        return _VL_MODELS[key]
    if "+" in key:
        encoder, _, llm = key.partition("+")
        spec = get_model(llm)
        if not spec.is_moe:
            raise SpecError(f"{name!r}: the LLM {llm!r} is dense; a vision-language MoE model needs a MoE LLM")
        return compose(key, get_encoder(encoder), spec)
    raise CatalogError(f"unknown vision-language model {name!r}{did_you_mean(name, vl_model_names())}; known: "
                       f"{', '.join(vl_model_names())}, or '<encoder>+<llm>' with an encoder of "
                       f"{', '.join(encoder_names())} and a MoE LLM of the catalog "
                       f"({', '.join(n for n in model_names() if get_model(n).is_moe)})")
