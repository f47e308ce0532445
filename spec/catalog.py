"""Built-in catalog of models and hardware, loadable by name and extensible from a YAML or JSON file.

Model dimensions are the published ones (Hugging Face configs / papers of each model). GPU figures are
vendor datasheet numbers: dense (non-sparse) peak FLOP/s, HBM capacity and bandwidth, NVLink bandwidth
per direction, and one 400 Gb/s (50 GB/s) NIC per GPU unless stated. They are starting points; a
calibrated HardwareProfile from ``foldtune calibrate`` replaces them.

A catalog file looks like::

    models:
      my-moe: {num_layers: 24, hidden_size: 2048, num_attention_heads: 16, ffn_hidden_size: 8192,
               vocab_size: 32000, num_experts: 16, moe_router_topk: 2, moe_ffn_hidden_size: 1408}
    hardware:
      my-gpu: {gpu: {name: my-gpu, peak_flops: {bf16: 5.0e14}, hbm_bytes: 8.6e10, hbm_bandwidth: 2.0e12},
               gpus_per_node: 8, intra_node_bandwidth: 3.0e11, intra_node_latency: 5.0e-6,
               inter_node_bandwidth: 2.5e10, inter_node_latency: 1.0e-5}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from spec.errors import CatalogError, FoldtuneError
from spec.hardware import GIB, GPUSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.suggest import did_you_mean

_T = 1e12
_GB = 1e9

_MODELS: dict[str, ModelSpec] = {}
_HARDWARE: dict[str, HardwareProfile] = {}


def _add_model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


def _add_hardware(profile: HardwareProfile) -> None:
    _HARDWARE[profile.name] = profile


# ---- models ---------------------------------------------------------------------------------------
# Routers: Qwen2-MoE, DeepSeek-V2 and OLMoE weight their top-k by the softmax over all experts, not renormalised
# (norm_topk_prob false: moe_router_pre_softmax); GPT-OSS's sliding_window 128 attends to 128 keys, the query's
# own included: Megatron's window_size (127, 0). tests/spec/test_hf_config.py maps each published config.json.
_add_model(ModelSpec(
    name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
    ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=32768,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336))
_add_model(ModelSpec(
    name="mixtral-8x22b", num_layers=56, hidden_size=6144, num_attention_heads=48, num_query_groups=8,
    ffn_hidden_size=16384, vocab_size=32768, max_position_embeddings=65536,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16384))
_add_model(ModelSpec(
    name="qwen2-57b-a14b", num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
    ffn_hidden_size=18944, vocab_size=151936, add_qkv_bias=True, max_position_embeddings=32768,
    num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=2560, moe_shared_expert_intermediate_size=20480,
    moe_shared_expert_gate=True, moe_router_pre_softmax=True))
_add_model(ModelSpec(
    name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
    kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, qk_layernorm=True,
    max_position_embeddings=40960, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768))
_add_model(ModelSpec(
    name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
    kv_channels=128, ffn_hidden_size=12288, vocab_size=151936, qk_layernorm=True,
    max_position_embeddings=40960, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536))
_add_model(ModelSpec(
    name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=10944,
    vocab_size=102400, max_position_embeddings=163840, multi_latent_attention=True, q_lora_rank=None,
    kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
    num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
    moe_first_k_dense=1, moe_router_pre_softmax=True))
_add_model(ModelSpec(
    name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
    vocab_size=129280, max_position_embeddings=163840, multi_latent_attention=True, q_lora_rank=1536,
    kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
    num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
    moe_first_k_dense=3, moe_router_score_function="sigmoid", moe_router_num_groups=8,
    moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, mtp_num_layers=1))
_add_model(ModelSpec(
    name="olmoe-1b-7b", num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=1024,
    vocab_size=50304, qk_layernorm=True, qk_layernorm_scope="all", num_experts=64, moe_router_topk=8,
    moe_ffn_hidden_size=1024, moe_router_pre_softmax=True))
_add_model(ModelSpec(
    name="gpt-oss-120b", num_layers=36, hidden_size=2880, num_attention_heads=64, num_query_groups=8,
    kv_channels=64, ffn_hidden_size=2880, vocab_size=201088, add_bias_linear=True, add_qkv_bias=True,
    max_position_embeddings=131072, num_experts=128, moe_router_topk=4, moe_ffn_hidden_size=2880,
    swiglu=False, quick_geglu=True, activation_func_clamp_value=7.0, glu_linear_offset=1.0,
    softmax_type="learnable", window_size=(127, 0), window_attn_skip_freq=2))
# Small models for tests and CPU tuning runs.
_add_model(ModelSpec(
    name="tiny-moe", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, vocab_size=256, max_position_embeddings=256,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, make_vocab_size_divisible_by=8))
_add_model(ModelSpec(
    name="tiny-moe-shared", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, vocab_size=256, max_position_embeddings=256,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
    moe_first_k_dense=1, make_vocab_size_divisible_by=8))
_add_model(ModelSpec(
    name="small-moe", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
    ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=1024,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512))
# A real-shaped MoE that trains on one GPU with the byte-level tokenizer (docs/training.md): 0.6 B parameters,
# 0.1 B active per token.
_add_model(ModelSpec(
    name="byte-moe-650m", num_layers=12, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
    ffn_hidden_size=4096, vocab_size=256, max_position_embeddings=1024,
    num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=1024, make_vocab_size_divisible_by=128))

# ---- hardware (datasheet figures) -----------------------------------------------------------------
# DGX/HGX H100 and H200: eight ConnectX-7 NICs, one per GPU, 400 Gb/s (50 GB/s) each way; the latency is
# a rule of thumb for one InfiniBand hop through the switch with NCCL's protocol overhead
_DGX_NETWORK = ("datasheet, not measured here: 8 x ConnectX-7 400 Gb/s (one per GPU, DGX H100/H200), "
                "10 us per inter-node step")
_add_hardware(HardwareProfile(
    name="h100-sxm", gpu=GPUSpec("h100-sxm", {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T,
                                              "fp32": 66.9 * _T}, 80 * GIB, 3.35e12),
    gpus_per_node=8, intra_node_bandwidth=450 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=50 * _GB, inter_node_latency=10e-6, nics_per_node=8,
    network_source=_DGX_NETWORK))
_add_hardware(HardwareProfile(
    name="h200", gpu=GPUSpec("h200", {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T,
                                      "fp32": 66.9 * _T}, 141 * 10**9, 4.8e12),
    gpus_per_node=8, intra_node_bandwidth=450 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=50 * _GB, inter_node_latency=10e-6, nics_per_node=8,
    network_source=_DGX_NETWORK))
_add_hardware(HardwareProfile(
    name="b200", gpu=GPUSpec("b200", {"bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T,
                                      "fp32": 75 * _T}, 180 * 10**9, 8.0e12),
    gpus_per_node=8, intra_node_bandwidth=900 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=50 * _GB, inter_node_latency=10e-6))
# GB200 NVL72 and GB300 NVL72 (NVIDIA's rack datasheets, per rack of 72 GPUs, tensor-core figures with 2:4
# sparsity, halved here for dense): FP16/BF16 360 PF and FP8 720 PF, so 2.5 and 5 PF dense per GPU on both;
# HBM3e 13.4 TB (186 GB per GPU) on GB200 and 288 GB per GPU (12-high stacks) on GB300, 576 TB/s per rack
# (8 TB/s per GPU) on both; one NVLink 5 domain of 72 GPUs at 1.8 TB/s per GPU (900 GB/s each way). Scale-out
# NICs, one per GPU: ConnectX-7 at 400 Gb/s (GB200), ConnectX-8 SuperNIC at 800 Gb/s (GB300).
_add_hardware(HardwareProfile(
    name="gb200", gpu=GPUSpec("gb200", {"bf16": 2500 * _T, "fp16": 2500 * _T, "fp8": 5000 * _T,
                                        "fp32": 80 * _T}, 186 * 10**9, 8.0e12),
    gpus_per_node=72, intra_node_bandwidth=900 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=50 * _GB, inter_node_latency=10e-6, nics_per_node=72,
    network_source="datasheet, not measured here: 72 x ConnectX-7 400 Gb/s (one per GPU, GB200 NVL72), "
                   "10 us per inter-node step"))
_add_hardware(HardwareProfile(
    name="gb300", gpu=GPUSpec("gb300", {"bf16": 2500 * _T, "fp16": 2500 * _T, "fp8": 5000 * _T,
                                        "fp32": 80 * _T}, 288 * 10**9, 8.0e12),
    gpus_per_node=72, intra_node_bandwidth=900 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=100 * _GB, inter_node_latency=10e-6, nics_per_node=72,
    network_source="datasheet, not measured here: 72 x ConnectX-8 800 Gb/s (one per GPU, GB300 NVL72), "
                   "10 us per inter-node step"))
_add_hardware(HardwareProfile(
    name="a100-80gb", gpu=GPUSpec("a100-80gb", {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T},
                                  80 * GIB, 2.039e12),
    gpus_per_node=8, intra_node_bandwidth=300 * _GB, intra_node_latency=5e-6,
    inter_node_bandwidth=25 * _GB, inter_node_latency=10e-6))
# One CPU process per rank with gloo over loopback: figures of the order a 2-core CI machine shows;
# `foldtune calibrate` measures the real ones.
_add_hardware(HardwareProfile(
    name="cpu", gpu=GPUSpec("cpu", {"fp32": 50e9, "bf16": 50e9}, 16 * GIB, 10e9),
    gpus_per_node=64, intra_node_bandwidth=2 * _GB, intra_node_latency=50e-6,
    inter_node_bandwidth=1 * _GB, inter_node_latency=100e-6))

_ALIASES = {"h100": "h100-sxm", "h100-80gb": "h100-sxm", "a100": "a100-80gb"}


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    return _ALIASES.get(key, key)


def model_names() -> list[str]:
    return sorted(_MODELS)


def hardware_names() -> list[str]:
    return sorted(_HARDWARE)


def get_model(name: str) -> ModelSpec:
    """The catalog model called ``name`` (case-insensitive)."""
    key = _normalise(name)
    if key not in _MODELS:
        raise CatalogError(f"unknown model {name!r}{did_you_mean(name, model_names())}; "
                           f"known models: {', '.join(model_names())}")
    return _MODELS[key]


def has_hardware(name: str) -> bool:
    """Whether :func:`get_hardware` knows ``name`` (same normalisation and aliases)."""
    return _normalise(name) in _HARDWARE


def get_hardware(name: str) -> HardwareProfile:
    """The catalog hardware profile called ``name`` (case-insensitive; 'h100' means 'h100-sxm')."""
    key = _normalise(name)
    if key not in _HARDWARE:
        raise CatalogError(f"unknown GPU {name!r}{did_you_mean(name, hardware_names())}; "
                           f"known GPUs: {', '.join(hardware_names())}")
    return _HARDWARE[key]


def register_hardware(profile: HardwareProfile) -> None:
    """Add or replace a hardware profile in the catalog of this process."""
    _add_hardware(profile)


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogError(f"cannot read catalog file {str(path)!r}: {exc.strerror}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as exc:  # yaml/json raise many types; one line is what the user needs
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CatalogError(f"catalog file {str(path)!r} is not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if not isinstance(data, dict) or not set(data) <= {"models", "hardware"}:
        raise CatalogError(f"catalog file {str(path)!r} must be a mapping with keys 'models' and/or 'hardware'")
    return data


def load_catalog_file(path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """Register every model and hardware entry of a YAML/JSON catalog file; returns the names added."""
    p = Path(path)
    data = _read_mapping(p)
    added_models: list[str] = []
    added_hw: list[str] = []
    for name, fields in (data.get("models") or {}).items():
        if not isinstance(fields, dict):
            raise CatalogError(f"{str(p)!r}: model {name!r} must be a mapping of ModelSpec fields")
        try:
            spec = ModelSpec.from_dict({"name": str(name), **fields})
        except FoldtuneError as exc:
            raise CatalogError(f"{str(p)!r}: {exc}") from None
        _add_model(ModelSpec.from_dict({**spec.to_dict(), "name": _normalise(spec.name)}))
        added_models.append(_normalise(spec.name))
    for name, fields in (data.get("hardware") or {}).items():
        if not isinstance(fields, dict) or "gpu" not in fields:
            raise CatalogError(f"{str(p)!r}: hardware {name!r} must be a mapping with a 'gpu' entry")
        try:
            profile = HardwareProfile.from_dict({"name": _normalise(str(name)), **fields})
        except (FoldtuneError, TypeError, ValueError) as exc:
            raise CatalogError(f"{str(p)!r}: hardware {name!r}: {exc}") from None
        _add_hardware(profile)
        added_hw.append(profile.name)
    return added_models, added_hw


def load_env_catalog() -> None:
    """Load the catalog file named by ``FOLDTUNE_CATALOG`` (if set)."""
    path = os.environ.get("FOLDTUNE_CATALOG")
    if path:
        load_catalog_file(path)
