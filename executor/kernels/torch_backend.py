"""The always-available backend: ``torch._grouped_mm``, ``F.linear``, ``scaled_dot_product_attention``, ``rms_norm``.

``torch._grouped_mm`` runs on CPU (fp32/bf16/fp16) and on Hopper GPUs in bf16; it needs 16-byte aligned
strides (dims multiple of 8 in bf16, 4 in fp32) and leaves rows past ``offs[-1]`` unwritten, so callers
always pass offs whose last entry is the row count. Where it refuses a dtype/device (fp32 on CUDA, older
torch), a padded batched matmul does the same without a loop over groups (one host sync for the
longest group). SDPA's ``enable_gqa`` avoids copying K/V per head on the CPU, and on a GPU where the flash or
cuDNN kernel takes it (:func:`native_gqa`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

_SUPPORTED: dict[tuple[str, torch.dtype], bool] = {}


def native_gqa(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> bool:
    """Whether SDPA's flash or cuDNN kernel takes these causal inputs with fewer K/V heads than query heads
    (``enable_gqa``), so K/V need not be repeated per head. On an H200 with torch 2.11 both do at Mixtral's
    shape (32/8 heads, d 128, seq 4096, bf16), equal to the repeated inputs (cuDNN bit for bit, flash to
    1.5e-4) and faster with the copies gone: fwd+bwd 1.08 against 1.21 ms on cuDNN (bench/gqa_probe.py,
    docs/benchmarks.md). The memory-efficient kernel does not take them."""
    params = SDPAParams(q_BHSD, k_BKSD, v_BKSD, None, 0.0, True, True)
    # only the kernels the caller's sdpa_kernel context leaves enabled count
    return ((torch.backends.cuda.flash_sdp_enabled() and can_use_flash_attention(params, False))
            or (torch.backends.cuda.cudnn_sdp_enabled() and can_use_cudnn_attention(params, False)))


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (and computes right) for ``dtype`` on ``device``; tried once."""
    key = (device.type, dtype)
    if key not in _SUPPORTED:
        try:
            x = torch.ones(8, 16, device=device, dtype=dtype)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype)
            out = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([3, 8], device=device,
                                                                              dtype=torch.int32))
            _SUPPORTED[key] = bool(torch.all(out == 16))
        except (RuntimeError, AttributeError, NotImplementedError):
            _SUPPORTED[key] = False
    return _SUPPORTED[key]


def padded_grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM through one bmm over groups padded to the longest (no Python loop over groups)."""
    g = w_GNK.shape[0]
    counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1).long())
    longest = int(counts.max())
    group_of_row = torch.repeat_interleave(torch.arange(g, device=x_MK.device), counts, output_size=x_MK.shape[0])
    starts = offs_G.long() - counts
    slot = group_of_row * longest + torch.arange(x_MK.shape[0], device=x_MK.device) - starts[group_of_row]
    padded = x_MK.new_zeros((g * longest, x_MK.shape[1])).index_copy(0, slot, x_MK)
    out = torch.bmm(padded.view(g, longest, -1), w_GNK.transpose(-2, -1))
    return out.reshape(g * longest, -1).index_select(0, slot)


class TorchBackend:
    name = "torch"

    def grouped_mm(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        if x_MK.shape[0] == 0:
            # No rows: an empty product that keeps both x and the weight in the graph, so the (empty)
            # gradient still flows back through the dispatcher's collectives like on every other rank.
            return x_MK @ w_GNK[0].transpose(0, 1)
        if grouped_mm_works(x_MK.device, x_MK.dtype):
            return torch._grouped_mm(x_MK, w_GNK.transpose(-2, -1), offs=offs_G)
        return padded_grouped_mm(x_MK, w_GNK, offs_G)

    def linear(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w_NK)

    def attention(self, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        groups = q_BHSD.shape[1] // k_BKSD.shape[1]
        if groups > 1 and q_BHSD.is_cuda and not native_gqa(q_BHSD, k_BKSD, v_BKSD):
            # Where neither the flash nor the cuDNN kernel takes differing head counts, enable_gqa would fall
            # back to the O(s²)-memory math kernel: K/V are repeated per query head instead.
            k_BKSD = k_BKSD.repeat_interleave(groups, dim=1)
            v_BKSD = v_BKSD.repeat_interleave(groups, dim=1)
            groups = 1
        return F.scaled_dot_product_attention(q_BHSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=groups > 1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
