"""Head features (blocks after the decoder on the last stage: MTP) as registry entries: the spec, the cost model
and the executor hold the same features, DeepSeek-V3 selects MTP by its field, a feature the cost model cannot
price or the executor cannot build is refused by name, and a feature added from this one file (its spec entry,
its pricing of a block's own work and its executor module) is counted, priced, built and trained without any
other file knowing it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from costmodel.estimate import estimate
from costmodel.head_pricing import PRICING, HeadPricing
from costmodel.params import layer_params, stage_param_counts
from executor.head_modules import HEAD_MODULES
from executor.model import MoEGPT
from executor.parallel.groups import build_parallel_state
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import output_cross_entropy
from spec.catalog import get_hardware, get_model, model_names
from spec.errors import InvalidConfigError, SpecError
from spec.flops import flops_per_token
from spec.hardware import ClusterSpec
from spec.head_features import (HEAD_FEATURES, MTP, HeadFeature, head_blocks, head_features, last_stage_embeds,
                                output_heads, register_head_feature)
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def test_every_feature_has_a_pricing_and_a_module():
    assert set(HEAD_FEATURES) == set(PRICING) == set(HEAD_MODULES) >= {"mtp"}


@pytest.mark.parametrize("name", model_names())
def test_catalog_models_select_mtp_by_their_depth(name):
    model = get_model(name)
    depth = model.mtp_num_layers
    assert head_features(model) == (((MTP, depth),) if depth else ())
    assert head_blocks(model) == depth and output_heads(model) == 1 + depth
    assert last_stage_embeds(model) == bool(depth)


# ---- a new feature, all of it here: deep supervision (each block re-runs a layer and adds a cross-entropy) ----
@dataclasses.dataclass(frozen=True)
class ToySpec(ModelSpec):
    """A real feature's depth field would sit in ModelSpec; the test keeps it out of the product's schema."""

    tail_layers: int = 0


TAIL = HeadFeature(name="tail", label="deep supervision", depth_field="tail_layers", own_flops=lambda m: 0)


class TailPricing(HeadPricing):
    """No work of its own: a block is its layer and its output head."""

    def params(self, model, tp):
        return 0, 0

    def activation_bytes(self, model, training, sp_split):
        return 0.0

    def own_time(self, parts, block):
        pass


class DeepSupervision(torch.nn.Module):
    """Each block runs its layer on the previous block's output and scores it against the model's own labels."""

    def __init__(self, spec, options, state, layers, kernels, device, dtype, timer):
        super().__init__()
        self.spec, self.state, self.loss_scale = spec, state, 0.5
        self.blocks = torch.nn.ModuleList(layers)
        self.padded_vocab = spec.padded_vocab_size(state.tp.size)

    def decoder_layers(self):
        return list(self.blocks)

    def forward(self, h0_SBH, labels_BS, rope, embedding_VH, output_VH, cp_positions):
        h, total, router = h0_SBH, 0.0, h0_SBH.new_zeros((), dtype=torch.float32)
        for layer in self.blocks:
            h, layer_loss = layer(h, rope)
            router = router + layer_loss
            ce = output_cross_entropy(enter_tp(h, self.state), output_VH, labels_BS.t(), self.spec.vocab_size,
                                      self.padded_vocab, self.state, 0)
            total = total + ce.mean()
        return total / len(self.blocks), router


@pytest.fixture
def tail():
    entries = ((HEAD_FEATURES, TAIL), (PRICING, TailPricing()), (HEAD_MODULES, DeepSupervision))
    for registry, entry in entries:
        registry.add(TAIL.name, entry)
    yield TAIL  # pytest runs the rest after the test, failed or not
    for registry, _ in entries:
        registry.pop(TAIL.name)


def _toy_model(depth: int = 2) -> ToySpec:
    base = get_model("tiny-moe")
    return ToySpec(**{**base.to_dict(), "name": "tiny-deep-supervision", "tail_layers": depth})


TRAINING = TrainingSpec(seq_length=256, global_batch_size=8)


def test_a_feature_without_a_pricing_or_a_module_is_refused_by_name():
    register_head_feature(TAIL)
    try:
        model = _toy_model()
        with pytest.raises(InvalidConfigError, match="tail"):
            stage_param_counts(model, ParallelConfig(world_size=1), 0)
        with pytest.raises(SpecError, match="tail"):
            MoEGPT(model, build_parallel_state(ParallelConfig(world_size=1), 0), seq_length=16)
    finally:
        HEAD_FEATURES.pop(TAIL.name)


def test_the_spec_layer_counts_the_new_feature(tail):
    model, plain = _toy_model(), _toy_model(0)
    assert head_features(model) == ((tail, 2),) and head_features(plain) == ()
    assert head_blocks(model) == 2 and output_heads(model) == 3 and not last_stage_embeds(model)
    # two more layers of the last layer's kind (tiny-moe's are all MoE) and two more logit GEMMs
    deeper = plain.with_layers(plain.num_layers + 2)
    assert set(deeper.moe_layer_pattern()) == {1}
    logits = 3 * 2 * plain.hidden_size * plain.padded_vocab_size()
    assert flops_per_token(model, 256) == pytest.approx(flops_per_token(deeper, 256) + 2 * logits)


def test_the_cost_model_prices_the_new_feature(tail):
    model, plain = _toy_model(), _toy_model(0)
    config = ParallelConfig(world_size=2, ep=2)
    last = bool(model.moe_layer_pattern()[-1])
    assert stage_param_counts(model, config, 0) == stage_param_counts(plain, config, 0) \
        + layer_params(model, 1, 2, 1, last) * 2
    cluster = ClusterSpec(get_hardware("h100-sxm"), 2)
    e, base = estimate(model, TRAINING, cluster, config), estimate(plain, TRAINING, cluster, config)
    assert math.isfinite(e.time.step_time)
    assert dict(e.time.terms)["gemm"] > dict(base.time.terms)["gemm"]  # the blocks' layers and output heads
    assert dict(e.memory.details)["act.tail.blocks"] > 0
    assert e.memory.weights > base.memory.weights


def test_the_executor_builds_and_trains_the_new_feature(tail):
    model = _toy_model()
    gpt = MoEGPT(model, build_parallel_state(ParallelConfig(world_size=1), 0), seq_length=16)
    assert isinstance(gpt.tail, DeepSupervision) and gpt.heads == [gpt.tail]
    assert len(gpt.decoder_layers()) == model.num_layers + 2
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = gpt(ids, ids.roll(-1, dims=1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.mtp_loss > 0  # the heads' loss, in the step's loss statistic
    grads = [p.grad for p in gpt.tail.blocks[1].parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_a_feature_named_like_a_part_of_the_model_is_refused():
    clash = dataclasses.replace(TAIL, name="layers")
    entries = ((HEAD_FEATURES, clash), (HEAD_MODULES, DeepSupervision))
    for registry, entry in entries:
        registry.add(clash.name, entry)
    try:
        with pytest.raises(SpecError, match="named like a part of the model"):
            MoEGPT(_toy_model(), build_parallel_state(ParallelConfig(world_size=1), 0), seq_length=16)
    finally:
        for registry, _ in entries:
            registry.pop(clash.name)
