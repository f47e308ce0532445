"""The kernel interface the model calls; shapes use the suffix convention (M tokens, G groups, K in, N out)."""

from __future__ import annotations

from typing import Protocol

import torch


class KernelBackend(Protocol):
    name: str

    def grouped_mm(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        """Rows offs[g-1]:offs[g] of ``x_MK`` times ``w_GNK[g]``ᵀ; ``offs_G`` int32 cumulative, offs[-1] == M."""

    def linear(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """x · wᵀ over the last dim ([..., K] → [..., N], no bias): attention's Q/K/V/O and the dense MLPs."""

    def attention(self, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        """Causal attention with grouped K/V heads (H % K == 0), softmax scale 1/sqrt(D); V may have its own
        head dim D_v (multi-latent attention); returns [B, H, S, D_v]."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in fp32, returned in ``x``'s dtype."""
