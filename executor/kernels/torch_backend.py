"""The always-available backend: ``torch._grouped_mm``, ``scaled_dot_product_attention`` and ``rms_norm``.

``torch._grouped_mm`` runs on CPU (fp32/bf16/fp16) and on Hopper GPUs (bf16); it needs 16-byte aligned
strides (dims multiple of 8 in bf16, 4 in fp32) and leaves rows past ``offs[-1]`` unwritten, so callers
always pass offs whose last entry is the row count. SDPA's ``enable_gqa`` avoids copying K/V per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchBackend:
    name = "torch"

    def grouped_mm(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        if x_MK.shape[0] == 0:
            # No rows: keep the weight in the graph so its (zero) gradient exists on every rank.
            return x_MK.new_zeros((0, w_GNK.shape[1])) + 0 * w_GNK.sum()
        return torch._grouped_mm(x_MK, w_GNK.transpose(-2, -1), offs=offs_G)

    def attention(self, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_BHSD, k_BKSD, v_BKSD, is_causal=True,
                                              enable_gqa=q_BHSD.shape[1] != k_BKSD.shape[1])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
