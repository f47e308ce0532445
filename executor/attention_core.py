"""Attention with a mask or learned sinks: sliding windows and GPT-OSS's softmax (Megatron's softmax_type).

The plain causal kernels (SDPA ``is_causal``, the CP flash path) take neither a window nor sinks; layers
with either run here on an explicit boolean mask in global token positions, which also serves CP (the
local queries against the all-gathered keys).

A sink is one logit per head that joins every query's softmax denominator and has no value: the weights of
the real keys sum to less than one. 'learnable' sinks are parameters, 'off-by-one' a fixed 0.
"""

from __future__ import annotations

import torch

from executor.parallel.context_parallel import masked_attention


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [s_q, s_k] (True = attend): causal, and with ``window`` at most that many keys before the query
    (Megatron's window_size (window, 0): keys q−window … q)."""
    q, k = q_positions.unsqueeze(1), k_positions.unsqueeze(0)
    mask = k <= q
    if window is not None:
        mask = mask & (q - k <= window)
    return mask


def sink_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask_QK: torch.Tensor,
                   sinks_H: torch.Tensor) -> torch.Tensor:
    """GQA attention [b, heads, s_q, d] whose softmax has one extra logit per head (``sinks_H`` [heads]),
    computed in fp32."""
    groups = q_BHSD.shape[1] // k_BKSD.shape[1]
    if groups > 1:
        k_BKSD = k_BKSD.repeat_interleave(groups, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(groups, dim=1)
    scale = q_BHSD.shape[-1] ** -0.5
    scores = torch.matmul(q_BHSD.float(), k_BKSD.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask_QK, float("-inf"))
    b, h, s, _ = scores.shape
    sink = sinks_H.float().view(1, h, 1, 1).expand(b, h, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v_BKSD.float()).to(q_BHSD.dtype)


def special_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask_QK: torch.Tensor,
                      sinks_H: torch.Tensor | None) -> torch.Tensor:
    """Masked attention, with sinks when ``sinks_H`` is given (masked SDPA otherwise)."""
    if sinks_H is None:
        return masked_attention(q_BHSD, k_BKSD, v_BKSD, mask_QK)
    return sink_attention(q_BHSD, k_BKSD, v_BKSD, mask_QK, sinks_H)
