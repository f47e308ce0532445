"""Sinks and sliding windows of executor.attention_core against the plain kernels they extend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.attention_core import attention_mask, sink_attention


def _qkv(s=12, heads=4, kv_heads=2, d=8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, s, d, generator=gen, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]


def test_sinks_rescale_causal_attention_by_their_share_of_the_denominator():
    q, k, v = _qkv()
    s = q.shape[2]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    got = sink_attention(q, k, v, attention_mask(torch.arange(s), torch.arange(s), None), sinks)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kk = k.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(-2, -1)) / q.shape[-1] ** 0.5
    lse = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1, keepdim=True)
    want = plain * lse.exp() / (lse.exp() + sinks.view(1, -1, 1, 1).exp())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # computed in fp32
    # a sink of -inf takes no share: plain causal attention
    none = sink_attention(q, k, v, attention_mask(torch.arange(s), torch.arange(s), None),
                          torch.full((4,), float("-inf"), dtype=torch.float64))
    torch.testing.assert_close(none, plain, rtol=1e-5, atol=1e-6)


def test_window_keeps_the_query_and_the_window_keys_before_it():
    mask = attention_mask(torch.arange(6), torch.arange(6), 2)
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[0].tolist() == [True] + [False] * 5
