"""Single-process checks of the MoE pieces against naive per-token / per-expert loops."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from costmodel.catalog import get_model
from executor.dispatcher import chunk_order
from executor.kernels import get_backend
from executor.kernels.torch_backend import padded_grouped_mm
from executor.moe import MoELayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state

TINY = get_model("tiny-moe")
N_TOKENS = 24


def _layer(spec, options, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(spec, dataclasses.replace(options, seed=seed), single_process_state(), 0,
                     get_backend("torch"), torch.device("cpu"), torch.float32)
    x = torch.randn(N_TOKENS, 1, spec.hidden_size, requires_grad=True)
    return layer, x


def _naive_routing(spec, logits):
    """Per-token top-k with Megatron's score functions (loops over tokens, no vectorised tricks)."""
    experts, probs = [], []
    for row in logits:
        if spec.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(row)
            select = scores.clone()
            if spec.moe_router_num_groups:
                size = spec.num_experts // spec.moe_router_num_groups
                group_scores = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)
                                [: spec.moe_router_topk // spec.moe_router_group_topk]
                                for g in range(spec.moe_router_num_groups)]
                best = sorted(range(spec.moe_router_num_groups), key=lambda g: -sum(group_scores[g]))
                for g in best[spec.moe_router_group_topk:]:
                    select[g * size:(g + 1) * size] = -math.inf
            idx = select.topk(spec.moe_router_topk).indices
            p = scores[idx] / scores[idx].sum()
        elif spec.moe_router_pre_softmax:
            scores = torch.softmax(row, -1)
            idx = scores.topk(spec.moe_router_topk).indices
            p = scores[idx]
        else:
            idx = row.topk(spec.moe_router_topk).indices
            p = torch.softmax(row[idx], -1)
        experts.append(idx)
        probs.append(p * (spec.moe_router_topk_scaling_factor or 1.0))
    return torch.stack(experts), torch.stack(probs)


def _naive_expert(layer, e, x_H):
    w1, w3, w2 = layer.experts.w1[e], layer.experts.w3[e], layer.experts.w2[e]
    return F.linear(F.silu(F.linear(x_H, w1)) * F.linear(x_H, w3), w2)


SPECS = {
    "softmax": TINY,
    "pre_softmax": dataclasses.replace(TINY, moe_router_pre_softmax=True),
    "sigmoid_grouped": dataclasses.replace(TINY, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                           moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
    "shared": get_model("tiny-moe-shared"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_layer_matches_per_token_loop(name):
    spec = SPECS[name]
    layer, x = _layer(spec, ExecutorOptions())
    y, _ = layer(x)
    tokens = x.view(N_TOKENS, -1)
    experts, probs = _naive_routing(spec, F.linear(tokens, layer.router.weight))
    rows = []
    for t in range(N_TOKENS):
        rows.append(sum(probs[t, j] * _naive_expert(layer, int(experts[t, j]), tokens[t])
                        for j in range(spec.moe_router_topk)))
    ref = torch.stack(rows).view_as(y)
    if layer.shared is not None:
        ref = ref + layer.shared(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    params = [x, layer.router.weight, layer.experts.w1, layer.experts.w2, layer.experts.w3]
    got = torch.autograd.grad(y, params, g)
    want = torch.autograd.grad(ref, params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_aux_and_z_loss_follow_megatron_normalisation():
    coeff, z_coeff = 1e-2, 1e-3
    layer, x = _layer(TINY, ExecutorOptions(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff))
    routing = layer.router(x.view(N_TOKENS, -1))
    logits = F.linear(x.view(N_TOKENS, -1), layer.router.weight)
    counts = torch.bincount(routing.experts_NK.reshape(-1), minlength=TINY.num_experts).float()
    scores = torch.softmax(logits, -1)
    e, k, t = TINY.num_experts, TINY.moe_router_topk, N_TOKENS
    aux = (scores.sum(0) * counts).sum() * e * coeff / (k * t * t)
    z = z_coeff * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(routing.loss, aux + z)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_by_policy_and_output_skips_dropped(policy):
    cf = 0.5
    layer, x = _layer(TINY, ExecutorOptions(moe_expert_capacity_factor=cf, moe_token_drop_policy=policy))
    tokens = x.view(N_TOKENS, -1)
    routing = layer.router(tokens)
    capacity = math.ceil(N_TOKENS * TINY.moe_router_topk / TINY.num_experts * cf)
    all_experts, all_probs = _naive_routing(TINY, F.linear(tokens, layer.router.weight))
    kept = routing.experts_NK != TINY.num_experts
    assert (~kept).any(), "capacity factor 0.5 must drop something"
    for e in range(TINY.num_experts):
        mine = all_experts == e
        assert int((kept & mine).sum()) == min(capacity, int(mine.sum()))
        if policy == "position" and (mine & ~kept).any():
            last_kept = (mine & kept).nonzero()[:, 0].max()
            first_dropped = (mine & ~kept).nonzero()[:, 0].min()
            assert last_kept <= first_dropped
        if policy == "probs" and (mine & ~kept).any():
            assert all_probs[mine & kept].min() >= all_probs[mine & ~kept].max()
    y, _ = layer(x)
    ref = torch.stack([sum((all_probs[t, j] * _naive_expert(layer, int(all_experts[t, j]), tokens[t])
                            for j in range(TINY.moe_router_topk) if kept[t, j]), torch.zeros(TINY.hidden_size))
                       for t in range(N_TOKENS)])
    torch.testing.assert_close(y.view(N_TOKENS, -1), ref, rtol=1e-5, atol=1e-6)


def test_expert_bias_moves_toward_underloaded_experts():
    spec = SPECS["sigmoid_grouped"]
    layer, x = _layer(spec, ExecutorOptions(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1))
    routing = layer.router(x.view(N_TOKENS, -1))
    counts = routing.tokens_per_expert.float()
    layer.router.update_expert_bias()
    expected = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.router.step_counts.sum() == 0


def test_padded_grouped_mm_matches_torch_grouped_mm_with_empty_groups():
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    offs = torch.tensor([3, 3, 10, 12], dtype=torch.int32)
    a = padded_grouped_mm(x, w, offs)
    b = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(a, b)
    g = torch.randn_like(a)
    for p, q in zip(torch.autograd.grad(a, (x, w), g), torch.autograd.grad(b, (x, w), g)):
        torch.testing.assert_close(p, q)


def test_grouped_mm_with_no_rows_still_reaches_inputs():
    backend = get_backend("torch")
    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(2, 16, 8, requires_grad=True)
    out = backend.grouped_mm(x, w, torch.tensor([0, 0], dtype=torch.int32))
    assert out.shape == (0, 16)
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert gx.shape == x.shape and torch.count_nonzero(gw) == 0


def test_chunk_order_regroups_source_major_rows_by_expert():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source, expert]
    labels = []
    for s in range(2):
        for e in range(3):
            labels += [(e, s)] * int(counts[s, e])
    order = chunk_order(counts)
    regrouped = [labels[i] for i in order.tolist()]
    assert regrouped == sorted(labels)


def test_forced_load_balancing_spreads_assignments_evenly():
    layer, x = _layer(TINY, ExecutorOptions(moe_router_force_load_balancing=True))
    routing = layer.router(x.view(N_TOKENS, -1))
    per_expert = N_TOKENS * TINY.moe_router_topk // TINY.num_experts
    assert routing.tokens_per_expert.tolist() == [per_expert] * TINY.num_experts
    assert all(len(set(row)) == TINY.moe_router_topk for row in routing.experts_NK.tolist())
    y, _ = layer(x)
    y.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0  # probabilities still come from the router
