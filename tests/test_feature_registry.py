"""Attention kinds and q/k norm scopes as registry entries: every layer holds an entry for each spec-level kind
(and the executor one for each scope), the catalog's models select the kinds their flags name, and a kind added
from this one file (its spec entry, its cost-model pricing and its executor module) is selected by a model,
priced by the cost model and built and trained by the executor, without any other file knowing it; so is a
norm scope (its spec entry and its executor module)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from costmodel.attention_pricing import PRICING, AttentionPricing, attention_pricing
from costmodel.collective_inventory import step_inventory
from costmodel.estimate import estimate
from costmodel.params import attention_params
from executor.attention_modules import ATTENTION_MODULES
from executor.model import MoEGPT
from executor.parallel.groups import build_parallel_state
from executor.parallel.sharding import ShardInfo, make_param
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.qk_norms import QK_NORM_MODULES
from spec.attention_kinds import ATTENTION_KINDS, GQA, MLA, AttentionKind, attention_kind, register_attention_kind
from spec.catalog import get_hardware, get_model, model_names
from spec.errors import InvalidConfigError, SpecError
from spec.flops import flops_per_token
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.norm_scopes import QK_NORM_SCOPES, NormScope
from spec.parallel_config import ParallelConfig
from spec.proxy import tiny_proxy
from spec.training_spec import TrainingSpec
from spec.validity import Validator, unsupported_features


def test_every_kind_has_a_pricing_and_a_module():
    assert set(ATTENTION_KINDS) == set(PRICING) == set(ATTENTION_MODULES) >= {"gqa", "mla"}


@pytest.mark.parametrize("name", model_names())
def test_catalog_models_select_the_kind_their_flags_name(name):
    model = get_model(name)
    assert attention_kind(model) is (MLA if model.multi_latent_attention else GQA)
    assert attention_kind(tiny_proxy(model)) is attention_kind(model)


def test_recompute_modules_of_another_kind_are_refused_by_name():
    mixtral = get_model("mixtral-8x7b")
    config = ParallelConfig(world_size=8, recompute_granularity="selective", recompute_modules=("mla_up_proj",))
    rejection = Validator(mixtral, TrainingSpec(seq_length=4096, global_batch_size=64),
                          ClusterSpec(get_hardware("h100-sxm"), 8)).knobs(config)
    assert rejection.rule == "recompute_modules" and "multi-latent attention" in rejection.reason
    assert "standard attention" in rejection.reason


# ---- a new kind, all of it here: causal mean attention (each token's value averaged over the tokens up to it) ----
@dataclasses.dataclass(frozen=True)
class ToySpec(ModelSpec):
    """A real kind's selecting field would sit in ModelSpec; the test keeps it out of the product's schema."""

    causal_mean_attention: bool = False
    mean_width: int = 16


def _toy_flops(model, seq_length: int, num_layers: int) -> float:
    return 3 * 2 * num_layers * 2 * model.hidden_size * model.mean_width  # value and output projections


TOY = AttentionKind(
    name="causal_mean", label="causal-mean", selects=lambda m: getattr(m, "causal_mean_attention", False),
    head_dim=lambda m: m.mean_width, rotary_head_dim=lambda m: m.mean_width, flops=_toy_flops,
    problems=lambda m: [] if m.mean_width >= 1 else ["mean_width must be positive"],
    tiny_fields=lambda m: {"mean_width": 8}, hf_names={"wv.weight": "v_proj.weight", "wo.weight": "o_proj.weight"})


class ToyPricing(AttentionPricing):
    """Two unsplit projections h -> w -> h per token, a running mean, no collectives (tp = cp = 1 only)."""

    def params(self, model, tp):
        return 0, 2 * model.hidden_size * model.mean_width

    def param_tensors(self, model, tp):
        return [model.hidden_size * model.mean_width, model.hidden_size * model.mean_width, model.hidden_size]

    def activations(self, model, training, shape):
        return [("act.toy.values", model.mean_width * training.activation_bytes, frozenset())], model.mean_width, 0.0

    def gradient_width(self, model):
        return model.mean_width

    def tp_gather_width(self, model):
        return model.hidden_size

    def kv_exchange(self, model):
        return 1, model.mean_width, model.mean_width

    def layer_time(self, parts, block):
        w = parts.model.mean_width
        parts.attention_comm(block)
        parts.linear(block, parts.tokens, w, parts.model.hidden_size)
        parts.elementwise(block, 2 * w * parts.tokens * parts.act_bytes)  # the running mean
        parts.linear(block, parts.tokens, parts.model.hidden_size, w)
        return 0.0, 0.0


class CausalMean(torch.nn.Module):
    def __init__(self, spec, options, state, layer, kernels, device, dtype, timer):
        super().__init__()
        self.window, self.plain, self.mask = None, True, None  # what MoEGPT sets masks by: none needed
        self.eps = options.norm_epsilon
        p, w, h = f"layers.{layer}.attention.", spec.mean_width, spec.hidden_size

        def param(name, shape, init="normal", **kw):
            return make_param(ShardInfo(p + name, shape, **kw), state, init, options.init_method_std, options.seed,
                              device, dtype)

        self.norm = param("norm.weight", (h,), "ones", tp_partial=True)
        self.wv, self.wo = param("wv.weight", (w, h)), param("wo.weight", (h, w))

    def forward(self, x_SBH, rope):
        x = x_SBH * torch.rsqrt(x_SBH.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        v = x @ self.wv.T
        counts = torch.arange(1, v.shape[0] + 1, device=v.device, dtype=v.dtype).view(-1, 1, 1)
        return (v.cumsum(0) / counts) @ self.wo.T


@pytest.fixture
def toy_kind():
    register_attention_kind(TOY)
    PRICING.add(TOY.name, ToyPricing())
    ATTENTION_MODULES.add(TOY.name, CausalMean)
    try:
        yield TOY
    finally:
        for registry in (ATTENTION_KINDS, PRICING, ATTENTION_MODULES):
            registry.pop(TOY.name)


def _toy_model() -> ToySpec:
    base = get_model("tiny-moe")
    return ToySpec(**{**base.to_dict(), "name": "tiny-causal-mean", "num_query_groups": None,
                      "causal_mean_attention": True, "mean_width": 24})


def test_a_kind_without_a_pricing_or_a_module_is_refused_by_name():
    register_attention_kind(TOY)
    try:
        model = _toy_model()
        with pytest.raises(InvalidConfigError, match="causal_mean"):
            attention_params(model, 1)
        with pytest.raises(SpecError, match="causal_mean"):
            MoEGPT(model, build_parallel_state(ParallelConfig(world_size=1), 0), seq_length=16)
    finally:
        ATTENTION_KINDS.pop(TOY.name)


def test_a_model_selects_the_new_kind_and_the_spec_layer_follows_it(toy_kind):
    model = _toy_model()
    assert attention_kind(model) is toy_kind and model.head_dim == 24
    assert attention_kind(get_model("tiny-moe")) is GQA  # the models that do not select it keep theirs
    assert tiny_proxy(model).mean_width == 8
    with pytest.raises(Exception, match="mean_width must be positive"):
        dataclasses.replace(model, mean_width=0)
    plain = dataclasses.replace(model, causal_mean_attention=False, num_query_groups=None)
    mlp_and_logits = flops_per_token(plain, 256) - GQA.flops(plain, 256, plain.num_layers)
    assert flops_per_token(model, 256) == pytest.approx(mlp_and_logits + _toy_flops(model, 256, model.num_layers))
    assert unsupported_features(model) == []


def test_the_cost_model_prices_the_new_kind(toy_kind):
    model = _toy_model()
    assert isinstance(attention_pricing(model), ToyPricing)
    h, w = model.hidden_size, model.mean_width
    assert attention_params(model, 1).total == 2 * h * w + h  # the two projections and the input norm
    training = TrainingSpec(seq_length=256, global_batch_size=8)
    config = ParallelConfig(world_size=2, ep=2)
    e = estimate(model, training, ClusterSpec(get_hardware("h100-sxm"), 2), config)
    assert math.isfinite(e.time.step_time) and e.time.step_time > 0
    assert any(name.startswith("act.toy.values") for name, _ in e.memory.details)
    assert step_inventory(model, training, config)  # the collectives: gradients, dispatch
    wider = estimate(dataclasses.replace(model, mean_width=4 * w), training, ClusterSpec(get_hardware("h100-sxm"), 2),
                     config)
    assert wider.memory.weights > e.memory.weights
    assert dict(wider.time.terms)["gemm"] > dict(e.time.terms)["gemm"]  # the toy's projections are GEMMs


def test_the_executor_builds_and_trains_the_new_kind(toy_kind):
    model = _toy_model()
    state = build_parallel_state(ParallelConfig(world_size=1), 0)
    gpt = MoEGPT(model, state, seq_length=16)
    assert isinstance(gpt.layers[0].attention, CausalMean)
    names = {p.shard_info.name for p in gpt.parameters()}
    assert {"layers.0.attention.wv.weight", "layers.0.attention.wo.weight"} <= names
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = gpt(ids, ids.roll(-1, dims=1))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    grad = gpt.layers[0].attention.wv.grad
    assert grad is not None and grad.abs().sum() > 0


# ---- q/k norm scopes: the spec's entry prices itself; the executor's module is the other half ----------------
def test_every_norm_scope_has_a_module():
    assert set(QK_NORM_SCOPES) == set(QK_NORM_MODULES) >= {"head", "all"}


class PairQKNorm(torch.nn.Module):
    """A test scope: one RMSNorm over each pair of adjacent heads, weights [2·d] whole on every TP rank."""

    def __init__(self, spec, param, kernels, state, eps, fused):
        super().__init__()
        self.rms_norm, self.eps, self.width = pick_rms_norm(fused, kernels), eps, 2 * spec.head_dim
        self.q_norm = param("q_norm.weight", (self.width,), "ones", tp_partial=True)
        self.k_norm = param("k_norm.weight", (self.width,), "ones", tp_partial=True)

    def forward(self, q, k):
        s, b = q.shape[:2]
        return tuple(self.rms_norm(x.view(s, b, -1, self.width), w, self.eps).view(s, b, -1)
                     for x, w in ((q, self.q_norm), (k, self.k_norm)))


@pytest.fixture
def pair_scope():
    scope = NormScope("pair", "pairs of heads", weight_widths=lambda m: (2 * m.head_dim, 2 * m.head_dim),
                      split_with_heads=False, hf_model_type="qwen3_moe")
    QK_NORM_SCOPES.add(scope.name, scope)
    QK_NORM_MODULES.add(scope.name, PairQKNorm)
    try:
        yield scope
    finally:
        QK_NORM_SCOPES.pop(scope.name)
        QK_NORM_MODULES.pop(scope.name)


def test_a_new_norm_scope_is_priced_and_built_from_its_two_entries(pair_scope):
    base = get_model("tiny-moe")
    model = dataclasses.replace(base, name="tiny-pair-norm", qk_layernorm=True, qk_layernorm_scope="pair")
    d = model.head_dim
    assert attention_params(model, 2).dense_replicated == attention_params(base, 2).dense_replicated + 2 * 2 * d
    state = build_parallel_state(ParallelConfig(world_size=1), 0)
    gpt = MoEGPT(model, state, seq_length=16)
    norm = gpt.layers[0].attention.qk_norm
    assert isinstance(norm, PairQKNorm) and norm.q_norm.shape == (2 * d,)
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    gpt(ids, ids.roll(-1, dims=1)).loss.backward()
    assert norm.q_norm.grad is not None and norm.q_norm.grad.abs().sum() > 0
