"""Context parallelism: load-balanced causal attention over the CP group, on plain torch.distributed.

The sequence is cut into 2·cp equal chunks; CP rank i holds chunks i and 2·cp−1−i, so every rank has the
same amount of causal attention work (an early chunk pairs with a late one). Each rank computes Q, K, V of
its tokens, all-gathers K and V over the CP group (backward: reduce-scatter of their gradients) and attends
with the causal mask written in global token positions. Dense gradients then reduce over DP·CP.

On CUDA (bf16/fp16, head_dim a multiple of 8 up to 256) the attention itself runs on the flash kernel
instead (:func:`executor.kernels.cp_flash.chunked_causal_attention`, one autograd node): the gathered K/V
are put in global order (one copy, no GQA repeat) and each local query chunk j attends to keys 0..(j+1)·c
with the causal diagonal bottom-right, one flash call per chunk with no merge; this skips the masked half
of the [s/cp, s] score matrix that the masked SDPA computes. It is not always faster: at larger cp its host
issue time, not the GPU, sets the pace and the masked path can win (docs/benchmarks.md, "CP attention"). A
first-use check per
(dtype, head_dim, device) compares it with the masked path on small random GQA tensors, forward and
backward; if it fails, on CPU, or when V's head dim differs from Q's (multi-latent attention), the masked
path runs. FOLDTUNE_CP_FLASH=0 turns the flash path off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from executor.kernels.cp_flash import chunked_causal_attention, take_chunks
from executor.kernels.first_use import assert_agree, checked_once
from executor.parallel.collectives import all_gather
from executor.parallel.groups import Group


def cp_positions(seq_length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token positions held by CP rank ``rank`` (chunks ``rank`` and ``2·cp−1−rank``), int64 [s/cp]."""
    chunk = seq_length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def all_positions(seq_length: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the all-gathered K/V rows: every CP rank's positions, in rank order."""
    return torch.cat([cp_positions(seq_length, cp, r, device) for r in range(cp)])


def gather_kv(k_BKSD: torch.Tensor, group: Group) -> torch.Tensor:
    """All CP ranks' keys (or values) along the sequence, in rank order: [b, kv_heads, cp·s_local, d]."""
    k_SBKD = k_BKSD.permute(2, 0, 1, 3)
    return all_gather(k_SBKD, group).permute(1, 2, 0, 3)


def masked_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                     mask_QK: torch.Tensor) -> torch.Tensor:
    """GQA attention with a boolean mask (True = attend) between local queries and gathered keys."""
    groups = q_BHSD.shape[1] // k_BKSD.shape[1]
    if groups > 1:
        k_BKSD = k_BKSD.repeat_interleave(groups, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q_BHSD, k_BKSD, v_BKSD, attn_mask=mask_QK)


#: chunk pairs (a query chunk against a key chunk no later) of packed micro-batches' forward attention under the
#: ring and all-gather types: "computed", or "skipped" because no document spans both chunks (a probe for tests and
#: benches; the backward makes the same choices and is not counted)
CHUNK_PAIRS = {"computed": 0, "skipped": 0}


def count_chunk_pair(computed: bool) -> None:
    CHUNK_PAIRS["computed" if computed else "skipped"] += 1


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """Global indices of the two sequence chunks CP rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


_ORDER: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _chunk_order(cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index, into the gathered chunks (rank r holds chunks r and 2cp−1−r), of each global chunk, and the
    inverse permutation; built once per (cp, device), so no host-to-device copy or sort per call."""
    key = (cp, str(device))
    if key not in _ORDER:
        slots = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
        inverse = sorted(range(2 * cp), key=slots.__getitem__)
        _ORDER[key] = tuple(torch.tensor(i, dtype=torch.long, device=device) for i in (slots, inverse))
    return _ORDER[key]


def global_order(k_BKSD: torch.Tensor, cp: int) -> torch.Tensor:
    """Gathered keys (or values) [b, kv_heads, s, d] in rank order → the same in global sequence order."""
    return take_chunks(k_BKSD, _chunk_order(cp, k_BKSD.device)[0])


def flash_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, cp: int,
                    rank: int) -> torch.Tensor:
    """The flash path: this rank's queries [b, heads, s/cp, d] against gathered K/V [b, kv_heads, s, d]."""
    return chunked_causal_attention(q_BHSD, k_BKSD, v_BKSD, *_chunk_order(cp, q_BHSD.device),
                                    local_chunks(cp, rank))


def causal_mask(seq_length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [s/cp, s] mask (True = attend) of this rank's queries against the gathered keys."""
    keys = all_positions(seq_length, cp, device)
    return keys.unsqueeze(0) <= cp_positions(seq_length, cp, rank, device).unsqueeze(1)


def _flash_supported(q_BHSD: torch.Tensor, v_BKSD: torch.Tensor) -> bool:
    d = q_BHSD.shape[-1]
    # the flash kernel needs V as wide as Q and K: multi-latent attention (v_head_dim) takes the masked path
    return (q_BHSD.is_cuda and q_BHSD.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256
            and v_BKSD.shape[-1] == d and os.environ.get("FOLDTUNE_CP_FLASH", "1") != "0")


def check_flash(dtype: torch.dtype, head_dim: int, device: str) -> None:
    """Raise unless the flash path matches the masked path (output and q/k/v gradients) on small random
    GQA tensors for cp = 2, every rank; tolerance 2 % of the largest reference value below fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    cp, s, b, heads, kv_heads = 2, 256, 1, 4, 2
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rank in range(cp):
        q = torch.randn(b, heads, s // cp, head_dim, device=device, generator=gen).to(dtype)
        k = torch.randn(b, kv_heads, s, head_dim, device=device, generator=gen).to(dtype)
        v = torch.randn(b, kv_heads, s, head_dim, device=device, generator=gen).to(dtype)
        g = torch.randn(b, heads, s // cp, head_dim, device=device, generator=gen).to(dtype)
        results = []
        for fn in (lambda *t: masked_attention(*t, causal_mask(s, cp, rank, device)),
                   lambda *t: flash_attention(*t, cp, rank)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(g)
            results.append([out] + [t.grad for t in leaves])
        assert_agree(("out", "dq", "dk", "dv"), *results, tol, f"{{name}} of rank {rank} differs from the masked path")


_CHECKED: dict[tuple, bool] = {}


def cp_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask_QK: torch.Tensor,
                 cp: int, rank: int) -> torch.Tensor:
    """Causal GQA attention of this CP rank's queries [b, heads, s/cp, d] against the gathered K/V
    [b, kv_heads, s, d] (V may be d_v wide: [b, heads, s/cp, d_v] out): the flash path where it is supported
    and checked, else the masked SDPA."""
    if _flash_supported(q_BHSD, v_BKSD) and checked_once(
            _CHECKED, (q_BHSD.dtype, q_BHSD.shape[-1], str(q_BHSD.device)), check_flash, "CP flash attention"):
        return flash_attention(q_BHSD, k_BKSD, v_BKSD, cp, rank)
    return masked_attention(q_BHSD, k_BKSD, v_BKSD, mask_QK)

