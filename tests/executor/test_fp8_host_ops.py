"""The fp8 dense linear's host-side work (issue 38, docs/benchmarks.md "fp8 linear host cost, before and after").

On an H200's host each dispatched op costs microseconds and each kernel launch (a fill is one) several, while
the linear's kernels take a few hundred: the host decides the linear's speed. These tests count, on the CPU,
what the GPU path dispatches: ``torch._scaled_mm`` is replaced by its arithmetic (the kernel is sm90-only) and
the Triton quantisation runs in Triton's interpreter (tests/executor/triton_child.py). They fail if a fill,
a padding copy, a dtype view or a host sync that the path no longer needs comes back.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from executor.kernels.fp8 import gemm, quantize
from tests.executor.triton_child import inner_only

# ops that write a constant into a new or existing buffer: each is a kernel launch on a GPU
FILLS = ("aten.zeros.default", "aten.ones.default", "aten.fill_.Scalar", "aten.zero_.default",
         "aten.new_zeros.default", "aten.new_ones.default", "aten.zeros_like.default", "aten.ones_like.default",
         "aten.full.default")
# ops that make the host wait for the device (.item(), .tolist(), bool of a tensor, nonzero's size)
SYNCS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default")


class _Ops(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def among(self, names) -> int:
        return sum(self.counts[name] for name in names)


def _scaled_mm_arithmetic(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """What torch._scaled_mm computes, on the CPU, after the checks it makes of its operands' layout."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.t().is_contiguous()
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0, "the kernel takes K and N in multiples of 16"
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("k", [64, 40])
def test_the_kernel_path_pads_only_operands_that_need_it(monkeypatch, k):
    """K a multiple of 16: no padding copy and no dtype views, whether the GEMM quantises its A or is handed
    it quantised (the linear's case); K = 40: zero-padded (a copy). Either way the result is the emulation's."""
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_arithmetic, raising=False)
    x, w = _bf16(32, k, seed=1), _bf16(48, k, seed=2)
    xq, wq = quantize.quantize_rowwise(x), quantize.quantize_rowwise(w)
    want = gemm.scaled_mm_nt(x, w, False)
    for a, a_quantised in ((x, None), (None, xq)):
        with _Ops() as ops:
            got = gemm.scaled_mm_nt(a, None, True, wq, a_quantised=a_quantised)
        if k % 16 == 0:
            assert ops.counts["aten.cat.default"] == 0 and ops.counts["aten.view.dtype"] == 0
        else:
            assert ops.counts["aten.cat.default"] >= 1
        assert torch.equal(got, want)


def test_host_ops_in_interpreter(triton_interpreter):
    """The Triton quantisation's tests below run in a child pytest with TRITON_INTERPRET=1."""
    triton_interpreter.check(__file__, expected=2)


@inner_only
def test_both_forms_fill_one_buffer_and_never_sync():
    """quantize_both's kernels: one zero fill (the amaxes' atomic-max buffer), no scale buffer filled with
    ones first (the cast kernel writes every scale), no host sync."""
    x = _bf16(70, 96, seed=3)
    with _Ops() as ops:
        quantize._quantize_both_triton(x)
    assert ops.among(FILLS) == 1 and ops.counts["aten.zeros.default"] == 1
    assert ops.among(SYNCS) == 0


@inner_only
def test_fp8_linear_forward_and_backward_dispatch_no_fill_pad_or_sync_beyond_its_two_amax_buffers(monkeypatch):
    """One forward + backward of the kernel path (Triton quantisation, the GEMM's arithmetic for
    torch._scaled_mm), its weight's forms cached: two fills (one amax buffer per quantize_both, of x and of
    dy), four dtype views (the e4m3 outputs handed to Triton as bytes), six unsqueezes (the scales' shapes
    _scaled_mm takes), no padding, no host sync; and the output and both gradients are the emulation's, bit
    for bit."""
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_arithmetic, raising=False)
    monkeypatch.setattr(quantize, "_use_triton", lambda device: True)
    w = torch.nn.Parameter(_bf16(48, 64, seed=4))
    x, dy = _bf16(80, 64, seed=5).requires_grad_(), _bf16(80, 48, seed=6)

    def fwd_bwd(kernel):
        y = gemm._Linear.apply(x, w, kernel, True)
        return (y, *torch.autograd.grad(y, (x, w), dy))

    fwd_bwd(True)  # the weight's forms made and cached, as after a step's first micro-batch
    with _Ops() as ops:
        got = fwd_bwd(True)
    assert ops.among(FILLS) == 2 and ops.counts["aten.zeros.default"] == 2
    assert ops.counts["aten.view.dtype"] == 4 and ops.counts["aten.cat.default"] == 0
    assert ops.counts["aten.unsqueeze.default"] == 6  # the three GEMMs' scales, [M, 1] and [1, N]
    assert ops.among(SYNCS) == 0
    for a, b in zip(got, fwd_bwd(False)):
        assert torch.equal(a, b)
