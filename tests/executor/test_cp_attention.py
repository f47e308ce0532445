"""Context-parallel attention as one bottom-right-causal call per query chunk (executor/kernels/cp_flash.py),
checked on CPU in fp32: against the masked SDPA path (output and all gradients), against full causal
attention over the whole sequence, the chunk reorder and its backward, and the dispatch/fallback logic.

On CPU each chunk runs on the CPU flash op (top-left causal) with its queries front-padded to the key
length, which yields the bottom-right-aligned rows; on CUDA it is the flash kernel's own bottom-right causal
mask, which only a GPU can check (the executor's first-use check and bench/cp_attention_check.py do)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from executor.kernels.cp_flash import chunked_causal_attention
from executor.parallel import context_parallel as cpm


def _inputs(cp: int, heads: int, kv_heads: int, chunk: int = 16, d: int = 16, b: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = 2 * cp * chunk
    # laid out as the executor has them: [s, b, heads, d] storage seen as [b, heads, s, d]
    q = torch.randn(s // cp, b, heads, d, generator=gen).permute(1, 2, 0, 3)
    k = torch.randn(s, b, kv_heads, d, generator=gen).permute(1, 2, 0, 3)
    v = torch.randn(s, b, kv_heads, d, generator=gen).permute(1, 2, 0, 3)
    g = torch.randn(b, heads, s // cp, d, generator=gen)
    return s, q, k, v, g


def _run(fn, q, k, v, g):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_flash_path_matches_masked_path_fp32(cp, heads, kv_heads):
    for rank in range(cp):
        s, q, k, v, g = _inputs(cp, heads, kv_heads, seed=rank)
        mask = cpm.causal_mask(s, cp, rank)
        want = _run(lambda *t: cpm.masked_attention(*t, mask), q, k, v, g)
        got = _run(lambda *t: cpm.flash_attention(*t, cp, rank), q, k, v, g)
        for name, w, o in zip(("out", "dq", "dk", "dv"), want, got):
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} rank {rank}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_together_equal_full_causal_attention(cp):
    """Every rank's queries against the all-gathered K/V, placed back at their global positions, give causal
    attention over the whole sequence, and the summed gradients its gradients."""
    gen = torch.Generator().manual_seed(7)
    b, heads, kv_heads, d, s = 1, 4, 2, 16, 2 * cp * 12
    q, k, v = (torch.randn(b, n, s, d, generator=gen).requires_grad_() for n in (heads, kv_heads, kv_heads))
    g = torch.randn(b, heads, s, d, generator=gen)
    keys = cpm.all_positions(s, cp)
    out = torch.empty(b, heads, s, d)
    loss = 0.0
    for rank in range(cp):
        pos = cpm.cp_positions(s, cp, rank)
        o = cpm.flash_attention(q[:, :, pos], k[:, :, keys], v[:, :, keys], cp, rank)
        out[:, :, pos] = o.detach()
        loss = loss + (o * g[:, :, pos]).sum()
    loss.backward()
    got = [out, q.grad, k.grad, v.grad]

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), is_causal=True)
    ref.backward(g)
    for w, o in zip([ref.detach(), q2.grad, k2.grad, v2.grad], got):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_global_order_is_sorted_positions(cp):
    _, _, k, _, _ = _inputs(cp, 4, 2)
    s = k.shape[2]
    assert torch.equal(cpm.global_order(k, cp), k[:, :, torch.argsort(cpm.all_positions(s, cp))])


@pytest.mark.parametrize("chunk", [0, 2])
def test_one_chunk_is_bottom_right_causal(chunk):
    """A query chunk j against the gathered K/V sees keys 0..j·c+r (GQA heads as repeat_interleave), and its
    K/V gradient lands at the gathered (rank-order) rows of those keys, zero elsewhere."""
    cp, c = 2, 4
    gen = torch.Generator().manual_seed(chunk)
    q, g = torch.randn(1, 4, c, 8, generator=gen), torch.randn(1, 4, c, 8, generator=gen)
    k, v = torch.randn(1, 2, 4 * c, 8, generator=gen), torch.randn(1, 2, 4 * c, 8, generator=gen)
    pos = cpm.all_positions(4 * c, cp)
    mask = pos.unsqueeze(0) <= torch.arange(chunk * c, (chunk + 1) * c).unsqueeze(1)
    want = _run(lambda q_, k_, v_: F.scaled_dot_product_attention(
        q_, k_.repeat_interleave(2, 1), v_.repeat_interleave(2, 1), attn_mask=mask), q, k, v, g)
    got = _run(lambda q_, k_, v_: chunked_causal_attention(q_, k_, v_, *cpm._chunk_order(cp, q.device), (chunk,)),
               q, k, v, g)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)


def test_cpu_takes_the_masked_path():
    s, q, k, v, _ = _inputs(2, 4, 2)
    mask = cpm.causal_mask(s, 2, 1)
    assert torch.equal(cpm.cp_attention(q, k, v, mask, 2, 1), cpm.masked_attention(q, k, v, mask))


def _force_flash(monkeypatch) -> list[int]:
    """Let the dispatcher take the flash path on CPU fp32 (fresh check cache); returns a call counter."""
    calls = [0]
    real = cpm.flash_attention

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(cpm, "_flash_supported", lambda q, v: True)
    monkeypatch.setattr(cpm, "_CHECKED", {})
    monkeypatch.setattr(cpm, "flash_attention", counted)
    return calls


def test_checked_flash_path_is_taken_and_survives_recomputation(monkeypatch):
    calls = _force_flash(monkeypatch)
    cp, rank = 2, 0
    s, q, k, v, g = _inputs(cp, 4, 2)
    mask = cpm.causal_mask(s, cp, rank)
    want = _run(lambda *t: cpm.masked_attention(*t, mask), q, k, v, g)
    got = _run(lambda *t: checkpoint(cpm.cp_attention, *t, mask, cp, rank, use_reentrant=False), q, k, v, g)
    assert calls[0] == 4  # the check (one per rank of cp = 2), the real call, and again in the recomputation
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)


def test_failing_check_falls_back_to_masked_path(monkeypatch):
    calls = _force_flash(monkeypatch)
    counted = cpm.flash_attention
    monkeypatch.setattr(cpm, "flash_attention", lambda *a: counted(*a) * 1.001)  # a 0.1 % error
    s, q, k, v, _ = _inputs(2, 4, 2)
    mask = cpm.causal_mask(s, 2, 1)
    with pytest.warns(UserWarning, match="CP flash attention off .*differs from the masked path"):
        out = cpm.cp_attention(q, k, v, mask, 2, 1)
    assert torch.equal(out, cpm.masked_attention(q, k, v, mask))
    assert calls[0] == 1  # only the check ran it
