"""Issue 19's decoder-stack switches against the paths they replace: fused Q/K/V projection, fused RoPE
(Triton, here through its CPU interpreter), the SDPA kernel choice and CUDA graphs of the attention half
(refusals on CPU; the graphs' equality with eager on a GPU only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spec.catalog import get_model
from spec.errors import SpecError
from spec.parallel_config import ParallelConfig
from executor.attention import _SplitQKV, apply_rope, rope_tables
from executor.cuda_graphs import refusal
from executor.kernels import get_backend, triton_rms_norm, triton_rope
from executor.kernels.torch_backend import TorchBackend, native_gqa
from executor.model import DecoderLayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.timing import NULL_TIMER
from tests.executor.triton_child import inner_only



def _layer(spec, options, device="cpu", dtype=torch.float32, state=None):
    torch.manual_seed(0)
    return DecoderLayer(spec, options, state or single_process_state(), 0, True, get_backend("torch"),
                        torch.device(device), dtype, NULL_TIMER)


def _fwd_bwd(layer, x, rope):
    """Output and every gradient (the input's as "x") of one fwd+bwd of ``layer``; grads reset after."""
    x = x.detach().clone().requires_grad_(True)
    y, aux = layer(x, rope)
    g = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view_as(y)
    (y * g).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    for p in layer.parameters():
        p.grad = None
    return y.detach(), grads


@pytest.mark.parametrize("features", [{}, {"add_qkv_bias": True}, {"add_bias_linear": True}])
def test_fused_qkv_matches_three_projections(features):
    spec = dataclasses.replace(get_model("tiny-moe").with_layers(1), **features)
    s, b = 16, 2
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, torch.device("cpu"))
    x = torch.randn(s, b, spec.hidden_size)
    fused = _layer(spec, ExecutorOptions(fused_qkv=True))
    plain = _layer(spec, ExecutorOptions(fused_qkv=False))
    plain.load_state_dict(fused.state_dict())
    assert fused.attention.fuse_qkv and not plain.attention.fuse_qkv
    assert fused.attention.bq is not None or not features
    y1, g1 = _fwd_bwd(fused, x, rope)
    y2, g2 = _fwd_bwd(plain, x, rope)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-6)
    assert set(g1) == set(g2) and {"attention.wq", "attention.wk", "attention.wv"} <= set(g1)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_qkv_split_hands_back_one_gradient_as_autograd_slices_would():
    y = torch.randn(6, 2, 24, dtype=torch.float64, requires_grad=True)
    q, k, v = _SplitQKV.apply(y, 16, 4)
    assert q.data_ptr() == y.data_ptr() and v.is_contiguous()  # q, k views; v its own storage
    (3 * q.sum() + (v * v).sum()).backward()  # k unused: its part of the gradient is zero
    ref = y.detach().clone().requires_grad_(True)
    (3 * ref[..., :16].sum() + (ref[..., 20:] ** 2).sum()).backward()
    assert torch.equal(y.grad, ref.grad) and not y.grad[..., 16:20].any()


def test_fused_qkv_is_off_for_the_fp8_backend_and_q_k_norms():
    spec = get_model("tiny-moe").with_layers(1)
    layer = DecoderLayer(spec, ExecutorOptions(fused_qkv=True), single_process_state(), 0, True,
                         get_backend("torch-fp8"), torch.device("cpu"), torch.float32, NULL_TIMER)
    assert not layer.attention.fuse_qkv
    normed = _layer(dataclasses.replace(spec, qk_layernorm=True), ExecutorOptions(fused_qkv=True))
    assert not normed.attention.fuse_qkv


def test_unknown_attention_backend_is_a_spec_error():
    with pytest.raises(SpecError, match="attention_backend"):
        ExecutorOptions(attention_backend="xformers")


def test_cuda_graphs_refused_on_cpu_with_a_reason():
    spec = get_model("tiny-moe").with_layers(1)
    with pytest.raises(SpecError, match="needs a CUDA device"):
        _layer(spec, ExecutorOptions(cuda_graphs=True))


@pytest.mark.parametrize("config,words", [
    (ParallelConfig(world_size=2, tp=2), "tp = cp = 1"),
    (ParallelConfig(world_size=2, pp=2), "pipeline"),
    (ParallelConfig(world_size=1, recompute_granularity="full"), "full recompute"),
    (ParallelConfig(world_size=1, recompute_granularity="selective", recompute_modules=("core_attn",)),
     "core_attn"),
    (ParallelConfig(world_size=2, ep=2), "overlap_param_gather"),
])
def test_cuda_graphs_refusals_name_the_reason(config, words):
    assert words in refusal(config, "torch", torch.device("cuda"))


def test_cuda_graphs_allowed_where_static():
    assert refusal(ParallelConfig(world_size=1), "torch", torch.device("cuda")) is None
    # the routed experts are never captured, so a selective recompute of their activation does not stop the graphs
    config = ParallelConfig(world_size=2, ep=2, overlap_param_gather=False,
                            recompute_granularity="selective", recompute_modules=("moe_act",))
    assert refusal(config, "torch", torch.device("cuda")) is None
    assert "fp8" in refusal(ParallelConfig(world_size=1), "torch-fp8", torch.device("cuda"))
    # the rule names come from the rule book
    assert "[executor_cuda_graphs]" in refusal(ParallelConfig(world_size=2, pp=2), "torch", torch.device("cuda"))
    assert "[cuda_graphs_recompute]" in refusal(ParallelConfig(world_size=1, recompute_granularity="full"), "torch",
                                                torch.device("cuda"))


# ---- fused RoPE through Triton's interpreter (a child process: Triton reads TRITON_INTERPRET on import) ----

def test_rope_and_norm_kernels_in_triton_interpreter(triton_interpreter):
    triton_interpreter.check(__file__)


@inner_only
@pytest.mark.parametrize("s,b,hq,hk,d,dtype", [(7, 2, 4, 2, 8, torch.float32), (5, 1, 6, 6, 16, torch.bfloat16),
                                               (3, 3, 8, 1, 10, torch.float32)])
def test_inner_rope_kernel_matches_torch(s, b, hq, hk, d, dtype):
    torch.manual_seed(0)
    cos, sin = rope_tables(s, d, 10000.0, torch.device("cpu"))
    # q and k as column slices of one QKV output, as the fused projection gives them
    qkv = torch.randn(s, b, (hq + 2 * hk) * d, dtype=dtype, requires_grad=True)
    q = qkv[..., : hq * d].view(s, b, hq, d)
    k = qkv[..., hq * d: (hq + hk) * d].view(s, b, hk, d)
    qo, ko = triton_rope.fused_rope(q, k, cos, sin)
    # reference in fp32 on the same (rounded) inputs
    q32, k32 = q.detach().float().requires_grad_(True), k.detach().float().requires_grad_(True)
    rq = apply_rope(q32.permute(1, 2, 0, 3), cos, sin).permute(2, 0, 1, 3)
    rk = apply_rope(k32.permute(1, 2, 0, 3), cos, sin).permute(2, 0, 1, 3)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(qo.float(), rq, **tol)
    torch.testing.assert_close(ko.float(), rk, **tol)
    gq, gk = torch.randn(qo.shape, dtype=dtype), torch.randn(ko.shape, dtype=dtype)
    (dqkv,) = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), qkv)
    dq, dk = torch.autograd.grad((rq * gq.float()).sum() + (rk * gk.float()).sum(), (q32, k32))
    torch.testing.assert_close(dqkv[..., : hq * d].float(), dq.reshape(s, b, hq * d), **tol)
    torch.testing.assert_close(dqkv[..., hq * d: (hq + hk) * d].float(), dk.reshape(s, b, hk * d), **tol)
    assert torch.all(dqkv[..., (hq + hk) * d:] == 0)  # v's columns get nothing from RoPE


def _force_kernel(monkeypatch, module, name: str) -> list:
    """``module``'s Triton kernel ``name`` taken on CPU tensors (its ``available`` says yes), each call counted in
    the returned list: a layer test then knows the kernel, not the torch fallback, ran."""
    calls = []
    real = getattr(module, name)

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(module, "available", lambda *a: True)
    monkeypatch.setattr(module, name, spy)
    return calls


@inner_only
def test_inner_layer_with_fused_rope_matches_torch_rope(monkeypatch):
    """The decoder layer on the Triton RoPE path (forced on CPU) against the torch path: output and grads."""
    spec = get_model("tiny-moe").with_layers(1)
    s, b = 12, 2
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, torch.device("cpu"))
    x = torch.randn(s, b, spec.hidden_size)
    layer = _layer(spec, ExecutorOptions(fused_rope=True))
    y_torch, g_torch = _fwd_bwd(layer, x, rope)  # CPU tensors: available() is False, the torch path
    calls = _force_kernel(monkeypatch, triton_rope, "fused_rope")
    y_fused, g_fused = _fwd_bwd(layer, x, rope)
    assert calls
    torch.testing.assert_close(y_fused, y_torch, rtol=1e-5, atol=1e-6)
    for name in g_torch:
        torch.testing.assert_close(g_fused[name], g_torch[name], rtol=1e-5, atol=1e-6, msg=name)


@inner_only
@pytest.mark.parametrize("shape,dtype,programs", [
    ((7, 2, 40), torch.float32, None), ((600, 64), torch.bfloat16, None), ((3, 1, 24), torch.bfloat16, None),
    # narrow rows 32 to a tile: several tiles per backward program, the last one cut short
    ((600, 64), torch.float32, 3), ((7, 2, 40), torch.bfloat16, 1),
    # a row wider than a tile: one row a tile
    ((5, 3000), torch.float32, 2)])
def test_inner_rms_norm_kernel_matches_torch(shape, dtype, programs, monkeypatch):
    if programs is not None:
        monkeypatch.setattr(triton_rms_norm, "BWD_PROGRAMS", programs)
    torch.manual_seed(0)
    backend = get_backend("torch")
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_(True)
    g = torch.randn(shape, dtype=dtype)
    y = triton_rms_norm.fused_rms_norm(x, w, 1e-5)
    dx, dw = torch.autograd.grad((y.float() * g.float()).sum(), (x, w))
    ry = backend.rms_norm(x, w, 1e-5)
    rdx, rdw = torch.autograd.grad((ry.float() * g.float()).sum(), (x, w))
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, ry, **tol)
    torch.testing.assert_close(dx, rdx, **tol)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=tol["rtol"], atol=tol["atol"] * 10)


@inner_only
def test_inner_layer_with_fused_norms_matches_torch_norms(monkeypatch):
    """Both input norms of a layer on the Triton kernel (forced on CPU) against the torch path."""
    spec = get_model("tiny-moe").with_layers(1)
    s, b = 12, 2
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, torch.device("cpu"))
    x = torch.randn(s, b, spec.hidden_size)
    y_torch, g_torch = _fwd_bwd(_layer(spec, ExecutorOptions(fused_rms_norm=True)), x, rope)
    calls = _force_kernel(monkeypatch, triton_rms_norm, "fused_rms_norm")
    y_fused, g_fused = _fwd_bwd(_layer(spec, ExecutorOptions(fused_rms_norm=True)), x, rope)
    assert len(calls) == 2  # the attention's input norm and the MoE's
    torch.testing.assert_close(y_fused, y_torch, rtol=1e-5, atol=1e-6)
    for name in g_torch:
        torch.testing.assert_close(g_fused[name], g_torch[name], rtol=1e-5, atol=1e-5, msg=name)


@inner_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_first_use_checks_pass(dtype):
    """The GPU's first-use self-checks themselves pass on a correct kernel (else they would switch it off)."""
    triton_rope._check_against_torch(dtype, "cpu", 6, 2, 16)
    triton_rms_norm._check_against_torch(dtype, "cpu", 48)


# ---- CUDA graphs: the graphed half against eager, on a GPU ----

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphed_layer_matches_eager(dtype):
    spec = get_model("tiny-moe").with_layers(1)
    s, b = 32, 2
    dev = torch.device("cuda")
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, dev)
    graphed = _layer(spec, ExecutorOptions(cuda_graphs=True), dev, dtype)
    eager = _layer(spec, ExecutorOptions(cuda_graphs=False), dev, dtype)
    eager.load_state_dict(graphed.state_dict())
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    for step in range(3):  # the first call captures, later ones replay with new inputs
        x = torch.randn(s, b, spec.hidden_size, device=dev, dtype=dtype)
        y1, g1 = _fwd_bwd(graphed, x, rope)
        y2, g2 = _fwd_bwd(eager, x, rope)
        torch.testing.assert_close(y1, y2, **tol)
        assert set(g1) == set(g2)
        for name in g1:
            torch.testing.assert_close(g1[name], g2[name], **tol, msg=f"step {step} {name}")
    assert len(graphed.graphed.graphs) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphed_layer_accumulates_grads_over_micro_batches():
    """Two micro-batches' gradients add up in ``.grad`` (the replay's buffers are not handed out as grads)."""
    spec = get_model("tiny-moe").with_layers(1)
    s, b = 32, 2
    dev = torch.device("cuda")
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, dev)
    layers = [_layer(spec, ExecutorOptions(cuda_graphs=graphs), dev) for graphs in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    xs = [torch.randn(s, b, spec.hidden_size, device=dev) for _ in range(2)]
    for layer in layers:
        for x in xs:
            y, _ = layer(x, rope)
            y.square().sum().backward()
    for (name, p), q in zip(layers[0].named_parameters(), layers[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's flash and cuDNN kernels need a GPU")
def test_native_gqa_attention_equals_repeated_heads_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    assert native_gqa(q, k, v)
    got = TorchBackend().attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                            is_causal=True)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_native_gqa_is_never_claimed_for_cpu_tensors():
    q, k = torch.randn(1, 8, 16, 64), torch.randn(1, 2, 16, 64)
    assert not native_gqa(q, k, k)
