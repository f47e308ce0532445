"""Activation offload (executor/offload.py): the chosen modules' saved tensors go through the offload hooks,
and the loss and every gradient equal those without offload."""

from __future__ import annotations

import pytest
import torch

from spec import ParallelConfig, get_model
from spec.errors import InvalidConfigError
from spec.layout_rules import layout_rejections
from executor import offload
from executor.data import global_batch, micro_batches
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state

SHARED = get_model("tiny-moe-shared")  # a dense first layer, then MoE layers with shared experts
SEQ = 16


def _grads(config: ParallelConfig, device: str = "cpu") -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MoEGPT(SHARED, single_process_state(config), ExecutorOptions(), SEQ, device)
    ids, labels = micro_batches(global_batch(SHARED.vocab_size, SEQ, 2, 0, 0), 2, 0, 1, device)[0]
    out = model(ids, labels)
    out.loss.backward()
    return float(out.loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("modules", [("core_attn",), ("layernorm",), ("mlp",), ("moe",),
                                     ("core_attn", "layernorm", "mlp", "moe")])
def test_offloaded_modules_give_the_same_loss_and_gradients(modules, monkeypatch):
    packed = []
    original = offload._pack

    def counting(t):
        out = original(t)
        if out is not t:  # a parameter stays where it is
            packed.append(t.numel())
        return out

    monkeypatch.setattr(offload, "_pack", counting)
    base_loss, base = _grads(ParallelConfig(world_size=1))
    assert not packed  # without offload the hooks are never installed
    loss, grads = _grads(ParallelConfig(world_size=1, activation_offload_modules=modules))
    assert packed, "nothing went through the offload hooks"
    assert loss == base_loss
    for a, b in zip(grads, base):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_offload_packs_copies_and_leaves_parameters():
    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    device, host, done = offload._pack(y)
    assert host.data_ptr() != y.data_ptr() and torch.equal(host, y) and done is None
    assert offload._unpack((device, host, done)) is host
    assert offload._pack(weight) is weight
    view = weight.t()
    assert offload._pack(view) is view  # a view of a parameter is kept as is


@pytest.mark.parametrize("kwargs, message", [
    (dict(activation_offload_modules=("attn",)), "unknown activation_offload_modules"),
    (dict(optimizer_cpu_offload_fraction=1.5), "fraction in [0, 1]"),
])
def test_offload_knobs_out_of_range_are_refused_by_the_constructor(kwargs, message):
    with pytest.raises(InvalidConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelConfig(world_size=1, **kwargs)


@pytest.mark.parametrize("kwargs, rule, message", [
    (dict(activation_offload_modules=("moe",), recompute_granularity="full"), "activation_offload", "full recompute"),
    (dict(activation_offload_modules=("core_attn",), recompute_granularity="selective",
          recompute_modules=("core_attn",)), "activation_offload", "both recomputed and offloaded"),
    (dict(optimizer_cpu_offload_fraction=0.5, use_distributed_optimizer=False, overlap_param_gather=False),
     "optimizer_offload_distopt", "needs the distributed optimizer"),
])
def test_offload_knobs_that_do_not_go_together_break_a_named_rule(kwargs, rule, message):
    found = layout_rejections(ParallelConfig(world_size=1, **kwargs))
    assert [r.rule for r in found] == [rule] and message in found[0].reason


def test_offload_knobs_round_trip_through_label_dict_and_optuna_params():
    cfg = ParallelConfig(world_size=4, ep=4, optimizer_cpu_offload_fraction=0.25,
                         activation_offload_modules=("moe", "core_attn"))
    assert cfg.activation_offload_modules == ("core_attn", "moe")  # one spelling per set
    assert "opt_offload=0.25" in cfg.label() and "act_offload=core_attn+moe" in cfg.label()
    assert ParallelConfig.parse(cfg.label()) == cfg
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert ParallelConfig.from_optuna_params(cfg.to_optuna_params(), 4) == cfg
    plain = ParallelConfig(world_size=4, ep=4)
    assert "offload" not in plain.label()
    old = {k: v for k, v in plain.to_optuna_params().items() if k not in ("opt_offload", "act_offload")}
    assert ParallelConfig.from_optuna_params(old, 4) == plain  # studies begun before offload was searched


@pytest.mark.parametrize("recomputed", [("shared_experts",), ("moe_act",), ("core_attn", "layernorm")])
def test_offload_beside_selective_recompute_of_other_modules(recomputed):
    base_loss, base = _grads(ParallelConfig(world_size=1, recompute_granularity="selective",
                                            recompute_modules=recomputed))
    cfg = ParallelConfig(world_size=1, recompute_granularity="selective", recompute_modules=recomputed,
                         activation_offload_modules=("moe", "mlp"))
    loss, grads = _grads(cfg)
    assert loss == base_loss
    for a, b in zip(grads, base):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned copies on a side stream")
def test_cuda_offload_gives_the_same_loss_and_gradients():
    base_loss, base = _grads(ParallelConfig(world_size=1), "cuda")
    loss, grads = _grads(ParallelConfig(world_size=1, activation_offload_modules=("core_attn", "layernorm", "moe",
                                                                                    "mlp")), "cuda")
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for a, b in zip(grads, base):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
