"""Single-process checks of the MoE pieces against naive per-token / per-expert loops."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from spec.catalog import get_model
from spec.errors import InvalidConfigError, SpecError
from executor.dispatcher import chunk_order
from executor.kernels import get_backend
from executor.kernels.torch_backend import padded_grouped_mm
from executor.moe import GroupedExperts, MoELayer
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
    w1, w3, w2 = layer.experts.w13[e, 0], layer.experts.w13[e, 1], layer.experts.w2[e]
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
    params = [x, layer.router.weight, layer.experts.w13, layer.experts.w2]
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


def _fake_state(etp: int, etp_rank: int, ep: int, ep_rank: int):
    """A ParallelState whose etp/ep groups have the given size and rank (no communicators: slicing only)."""
    from spec.parallel_config import ParallelConfig
    from executor.parallel.groups import Group, ParallelState

    groups = {"tp": Group("tp", (0,), 0), "etp": Group("etp", tuple(range(etp)), etp_rank),
              "ep": Group("ep", tuple(range(ep)), ep_rank)}
    return ParallelState(ParallelConfig(world_size=1), 0, groups)


@pytest.mark.parametrize("etp,ep", [(2, 1), (2, 2), (1, 4)])
def test_w13_slices_hold_both_gate_and_up_of_the_reference_weights(etp, ep):
    """Every ETP·EP rank's w13 is its [experts, both halves, ffn slice, hidden] cut of the single-process
    tensor, and the checkpoint loader cuts a full tensor the same way."""
    from executor.train.checkpoint import _local_slice

    ref = GroupedExperts(TINY, ExecutorOptions(), single_process_state(), 0, get_backend("torch"),
                         torch.device("cpu"), torch.float32)
    e, f = TINY.num_experts // ep, TINY.expert_ffn_hidden_size // etp
    assert ref.w13.shape == (TINY.num_experts, 2, TINY.expert_ffn_hidden_size, TINY.hidden_size)
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            state = _fake_state(etp, etp_rank, ep, ep_rank)
            mine = GroupedExperts(TINY, ExecutorOptions(), state, 0, get_backend("torch"), torch.device("cpu"),
                                  torch.float32)
            want = ref.w13[ep_rank * e:(ep_rank + 1) * e, :, etp_rank * f:(etp_rank + 1) * f]
            assert torch.equal(mine.w13, want)
            assert torch.equal(mine.w2, ref.w2[ep_rank * e:(ep_rank + 1) * e, :, etp_rank * f:(etp_rank + 1) * f])
            assert torch.equal(_local_slice(ref.w13.detach(), mine.w13.shard_info, state), want)


def test_fused_gate_up_gemm_equals_separate_gate_and_up_gemms():
    """One grouped GEMM against the [E, 2f, h] view = the gate and up GEMMs side by side, gradients included."""
    experts = GroupedExperts(TINY, ExecutorOptions(), single_process_state(), 0, get_backend("torch"),
                             torch.device("cpu"), torch.float32)
    counts = torch.tensor([5, 0, 9, 2, 0, 7, 1, 0])  # tiny-moe's 8 experts, some empty
    x = torch.randn(int(counts.sum()), TINY.hidden_size, requires_grad=True)
    y = experts(x, counts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gmm = get_backend("torch").grouped_mm
    w1, w3 = experts.w13[:, 0], experts.w13[:, 1]
    ref = gmm(F.silu(gmm(x, w1, offs)) * gmm(x, w3, offs), experts.w2, offs)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, experts.w13, experts.w2), g),
                    torch.autograd.grad(ref, (x, experts.w13, experts.w2), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_selective_moe_act_recompute_gives_the_same_gradients(monkeypatch):
    from spec.parallel_config import ParallelConfig
    from executor import grouped_swiglu

    calls = []  # the experts' activation runs in their one-node FFN (executor/grouped_swiglu.py)
    monkeypatch.setattr(grouped_swiglu, "_swiglu",
                        lambda t, _fn=grouped_swiglu._swiglu: calls.append(t.shape) or _fn(t))
    results = []
    for config in (ParallelConfig(world_size=1),
                   ParallelConfig(world_size=1, recompute_granularity="selective", recompute_modules=("moe_act",))):
        torch.manual_seed(0)
        experts = GroupedExperts(TINY, ExecutorOptions(), single_process_state(config), 0, get_backend("torch"),
                                 torch.device("cpu"), torch.float32)
        assert experts.recompute_act == (config.recompute_granularity == "selective")
        counts = torch.full((TINY.num_experts,), 3)
        x = torch.randn(int(counts.sum()), TINY.hidden_size, requires_grad=True)
        y = experts(x, counts)
        results.append([y, *torch.autograd.grad(y.square().sum(), (x, experts.w13, experts.w2))])
    assert len(calls) == 3  # once without recompute; forward and again in backward with it
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_swiglu_falls_back_to_torch_when_the_fused_kernel_fails_its_check(monkeypatch):
    from executor import moe
    from executor.kernels import triton_swiglu

    def broken(*_):
        raise RuntimeError("kernel disagrees")

    monkeypatch.setattr(triton_swiglu, "available", lambda t: True)
    monkeypatch.setattr(triton_swiglu, "_check_against_torch", broken)
    monkeypatch.setattr(triton_swiglu, "_CHECKED", {})
    x = torch.randn(6, 2 * 5, requires_grad=True)
    with pytest.warns(UserWarning, match="fused SwiGLU off.*kernel disagrees"):
        y = moe.expert_swiglu(x)
    ref = F.silu(x[:, :5]) * x[:, 5:]
    torch.testing.assert_close(y, ref)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(gx, want)


def _w13_round_trip(rank: int, world_size: int, label: str) -> dict:
    from spec.parallel_config import ParallelConfig
    from executor.parallel.groups import build_parallel_state
    from executor.parallel.sharding import gather_full
    from executor.train.checkpoint import _local_slice

    state = build_parallel_state(ParallelConfig.parse(label, world_size=world_size), rank)
    experts = GroupedExperts(TINY, ExecutorOptions(), state, 0, get_backend("torch"), torch.device("cpu"),
                             torch.float32)
    info = experts.w13.shard_info
    full = gather_full(experts.w13.detach(), info, state)  # what a checkpoint saves
    return {"full": full, "resliced": torch.equal(_local_slice(full, info, state), experts.w13.detach())}


def test_w13_gathers_to_the_reference_and_reslices_under_etp2_ep2():
    """Checkpoint path of the 4-D w13 (etp_dim 2, ep_dim 0) on 4 gloo ranks: gather_full gives the
    single-process tensor on every rank, and the loader's slice of it is each rank's own w13."""
    from executor.launch_local import launch

    ref = GroupedExperts(TINY, ExecutorOptions(), single_process_state(), 0, get_backend("torch"),
                         torch.device("cpu"), torch.float32)
    launched = launch(_w13_round_trip, 4, ("ep2 etp2",), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    for result in launched.results:
        assert torch.equal(result["full"], ref.w13.detach())
        assert result["resliced"]


def test_shared_expert_gate_scales_shared_output_per_token_by_sigmoid():
    """Qwen2-MoE: y = routed + sigmoid(x · w_gate) · shared(x); the gate weight [1, h] gets its gradient."""
    spec = dataclasses.replace(get_model("tiny-moe-shared"), moe_shared_expert_gate=True)
    layer, x = _layer(spec, ExecutorOptions())
    with torch.no_grad():
        layer.shared_gate.normal_(0.0, 0.5)  # far from 0 so the per-token factors differ visibly
    y, _ = layer(x)
    gate = torch.sigmoid(x @ layer.shared_gate.t())  # [n, 1, 1]
    shared = layer.shared(x)
    ungated, _ = _layer(dataclasses.replace(spec, moe_shared_expert_gate=False), ExecutorOptions())
    routed = ungated(x)[0] - ungated.shared(x)  # parameters are drawn per name: same router and experts
    torch.testing.assert_close(y, routed + gate * shared, rtol=1e-5, atol=1e-6)
    assert gate.std() > 0.05
    y.square().sum().backward()
    assert layer.shared_gate.grad is not None and layer.shared_gate.grad.abs().sum() > 0


def test_shared_expert_gate_needs_shared_experts():
    with pytest.raises(SpecError, match="moe_shared_expert_gate"):
        dataclasses.replace(TINY, moe_shared_expert_gate=True)


def _switch_loss(scores, ids, e, k, coeff):
    """Megatron's switch loss of one token set, by a loop over tokens: E·coeff/(k·T²) · Σ_e P_e · f_e."""
    counts = torch.zeros(e)
    for row in ids:
        for j in row:
            counts[int(j)] += 1
    t = scores.shape[0]
    return (scores.sum(0) * counts).sum() * e * coeff / (k * t * t)


def test_aux_loss_counts_the_plain_top_k_not_the_biased_group_limited_routing():
    """Megatron's aux loss counts a plain top-k of the normalised sigmoid scores (compute_routing_scores_for_
    aux_loss): the expert bias and the group limit steer the routing but not the loss."""
    spec, coeff = SPECS["sigmoid_grouped"], 1e-2
    layer, x = _layer(spec, ExecutorOptions(moe_aux_loss_coeff=coeff, moe_router_enable_expert_bias=True))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]))  # group 3 wins
    tokens = x.view(N_TOKENS, -1)
    routing = layer.router(tokens)
    assert set(routing.experts_NK.reshape(-1).tolist()) == {6, 7}
    scores = torch.sigmoid(F.linear(tokens, layer.router.weight))
    scores = scores / scores.sum(-1, keepdim=True)
    plain = _switch_loss(scores, scores.topk(spec.moe_router_topk).indices, spec.num_experts, spec.moe_router_topk, coeff)
    routed = _switch_loss(scores, routing.experts_NK, spec.num_experts, spec.moe_router_topk, coeff)
    torch.testing.assert_close(routing.loss, plain)
    assert not torch.allclose(plain, routed, rtol=1e-2)  # the old rule (routed counts) gave a different loss


def test_seq_aux_loss_averages_per_sequence_losses():
    """seq_aux_loss (DeepSeek-V2/V3): the switch loss of each sequence alone, averaged over the micro-batch."""
    coeff, b = 1e-2, 3
    layer, x = _layer(TINY, ExecutorOptions(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="seq_aux_loss"))
    x_SBH = x.view(N_TOKENS // b, b, -1)  # 8 positions of 3 sequences, sequence-major as the layer sees them
    routing = layer.router(x_SBH.reshape(N_TOKENS, -1), b)
    e, k = TINY.num_experts, TINY.moe_router_topk
    per_sequence = []
    for j in range(b):
        scores = torch.softmax(F.linear(x_SBH[:, j], layer.router.weight), -1)
        per_sequence.append(_switch_loss(scores, scores.topk(k).indices, e, k, coeff))
    torch.testing.assert_close(routing.loss, torch.stack(per_sequence).mean())
    whole = layer.router(x_SBH.reshape(N_TOKENS, -1), 1).loss  # one sequence: seq_aux_loss is aux_loss
    assert not torch.allclose(routing.loss, whole)
    none, _ = _layer(TINY, ExecutorOptions(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="none"))
    assert none.router(x.view(N_TOKENS, -1)).loss.item() == 0.0


def test_expert_bias_counts_the_tokens_kept_after_dropping():
    """Megatron counts the routing map after apply_router_token_dropping for the bias update."""
    spec = SPECS["sigmoid_grouped"]
    layer, x = _layer(spec, ExecutorOptions(moe_router_enable_expert_bias=True, moe_expert_capacity_factor=0.5))
    routing = layer.router(x.view(N_TOKENS, -1))
    kept = torch.bincount(routing.experts_NK.reshape(-1), minlength=spec.num_experts + 1)[:spec.num_experts]
    assert routing.may_drop and kept.sum() < routing.tokens_per_expert.sum()  # something was dropped
    torch.testing.assert_close(layer.router.step_counts, kept.float())


def test_expert_bias_needs_sigmoid_scores():
    with pytest.raises(InvalidConfigError, match="sigmoid"):
        _layer(TINY, ExecutorOptions(moe_router_enable_expert_bias=True))
