"""spec.hf_config: each published config.json maps to its catalog entry; unknown or unsupported fields are named."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path

import pytest

from spec.catalog import get_model
from spec.errors import SpecError
from spec.hf_config import FAMILIES, IGNORED, load_hf_model, model_from_hf_config, read_hf_config

CONFIGS = Path(__file__).parent / "hf_configs"
NAMES = sorted(p.name for p in CONFIGS.iterdir())


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_every_family_has_a_published_config():
    assert {_config(n)["model_type"] for n in NAMES} == set(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_published_config_maps_to_the_catalog_entry(name):
    mapped = load_hf_model(CONFIGS / name)
    catalog = get_model(name)
    assert mapped.spec.name == name  # named after the directory
    differ = [f.name for f in fields(catalog) if getattr(mapped.spec, f.name) != getattr(catalog, f.name)]
    assert differ == []


def test_executor_numbers_and_issues():
    mixtral = load_hf_model(CONFIGS / "mixtral-8x7b" / "config.json")
    assert (mixtral.rotary_base, mixtral.norm_epsilon, mixtral.eos_token_id) == (1e6, 1e-5, 2)
    assert mixtral.executor_issues == () and not mixtral.expert_bias
    v3 = load_hf_model(CONFIGS / "deepseek-v3")
    assert v3.expert_bias and v3.executor_options()["moe_router_enable_expert_bias"]
    assert any("yarn" in i for i in v3.executor_issues) and any("fp8" in i for i in v3.executor_issues)
    olmoe = load_hf_model(CONFIGS / "olmoe-1b-7b")  # q/k norms over all heads: built (qk_layernorm_scope)
    assert olmoe.executor_issues == () and olmoe.spec.qk_layernorm_scope == "all"


def test_unknown_field_is_named():
    config = _config("qwen3-30b-a3b")
    config["my_new_knob"] = 3
    with pytest.raises(SpecError, match="not understood by the qwen3_moe mapping: my_new_knob"):
        model_from_hf_config(config, "x")


@pytest.mark.parametrize("name, key, value, match", [
    ("mixtral-8x7b", "hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("qwen3-30b-a3b", "attention_bias", True, "'attention_bias' = True is not supported"),
    ("qwen2-57b-a14b", "use_sliding_window", True, "'use_sliding_window' = true is not supported"),
    ("olmoe-1b-7b", "clip_qkv", 8.0, "'clip_qkv' = 8.0 is not supported"),
    ("deepseek-v3", "topk_method", "random", "'topk_method' = 'random' is not supported"),
    ("gpt-oss-120b", "swiglu_alpha", 2.0, "'swiglu_alpha' = 2.0 is not supported"),
    ("mixtral-8x7b", "model_type", "llama", "'model_type' = 'llama' is not supported"),
    ("mixtral-8x7b", "num_hidden_layers", None, "field 'num_hidden_layers' is required"),
    ("mixtral-8x7b", "vocab_size", "32000", "field 'vocab_size' must be an integer"),
])
def test_unsupported_values_are_named(name, key, value, match):
    config = _config(name)
    config[key] = value
    with pytest.raises(SpecError, match=match):
        model_from_hf_config(config, "x")


def test_ignored_fields_are_ignored_and_files_are_bounded(tmp_path):
    config = _config("mixtral-8x7b")
    for key in IGNORED:
        config.setdefault(key, None)
    assert model_from_hf_config(copy.deepcopy(config), "m").spec == model_from_hf_config(_config("mixtral-8x7b"), "m").spec
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "a" * (1 << 20)}))
    with pytest.raises(SpecError, match="more than a config.json"):
        read_hf_config(big)
    with pytest.raises(SpecError, match="cannot read"):
        read_hf_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_hf_config(tmp_path / "bad.json")


def test_qwen_dense_layers_and_gptoss_window_pattern():
    config = _config("qwen3-30b-a3b")
    config.update(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)
    assert model_from_hf_config(config, "q").spec.moe_layer_pattern() == (0, 1, 1, 1)
    config = _config("gpt-oss-120b")
    config.update(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    spec = model_from_hf_config(config, "g").spec
    assert [spec.attention_window(i) for i in range(3)] == [None, 127, 127]


@pytest.mark.parametrize("key, value", [("layer_types", 3), ("rope_parameters", [1]), ("swiglu_alpha", "x"),
                                        ("num_hidden_layers", 10**9), ("mlp_only_layers", "0"),
                                        ("num_experts_per_tok", True)])
def test_wrong_json_types_are_spec_errors(key, value):
    """What a client may send in an API body: never an exception other than SpecError (a 422, not a 500)."""
    family = "gpt_oss" if key in ("layer_types", "swiglu_alpha", "num_experts_per_tok") else "qwen3_moe"
    config = _config("gpt-oss-120b" if family == "gpt_oss" else "qwen3-30b-a3b")
    config[key] = value
    with pytest.raises(SpecError):
        model_from_hf_config(config, "x")


@pytest.mark.parametrize("name", NAMES + ["tiny-moe"])
def test_catalog_models_write_a_config_that_maps_back(name):
    from spec.hf_config import hf_config_from_spec

    spec = get_model(name)
    config = hf_config_from_spec(spec, 1e6, 1e-5)
    assert (config["model_type"] == "olmoe") == (spec.qk_layernorm_scope == "all")
    mapped = model_from_hf_config(config, name)
    ffn = spec.ffn_hidden_size if spec.num_dense_layers else mapped.spec.ffn_hidden_size  # unused without dense layers
    assert mapped.spec.to_dict() == {**spec.to_dict(), "make_vocab_size_divisible_by": 128, "ffn_hidden_size": ffn}
    assert (mapped.rotary_base, mapped.norm_epsilon) == (1e6, 1e-5)


def test_a_spec_without_a_hugging_face_form_is_named():
    from spec.hf_config import hf_config_from_spec

    with pytest.raises(SpecError, match="no exact Hugging Face mixtral form: .*moe_shared_expert_intermediate_size"):
        hf_config_from_spec(get_model("tiny-moe-shared"))
