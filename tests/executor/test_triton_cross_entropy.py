"""The Triton kernels of the fused output layer + loss (executor/kernels/triton_cross_entropy.py) against the
torch path they replace, on CPU through Triton's interpreter: per block (running max, sum of exp, target
logit; the logit gradient) and through ``linear_cross_entropy`` against the unfused loss (values and both
gradients). Triton picks the interpreter when it is imported, so the ``inner`` tests run in a child pytest
with TRITON_INTERPRET=1 (``test_cross_entropy_kernels_in_triton_interpreter``); in this process they skip."""

from __future__ import annotations

import pytest
import torch

from executor.kernels import triton_cross_entropy as ce
from executor.parallel.groups import single_process_state
from executor.parallel.vocab import output_cross_entropy
from tests.executor.triton_child import INNER, inner_only

H, PADDED = 32, 256


def test_cross_entropy_kernels_in_triton_interpreter(triton_interpreter):
    triton_interpreter.check(__file__)


def _spy(monkeypatch, name: str) -> list:
    """Count the calls of the kernel entry ``name`` (``available`` says yes on CPU tensors; the first-use check,
    which calls the kernels too, is taken as passed: tests of its own are below)."""
    calls = []
    real = getattr(ce, name)

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(ce, "available", lambda t: True)
    monkeypatch.setattr(ce, "checked", lambda dtype, device: True)
    monkeypatch.setattr(ce, name, spy)
    return calls


def _states(n):
    return [torch.full((n,), float("-inf")), torch.zeros(n), torch.zeros(n)]


@inner_only
@pytest.mark.parametrize("n,widths,dtype", [(37, (3000, 1, 2100), torch.float32), (5, (2048, 4097), torch.bfloat16),
                                            (1, (7,), torch.float32), (64, (1000, 1000), torch.bfloat16)])
def test_inner_block_kernels_match_the_torch_path(n, widths, dtype):
    """Blocks wider than one forward step (partial last step), a single-column block and a one-token block;
    labels in each block, at its first and last column, and in no block."""
    gen = torch.Generator().manual_seed(n)
    vocab = sum(widths)
    labels = torch.randint(0, vocab + 40, (n,), generator=gen)
    labels[0] = vocab - 1
    if n > 2:
        labels[1:3] = torch.tensor([0, widths[0]])
    got, want = _states(n), _states(n)
    blocks, offset = [], 0
    for width in widths:
        block = (4 * torch.randn(n, width, generator=gen)).to(dtype)
        ce.block_stats_(block.clone(), labels, offset, *got)
        ce.torch_block_stats_(block.clone(), labels, offset, *want)
        blocks.append((block, offset))
        offset += width
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lse = want[0] + want[1].log()
    grad = torch.rand(n, generator=gen) + 0.5
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-3}
    for block, offset in blocks:
        mine = block.clone()
        out = ce.block_grad(mine, lse, labels, offset, grad)
        assert out.dtype == dtype and out.data_ptr() == mine.data_ptr()  # written over the logits
        torch.testing.assert_close(out.float(), ce.torch_block_grad(block.clone(), lse, labels, offset, grad).float(),
                                   **tol)


@inner_only
def test_inner_target_logit_is_picked_at_the_label_column():
    """One-hot logits: the target logit is 1 exactly for tokens whose label sits in this block's columns."""
    n, width, offset = 6, 10, 100
    labels = torch.tensor([100, 109, 99, 110, 105, 0])
    block = torch.zeros(n, width)
    block[torch.arange(n), (labels - offset).clamp(0, width - 1)] = 1.0
    top, total, target = _states(n)
    ce.block_stats_(block, labels, offset, top, total, target)
    assert target.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    grad = ce.block_grad(block.clone(), torch.zeros(n), labels, offset, torch.ones(n))
    # exp(x - 0), less 1 at the label: e - 1 at token 0's label, exp(0) = 1 beside it; token 2's label (99) is
    # outside the block, so its x = 1 at column 0 keeps e
    assert grad[0, 0].item() == pytest.approx(torch.e - 1, rel=1e-6) and grad[0, 1].item() == pytest.approx(1.0)
    assert grad[2, 0].item() == pytest.approx(torch.e, rel=1e-6)


@inner_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_first_use_check_passes(dtype):
    ce._check_against_torch(dtype, "cpu")


@inner_only
def test_inner_first_use_check_catches_a_wrong_gradient(monkeypatch):
    """A kernel whose gradient forgets the one-hot fails the check (which would turn the kernels off)."""
    real = ce.block_grad
    monkeypatch.setattr(ce, "block_grad", lambda b, lse, labels, off, g: real(b, lse, labels, off - 10**6, g))
    with pytest.raises(AssertionError):
        ce._check_against_torch(torch.float32, "cpu")


def _loss_and_grads(hidden, weight, labels, vocab, chunk_logits):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    per_token = output_cross_entropy(hidden, weight, labels, vocab, PADDED, single_process_state(), chunk_logits)
    scale = torch.linspace(0.5, 1.5, per_token.numel()).view_as(per_token)  # non-uniform incoming gradient
    (per_token * scale).sum().backward()
    return per_token.detach(), hidden.grad, weight.grad


@inner_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, {"rtol": 1e-4, "atol": 1e-6}),
                                       (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})])
@pytest.mark.parametrize("vocab,chunk", [(250, 10**9), (250, 8 * 2 * 37), (100, 8 * 2 * 37), (40, 5)])
def test_inner_linear_cross_entropy_on_the_kernels_matches_the_unfused_loss(monkeypatch, dtype, tol, vocab, chunk):
    """Through the whole fused loss (one block, 37-row blocks, one row a block; padded rows after ``vocab``),
    the tolerances of tests/executor/test_linear_cross_entropy.py. One row a block on a 40-row vocabulary only:
    there every row is a launch of both kernels, the costly part in the interpreter."""
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(8, 2, H, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, H, generator=gen) * 0.5)
    weight[vocab:] = 0
    weight = weight.to(dtype)
    labels = torch.randint(0, vocab, (8, 2), generator=gen)
    expected = _loss_and_grads(hidden, weight, labels, vocab, 0)
    fwd, bwd = _spy(monkeypatch, "block_stats_"), _spy(monkeypatch, "block_grad")
    got = _loss_and_grads(hidden, weight, labels, vocab, chunk)
    blocks = -(-vocab // max(1, min(vocab, chunk // 16)))
    assert len(fwd) == blocks and len(bwd) == blocks
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, expected):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    assert not got[2][vocab:].count_nonzero()  # padded rows: no gradient


def test_a_failing_first_use_check_leaves_the_torch_path(monkeypatch):
    """available says yes but the check raises: a warning, then the torch ops (no kernel call), same loss."""
    monkeypatch.setattr(ce, "available", lambda t: True)
    monkeypatch.setattr(ce, "_CHECKED", {})

    def broken(*_):
        raise RuntimeError("does not compile")

    def never(*_):
        raise AssertionError("the kernel ran after its check failed")

    monkeypatch.setattr(ce, "_check_against_torch", broken)
    monkeypatch.setattr(ce, "block_stats_", never)
    monkeypatch.setattr(ce, "block_grad", never)
    hidden, weight = torch.randn(4, 1, H), torch.randn(PADDED, H)
    labels = torch.randint(0, 200, (4, 1))
    with pytest.warns(UserWarning, match="does not compile"):
        got = _loss_and_grads(hidden, weight, labels, 200, 4 * 64)
    for a, b in zip(got, _loss_and_grads(hidden, weight, labels, 200, 0)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(INNER or not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernels_match_the_torch_path_on_a_gpu(monkeypatch, dtype):
    """On a GPU: the first-use check passes, and the loss of 4096 tokens over a 50000-row vocabulary in 4 blocks
    equals the torch path's (FOLDTUNE_FUSED_CROSS_ENTROPY=0), values and gradients, within one rounding."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    ce._check_against_torch(dtype, str(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    n, h, vocab, padded = 4096, 256, 50000, 50048
    hidden = torch.randn(n, 1, h, device=dev, generator=gen).to(dtype)
    weight = (torch.randn(padded, h, device=dev, generator=gen) * 0.05).to(dtype)
    labels = torch.randint(0, vocab, (n, 1), device=dev, generator=gen)
    runs = []
    for setting in ("1", "0"):  # the kernels, then the torch path
        monkeypatch.setenv("FOLDTUNE_FUSED_CROSS_ENTROPY", setting)
        hid, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = output_cross_entropy(hid, w, labels, vocab, padded, single_process_state(), n * 12800)
        loss.sum().backward()
        runs.append((loss.detach(), hid.grad, w.grad))
    assert ce._CHECKED[(dtype, str(hidden.device))] is True  # the kernels' first-use check passed: they ran
    worst = 1e-4 if dtype == torch.float32 else 1e-2  # of the largest |value|: one bf16 rounding per block
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), *runs):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < worst, f"{name}: {err:.1e}"
