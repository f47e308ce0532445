"""Causal attention of context-parallel query chunks against all-gathered K/V: one flash call per chunk.

Under CP the sequence is cut into 2·cp chunks of length c; a query chunk with global index j attends to key
chunks 0..j−1 fully and to chunk j causally. With the keys in global order that is causal attention of c
queries against the first (j+1)·c keys with the diagonal aligned to the bottom-right corner: query row r of
the chunk sees keys 0..j·c+r. FlashAttention ≥ 2.1, which PyTorch's CUDA flash kernel is, aligns its causal
mask bottom-right when seq_q < seq_k, so ``aten._scaled_dot_product_flash_attention(q, k, v, 0, True)``
computes exactly this chunk (it is how ``torch.nn.attention.bias.causal_lower_right`` reaches flash; the
executor's first-use check verifies it on each GPU): one kernel per chunk forward and one backward, masked blocks
skipped, no log-sum-exp merge, no fp32 gradient buffers. The kernel takes GQA natively (fewer K/V heads than
query heads; its backward sums dk/dv over each head group), so K/V are not repeated.

The reorder of the gathered K/V into global order, both chunk calls, the output concatenation and the
gradient accumulation of the overlapping key ranges form ONE autograd node, to save host issue time (the
slices, cats and zero-filled backward buffers of separate autograd ops): the chunks are short, so at larger
cp the host, not the GPU, sets the pace, and there the masked SDPA fallback can be the faster path
(docs/benchmarks.md, "CP attention", has the measurements).

The CPU flash op aligns causal top-left; off CUDA each chunk runs on it with the queries front-padded by
sk − sq zero rows, whose last sq rows are then exactly the bottom-right-aligned rows (the padded rows get a
zero output gradient, so they add nothing to dk, dv). That is what the CPU tests exercise; that the CUDA
kernel aligns bottom-right is what the executor's first-use check (``context_parallel.check_flash``)
verifies on the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_aten = torch.ops.aten


def _chunk_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Bottom-right causal attention of q [b, h, sq, d] against k, v [b, kv_heads, sk, d]: the output
    [b, h, sq, d] and what :func:`_chunk_backward` needs (tensors, other)."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True)
        return out, (lse, seed, offset), (cum_q, cum_k, max_q, max_k)
    pad = k.shape[2] - q.shape[2]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(F.pad(q, (0, 0, pad, 0)), k, v, 0.0, True)
    return out[:, :, pad:], (out, lse), ()


def _chunk_backward(grad, q, k, v, out, saved, other):
    """dq, dk, dv of one chunk given its output gradient."""
    if q.is_cuda:
        lse, seed, offset = saved
        cum_q, cum_k, max_q, max_k = other
        return _aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset)
    out_padded, lse = saved
    pad = k.shape[2] - q.shape[2]
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        F.pad(grad, (0, 0, pad, 0)), F.pad(q, (0, 0, pad, 0)), k, v, out_padded, lse, 0.0, True)
    return dq[:, :, pad:], dk, dv


def take_chunks(x_BKSD: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Chunks ``order`` (of len(order) equal ones) of x along the sequence, one gather copy in [s, b, heads, d]
    memory order (how the all-gather lays K/V out, and what the flash kernel reads), seen as [b, heads, s, d]."""
    b, kv, s, d = x_BKSD.shape
    x = x_BKSD.permute(2, 0, 1, 3).reshape(len(order), s // len(order), b, kv, d)
    return x.index_select(0, order).view(s, b, kv, d).permute(1, 2, 0, 3)


def _cat_seq(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [b, h, ·, d] along the sequence in [b, s, h, d] memory order (the flash kernel's layout),
    so the caller's permute to [s, b, h·d] is a view for b = 1 rather than another copy."""
    return torch.cat([p.transpose(1, 2) for p in parts], dim=1).transpose(1, 2)


class ChunkedCausalAttention(torch.autograd.Function):
    """Query chunks [b, h, n·c, d] (global chunk indices ``chunks``) against gathered keys/values
    [b, kv_heads, 2·cp·c, d] whose chunks ``order`` are the global order (``inverse`` its inverse)."""

    @staticmethod
    def forward(ctx, q, k, v, order, inverse, chunks: tuple[int, ...]):
        k, v = take_chunks(k, order), take_chunks(v, order)
        c = q.shape[2] // len(chunks)
        outs, saved, other = [], [], []
        for t, j in enumerate(chunks):
            o, s, x = _chunk_forward(q[:, :, t * c:(t + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c])
            outs.append(o)
            saved.append(s)
            other.append(x)
        ctx.save_for_backward(q, k, v, *outs, *(x for s in saved for x in s))
        ctx.chunks, ctx.inverse, ctx.other, ctx.per_chunk = chunks, inverse, other, len(saved[0])
        return _cat_seq(outs)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *rest = ctx.saved_tensors
        if grad.stride(-1) != 1:  # flash reads rows of d contiguous values (an expanded grad has stride 0)
            grad = grad.contiguous()
        n = len(ctx.chunks)
        outs, flat = rest[:n], rest[n:]
        c = q.shape[2] // n
        dq_parts: list[torch.Tensor | None] = [None] * n
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        # The longest key range first: its gradient is copied in, the shorter ranges (prefixes) add to it.
        first = True
        for t in sorted(range(n), key=lambda t: -ctx.chunks[t]):
            keys = (ctx.chunks[t] + 1) * c
            saved = flat[t * ctx.per_chunk:(t + 1) * ctx.per_chunk]
            dq_parts[t], dk_t, dv_t = _chunk_backward(grad[:, :, t * c:(t + 1) * c], q[:, :, t * c:(t + 1) * c],
                                                      k[:, :, :keys], v[:, :, :keys], outs[t], saved, ctx.other[t])
            for full, part in ((dk, dk_t), (dv, dv_t)):
                if first:
                    full[:, :, :keys].copy_(part)
                    full[:, :, keys:].zero_()  # chunks after every local query chunk: no gradient
                else:
                    full[:, :, :keys].add_(part)
            first = False
        return (_cat_seq(dq_parts), take_chunks(dk, ctx.inverse), take_chunks(dv, ctx.inverse),
                None, None, None)


def chunked_causal_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                             order: torch.Tensor, inverse: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of the query chunks ``chunks`` (global indices, each c long, concatenated in that
    order) against gathered keys/values whose sequence chunks taken in ``order`` are in global order
    (``inverse``: the inverse permutation, int64 on the device); GQA taken natively; default 1/√d scale.
    Returns [b, heads, len(chunks)·c, d]."""
    return ChunkedCausalAttention.apply(q_BHSD, k_BKSD, v_BKSD, order, inverse, tuple(chunks))
