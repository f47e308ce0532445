"""'torch-fp8' (:mod:`executor.kernels.fp8`): the torch kernel backend with the expert grouped GEMMs and the
dense linears in fp8 (:mod:`executor.kernels.fp8.gemm`). The LM head, the router and attention's SDPA stay bf16.
"""

from __future__ import annotations

import torch

from executor.kernels.fp8 import expert_pick
from executor.kernels.fp8.gemm import grouped_mm
from executor.kernels.torch_backend import TorchBackend

# ---- the backend ----------------------------------------------------------------------------------------

class TorchFp8Backend(TorchBackend):
    """The torch backend with expert GEMMs and dense linears in fp8 (attention core, norms as ``torch``)."""

    name = "torch-fp8"

    def grouped_mm(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        if x_MK.shape[0] == 0:  # no rows: the bf16 path's empty product keeps the graph connected
            return super().grouped_mm(x_MK, w_GNK, offs_G)
        return grouped_mm(x_MK, w_GNK, offs_G)

    def linear(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        # fp8 or bf16 per shape, fp8 where its first call timed it faster by a margin (FOLDTUNE_FP8_DENSE; expert_pick)
        return expert_pick.linear(x, w_NK)
