"""Context parallelism: load-balanced causal attention over the CP group, on plain torch.distributed.

The sequence is cut into 2·cp equal chunks; CP rank i holds chunks i and 2·cp−1−i, so every rank has the
same amount of causal attention work (an early chunk pairs with a late one). Each rank computes Q, K, V of
its tokens, all-gathers K and V over the CP group (backward: reduce-scatter of their gradients) and attends
with the causal mask written in global token positions. Dense gradients then reduce over DP·CP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
