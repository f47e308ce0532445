"""The Triton MoE kernels (router top-k, counting sort, permute, combine, SwiGLU) against the torch path, on CPU
through Triton's interpreter. Skipped where Triton is not installed. On a GPU the compiled kernels are
checked by their first-use self-checks against torch (``checked_once``; bench/executor_gpu.py records the
outcomes as ``fused_paths``), and ``--parts fused`` compares the fused permute/unpermute with the torch path.

Triton picks the interpreter when it is imported (TRITON_INTERPRET=1), which this pytest process has
done already, so ``test_kernels_in_triton_interpreter`` runs the kernel tests below in a child pytest
with the variable set; in this process they skip.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.executor.triton_child import inner_only


def test_kernels_in_triton_interpreter(triton_interpreter):
    triton_interpreter.check(__file__)


def _torch_routing(logits, k, pre, scale):
    logits = logits.float()
    if pre:
        scores = torch.softmax(logits, -1)
        experts = scores.topk(k, -1).indices
        probs = scores.gather(1, experts)
    else:
        experts = logits.topk(k, -1).indices
        probs = torch.softmax(logits.gather(1, experts), -1)
    return experts, probs * scale


@pytest.mark.parametrize("pre,scale,n,e,k", [(False, 1.0, 37, 8, 2), (True, 2.5, 50, 20, 4),
                                             (False, 1.0, 9, 128, 8)])
@inner_only
def test_softmax_topk_matches_torch_forward_and_backward(pre, scale, n, e, k):
    from executor.kernels import triton_router as mod

    torch.manual_seed(0)
    logits = torch.randn(n, e, requires_grad=True)
    experts, probs, counts = mod.softmax_topk(logits, k, pre, scale)
    ref_experts, ref_probs = _torch_routing(logits, k, pre, scale)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, torch.bincount(ref_experts.reshape(-1), minlength=e))
    g = torch.randn(n, k)
    (got,) = torch.autograd.grad(probs, logits, g)
    (want,) = torch.autograd.grad(ref_probs, logits, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pre,scale,n,e,k,first", [(False, 1.0, 37, 8, 2, 0), (True, 2.5, 50, 20, 4, 200),
                                                   (False, 1.0, 9, 128, 8, 3 * 9 * 8)])
@inner_only
def test_forced_balance_in_the_fused_kernel_matches_torch_forward_and_backward(pre, scale, n, e, k, first):
    """Forced balancing: experts (first + t·k + j) mod E, probabilities and gradients as the torch router's,
    also when the forced picks lie far below the row maximum (post-softmax must not underflow)."""
    from executor.kernels import triton_router as mod

    torch.manual_seed(1)
    logits = torch.randn(n, e)
    want_experts = mod.forced_experts(first, n, k, e, logits.device)
    logits.scatter_(1, want_experts[:, :1], -200.0)  # one pick of every token ≪ the row maximum
    logits.requires_grad_()
    experts, probs, counts = mod.softmax_topk(logits, k, pre, scale, forced_first=first)
    assert torch.equal(experts, want_experts)
    x = logits.float()
    ref = (torch.softmax(x, -1).gather(1, experts) if pre else torch.softmax(x.gather(1, experts), -1)) * scale
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(probs).all()
    assert torch.equal(counts, torch.bincount(want_experts.reshape(-1), minlength=e))
    g = torch.randn(n, k)
    (got,) = torch.autograd.grad(probs, logits, g)
    (want,) = torch.autograd.grad(ref, logits, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,e", [(1, 4), (64, 8), (300, 16), (1000, 128), (513, 3)])
@inner_only
def test_counting_sort_equals_stable_argsort(m, e):
    from executor.dispatcher import slot_rows
    from executor.kernels import triton_permute as mod

    torch.manual_seed(m)
    ids = torch.randint(0, e, (m,))
    ids[: m // 3] = ids[0]  # long runs of one id across blocks
    order, rows = mod.sort_slots(ids, e)
    want = torch.argsort(ids, stable=True)
    assert torch.equal(order, want)
    assert torch.equal(rows, slot_rows(want, m, 1))


@inner_only
def test_fused_permute_and_combine_match_torch():
    from executor.dispatcher import slot_rows
    from executor.kernels import triton_permute as mod

    torch.manual_seed(1)
    n, k, h, e = 40, 3, 24, 5
    x = torch.randn(n, h)
    experts = torch.randint(0, e + 1, (n, k))  # id e = dropped
    flat = experts.reshape(-1)
    slots = torch.argsort(flat, stable=True)[: int((flat < e).sum())]
    rows = slot_rows(slots, n, k)
    got = mod.permute(x, rows, slots.numel(), k)
    assert torch.equal(got, x.index_select(0, torch.div(slots, k, rounding_mode="floor")))
    y = torch.randn(slots.numel(), h)
    probs = torch.rand(n, k)
    padded = torch.cat([y, y.new_zeros(1, h)]).index_select(0, rows).view(n, k, h)
    torch.testing.assert_close(mod.combine(y, probs, rows, n, k), (probs.unsqueeze(-1) * padded).sum(1))
    g = torch.randn(n, h)
    grad_y, grad_p = mod.combine_backward(g, y, probs, rows)
    grad_padded = (probs.unsqueeze(-1) * g.unsqueeze(1)).reshape(n * k, h)
    torch.testing.assert_close(grad_y, grad_padded.index_select(0, slots))
    torch.testing.assert_close(grad_p, (padded * g.unsqueeze(1)).sum(-1))


@inner_only
@pytest.mark.parametrize("pre_softmax,forced", [(False, False), (True, False), (False, True)])
def test_moe_layer_with_every_fused_kernel_matches_torch_path(monkeypatch, pre_softmax, forced):
    """The router, dispatcher and combine wiring of the fused path: same output, losses and gradients."""
    import dataclasses

    from spec.catalog import get_model
    from executor.kernels import get_backend
    from executor.kernels import triton_permute, triton_router, triton_swiglu
    from executor.moe import MoELayer
    from executor.options import ExecutorOptions
    from executor.parallel.groups import single_process_state

    spec = dataclasses.replace(get_model("tiny-moe"), moe_router_pre_softmax=pre_softmax,
                               moe_router_topk_scaling_factor=2.0 if pre_softmax else None)
    options = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_force_load_balancing=forced)
    calls = []
    for module, name in ((triton_router, "topk_forward"), (triton_router, "topk_backward"),
                         (triton_permute, "sort_slots"), (triton_permute, "permute"), (triton_permute, "combine"),
                         (triton_swiglu, "_forward"), (triton_swiglu, "_backward")):
        def counted(*a, _fn=getattr(module, name), _name=name):
            calls.append(_name)
            return _fn(*a)
        monkeypatch.setattr(module, name, counted)
    results = []
    for use_fused in (False, True):
        monkeypatch.setattr(triton_router, "available", lambda t, on=use_fused: on)
        monkeypatch.setattr(triton_permute, "available", lambda t, on=use_fused: on)
        monkeypatch.setattr(triton_swiglu, "available", lambda t, on=use_fused: on)
        torch.manual_seed(0)
        layer = MoELayer(spec, options, single_process_state(), 0, get_backend("torch"), torch.device("cpu"),
                         torch.float32)
        x = torch.randn(30, 1, spec.hidden_size, requires_grad=True)
        y, loss = layer(x)
        (y.square().sum() + loss).backward()
        results.append([y, loss, x.grad, layer.router.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad,
                        layer.last_tokens_per_expert])
    assert sorted(set(calls)) == ["_backward", "_forward", "combine", "permute", "sort_slots", "topk_backward",
                                  "topk_forward"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@inner_only
def test_self_checks_pass_on_good_kernels_and_turn_a_failing_kernel_off():
    from executor.kernels import first_use, triton_permute, triton_router

    triton_router._check_against_torch(8, 2, False, 1.0, torch.float32, "cpu")
    triton_router._check_against_torch(20, 4, True, 2.5, torch.float32, "cpu")
    triton_router._check_against_torch(20, 4, False, 1.0, torch.float32, "cpu", True)
    triton_permute._check_sort(7, "cpu")
    triton_permute._check_permute(3, 24, torch.float32, "cpu")

    def broken(*_):
        raise RuntimeError("does not compile")

    cache = {}
    with pytest.warns(UserWarning, match="does not compile"):
        assert first_use.checked_once(cache, ("x",), broken, "a kernel") is False
    assert first_use.checked_once(cache, ("x",), lambda *_: None, "a kernel") is False  # cached: once


@inner_only
@pytest.mark.parametrize("m,f", [(5, 1000), (19, 128), (8, 40), (1, 8), (0, 16)])
def test_fused_swiglu_matches_torch_and_is_used_by_the_experts(monkeypatch, m, f):
    """The kernels on [m, 2f] (partial and full row/column tiles, no rows): output and the one [m, 2f]
    gradient against the torch formula, through the experts' ``expert_swiglu``."""
    from executor import moe
    from executor.kernels import triton_swiglu

    triton_swiglu._check_against_torch(torch.float32, "cpu")
    x = torch.randn(m, 2 * f, requires_grad=True)
    g = torch.randn(m, f)
    monkeypatch.setattr(triton_swiglu, "available", lambda t: True)
    fused = moe.expert_swiglu(x)
    assert fused.grad_fn is not None and "SwiGLU" in type(fused.grad_fn).__name__
    ref = torch.nn.functional.silu(x[:, :f]) * x[:, f:]
    torch.testing.assert_close(fused, ref)
    (got,), (want,) = torch.autograd.grad(fused, x, g), torch.autograd.grad(ref, x, g)
    assert got.shape == (m, 2 * f)
    torch.testing.assert_close(got, want)


@inner_only
def test_fused_swiglu_reads_gate_then_up_halves():
    """Swapping the halves changes the result (the kernel does not treat both halves alike)."""
    from executor.kernels import triton_swiglu

    x = torch.randn(4, 2 * 24)
    swapped = torch.cat([x[:, 24:], x[:, :24]], 1)
    torch.testing.assert_close(triton_swiglu.swiglu(x), triton_swiglu.reference(x))
    assert not torch.allclose(triton_swiglu.swiglu(swapped), triton_swiglu.swiglu(x))
