"""Causal attention of context-parallel query chunks against all-gathered K/V, on flash kernels.

Under CP the sequence is cut into 2·cp chunks of length c; a query chunk with global index j attends to key
chunks 0..j−1 with no mask and to chunk j causally. Each piece runs on the flash kernel (no mask tensor, no
score matrix, masked blocks skipped), and the two pieces' outputs merge through their log-sum-exps:

    lse = log(e^lse₁ + e^lse₂),  o = o₁·e^(lse₁−lse) + o₂·e^(lse₂−lse).

Backward runs each piece's flash backward with the MERGED output and log-sum-exp: flash recomputes
P = exp(S − lse) and D = rowsum(dO ∘ O) from what it is given, and with the merged values those are the
true softmax probabilities and correction term of the whole row, so each piece yields its exact share of
dq, dk and dv (the ring-attention identity). dq parts and overlapping dk/dv parts sum in fp32.

The same code runs on CPU through ``_scaled_dot_product_flash_attention_for_cpu`` (fp32 included), which is
what the unit tests use; the executor takes this path on CUDA only (see ``context_parallel.cp_attention``).
"""

from __future__ import annotations

import math

import torch

_aten = torch.ops.aten


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Output [b, h, sq, d], log-sum-exp [b, h, sq] (fp32) and the kernel's extra outputs for backward."""
    if q.is_cuda:
        out, lse, *aux = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse[..., : q.shape[2]].float(), aux
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float(), None


def _flash_backward(grad_out, q, k, v, out, lse, aux, causal: bool, scale: float):
    """dq, dk, dv of one piece, given the (merged) output and log-sum-exp of the whole row."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, rng_state, unused, _ = aux
        return _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused,
            scale=scale)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                      scale=scale)


def _pieces(j: int, c: int) -> list[tuple[int, int, bool]]:
    """Key ranges (start, end, causal) that query chunk ``j`` attends to: chunks 0..j−1 unmasked, chunk j causal."""
    return ([(0, j * c, False)] if j > 0 else []) + [(j * c, (j + 1) * c, True)]


class ChunkedCausalAttention(torch.autograd.Function):
    """Query chunks [b, h, n·c, d] (global chunk indices ``chunks``) against keys/values in global order
    [b, h, s, d]; equal head counts (repeat K/V for GQA first). Returns [b, h, n·c, d]."""

    @staticmethod
    def forward(ctx, q, k, v, chunks: tuple[int, ...], scale: float):
        c = q.shape[2] // len(chunks)
        outs, lses, aux = [], [], []
        for t, j in enumerate(chunks):
            q_t = q[:, :, t * c:(t + 1) * c]
            results = [_flash_forward(q_t, k[:, :, a:b], v[:, :, a:b], causal, scale) for a, b, causal in _pieces(j, c)]
            aux.append([r[2] for r in results])
            if len(results) == 1:
                outs.append(results[0][0])
                lses.append(results[0][1])
                continue
            (o1, lse1, _), (o2, lse2, _) = results
            lse = torch.logaddexp(lse1, lse2)
            o = o1.float() * (lse1 - lse).exp().unsqueeze(-1) + o2.float() * (lse2 - lse).exp().unsqueeze(-1)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale, ctx.aux = chunks, scale, aux
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // len(ctx.chunks)
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for t, j in enumerate(ctx.chunks):
            rows = slice(t * c, (t + 1) * c)
            do_t, q_t = grad_out[:, :, rows], q[:, :, rows]
            out_t, lse_t = out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            for (a, b, causal), aux in zip(_pieces(j, c), ctx.aux[t]):
                dq_p, dk_p, dv_p = _flash_backward(do_t, q_t, k[:, :, a:b], v[:, :, a:b], out_t, lse_t, aux,
                                                   causal, ctx.scale)
                dq[:, :, rows] += dq_p
                dk[:, :, a:b] += dk_p
                dv[:, :, a:b] += dv_p
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def chunked_causal_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                             chunks: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of the query chunks ``chunks`` (global indices, each s/(2·cp) long, concatenated in
    that order) against keys/values of the whole sequence in global order; default 1/√d scale."""
    return ChunkedCausalAttention.apply(q_BHSD, k_BHSD, v_BHSD, tuple(chunks), 1.0 / math.sqrt(q_BHSD.shape[-1]))
