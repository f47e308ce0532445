"""The fp32 main-gradient accumulation kernel (executor/kernels/triton_grad_accumulate.py) against torch's
``main.add_(grad)``, bit for bit, on CPU through Triton's interpreter (the ``inner`` tests, run in a child
pytest with TRITON_INTERPRET=1 by ``test_grad_accumulate_kernel_in_triton_interpreter``); and which path
``grad_reduce._accumulate`` takes, and that the first-use check rejects kernels that round differently."""

from __future__ import annotations

import re

import pytest
import torch

from executor.kernels import triton_grad_accumulate as acc
from executor.parallel import grad_reduce
from executor.parallel.grad_reduce import attach_main_grads
from tests.executor.triton_child import inner_only


def test_grad_accumulate_kernel_in_triton_interpreter(triton_interpreter):
    triton_interpreter.check(__file__)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@inner_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 4095, acc.BLOCK, 2 * acc.BLOCK + 1, 1000003])
def test_inner_kernel_equals_torch_add_bit_for_bit(n, dtype):
    """Sizes below one block, exactly one, one element past whole blocks and a large odd one; values of
    mixed magnitudes so that most sums round."""
    gen = torch.Generator().manual_seed(n)
    main = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())
    grad = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())).to(dtype)
    want = main.clone().add_(grad)
    got = main.clone()
    assert acc.accumulate_(got, grad) is got  # in place
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(_bits(got), _bits(main))  # it did add
    copied = main.clone()
    assert acc.accumulate_(copied, grad, copy=True) is copied  # copy mode: the gradient widened, main not read
    assert torch.equal(_bits(copied), _bits(grad.float()))


@inner_only
@pytest.mark.parametrize("block,vec,warps", [(4096, 0, 8), (1024, 4, 4), (16384, 4, 16)])
def test_inner_other_kernel_configurations_equal_torch_add(block, vec, warps):
    """The benchmark's sweep choices (flat block, smaller and larger blocks) compute the same bits."""
    gen = torch.Generator().manual_seed(block + vec)
    n = 3 * block + 7
    main = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = main.clone().add_(grad)
    assert torch.equal(_bits(acc.accumulate_(main.clone(), grad, block, vec, warps)), _bits(want))


@inner_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inner_first_use_check_passes_the_kernel(dtype):
    acc._check_against_torch(dtype, "cpu")  # raises on any differing bit


@inner_only
def test_inner_kernel_works_on_a_main_grad_view_of_a_bucket_buffer():
    """main_grad is a view at an offset into its bucket's fp32 buffer: only that view changes."""
    buffer = torch.zeros(10007)
    buffer[:3] = 7.0
    p = torch.nn.Parameter(torch.zeros(4099, dtype=torch.bfloat16))
    p.main_grad = buffer[3: 3 + p.numel()]
    grad = torch.randn(p.numel()).to(torch.bfloat16)
    acc.accumulate_(p.main_grad, grad)
    assert torch.equal(buffer[3: 3 + p.numel()], grad.float())
    assert buffer[:3].eq(7.0).all() and buffer[3 + p.numel():].eq(0.0).all()


def _torch(main, grad, copy=False):
    return main.copy_(grad) if copy else main.add_(grad)


def _flush_subnormals(main, grad, copy=False):  # a kernel built with flush-to-zero
    _torch(main, grad, copy)
    main[main.abs() < torch.finfo(torch.float32).tiny] = 0.0
    return main


def _bf16_sum(main, grad, copy=False):  # a kernel that adds in the gradient's precision
    main.copy_(grad.float() if copy else (main.to(grad.dtype) + grad).float())
    return main


def _last_element_skipped(main, grad, copy=False):  # a tail mask one element short
    _torch(main[:-1], grad[:-1], copy)
    return main


def _copy_adds(main, grad, copy=False):  # copy mode still reading (adding) the old main gradient
    return main.add_(grad)


@pytest.mark.parametrize("wrong", [_flush_subnormals, _bf16_sum, _last_element_skipped, _copy_adds])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_first_use_check_rejects_a_kernel_that_differs_in_any_bit(monkeypatch, wrong, dtype):
    monkeypatch.setattr(acc, "accumulate_", wrong)
    with pytest.raises(AssertionError, match="differs from torch"):
        acc._check_against_torch(dtype, "cpu")
    # the torch path itself passes the same check (the check is not failing everything)
    monkeypatch.setattr(acc, "accumulate_", _torch)
    acc._check_against_torch(dtype, "cpu")


def _hooked_param(n: int = 37) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    attach_main_grads([p])
    return p


def test_accumulate_takes_torch_add_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(acc, "accumulate_", lambda *a: calls.append(a))
    assert not acc.available(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))
    p = _hooked_param()
    (p.float() * 3).sum().backward()
    (p.float() * 3).sum().backward()
    assert calls == []
    assert p.grad is None and torch.equal(p.main_grad, torch.full((37,), 6.0))


def test_accumulate_takes_the_kernel_where_usable(monkeypatch):
    """Where ``usable`` says yes (a CUDA tensor that passed its first-use check) the hook calls the kernel."""
    calls = []

    def kernel(main, grad):
        calls.append((main.dtype, grad.dtype))
        return main.add_(grad)

    monkeypatch.setattr(acc, "usable", lambda main, grad: True)
    monkeypatch.setattr(acc, "accumulate_", kernel)
    monkeypatch.setattr(acc, "MIN_KERNEL_ELEMENTS", 37)
    p = _hooked_param()
    (p.float() * 2).sum().backward()
    assert calls == [(torch.float32, torch.bfloat16)]
    assert p.grad is None and torch.equal(p.main_grad, torch.full((37,), 2.0))
    assert grad_reduce.accumulate_main_grad_ is acc.accumulate_main_grad_  # the hook goes through it
    # below the size where the Triton launch pays, torch's add_ even where the kernel is usable
    small = _hooked_param(36)
    (small.float() * 2).sum().backward()
    assert len(calls) == 1 and torch.equal(small.main_grad, torch.full((36,), 2.0))


def test_available_refuses_what_the_kernel_does_not_take(monkeypatch):
    """CPU tensors, fp32 gradients, other shapes, non-contiguous tensors, and the switch."""
    main, grad = torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU
    if acc.triton is None:
        pytest.skip("no Triton: available() is False everywhere")
    assert acc.available(main, grad)
    assert not acc.available(main, grad.float())
    assert not acc.available(main, grad[:4])
    assert not acc.available(main.t(), grad.t())
    monkeypatch.setenv("FOLDTUNE_FUSED_GRAD_ACCUM", "0")
    assert not acc.available(main, grad)


def _sm90_ptx(vec: int, grad_type: str, copy: bool = False) -> tuple[str, int]:
    """The unmasked body's PTX for an H100/H200 (sm90) and its shared memory bytes; compiled here, no GPU."""
    triton = pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no CUDA backend")
    src = compiler.ASTSource(
        fn=acc._accumulate_kernel,
        signature={"main_ptr": "*fp32", "grad_ptr": grad_type, "start": "i64", "n": "i64", "BLOCK": "constexpr",
                   "VEC": "constexpr", "MASKED": "constexpr", "COPY": "constexpr"},
        constexprs={"BLOCK": acc.BLOCK, "VEC": vec, "MASKED": False, "COPY": copy},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    kernel = triton.compile(src, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": acc.NUM_WARPS})
    return kernel.asm["ptx"], kernel.metadata.shared


@pytest.mark.parametrize("grad_type,convert", [("*bf16", "cvt.f32.bf16"), ("*fp16", "cvt.f32.f16")])
def test_sm90_body_is_vectorised_without_shared_memory(grad_type, convert):
    """The whole-block body as compiled for sm90: 16-byte fp32 loads and stores, 8-byte 16-bit loads, no
    layout conversion through shared memory, and IEEE fp32 adds (no flush-to-zero) after an exact widening."""
    ptx, shared = _sm90_ptx(acc.VEC, grad_type)
    accesses = set(re.findall(r"(?:ld|st)\.global[\w.:]*", ptx))
    assert shared == 0 and "bar.sync" not in ptx
    assert any(a.startswith("st.global") and a.endswith(".v4.b32") for a in accesses), accesses
    assert any(a.startswith("ld.global") and a.endswith(".v4.b32") for a in accesses), accesses
    assert any(a.startswith("ld.global") and a.endswith(".v2.b32") for a in accesses), accesses
    assert not any(a.endswith((".b32", ".b16")) and ".v" not in a for a in accesses), accesses  # no scalar ones
    adds = re.findall(r"\badd(?:\.\w+)*\.f32\b", ptx)
    assert adds and all(a == "add.f32" for a in adds), set(adds)
    assert ptx.count(convert) == acc.BLOCK // (32 * acc.NUM_WARPS)  # one widening per element of a thread


def test_sm90_copy_mode_reads_only_the_gradient():
    """A step's first gradient: 8-byte 16-bit loads, 16-byte fp32 stores, no fp32 load and no add."""
    ptx, shared = _sm90_ptx(acc.VEC, "*bf16", copy=True)
    accesses = set(re.findall(r"(?:ld|st)\.global[\w.:]*", ptx))
    assert shared == 0 and "bar.sync" not in ptx
    loads = {a for a in accesses if a.startswith("ld.global")}
    assert loads and all(a.endswith(".v2.b32") for a in loads), accesses  # the 16-bit gradient's alone
    assert any(a.startswith("st.global") and a.endswith(".v4.b32") for a in accesses), accesses
    assert not re.findall(r"\badd(?:\.\w+)*\.f32\b", ptx)


def test_sm90_flat_block_goes_through_shared_memory():
    """Why VEC is 4 (see the module): the flat block's 16-bit loads and fp32 stores differ in width."""
    _, shared = _sm90_ptx(0, "*bf16")
    assert shared > 0
