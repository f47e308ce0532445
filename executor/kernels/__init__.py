"""One small kernel interface: grouped GEMM, dense linear, causal GQA attention and RMSNorm.

Backends:
- 'torch' (always): ``torch._grouped_mm``, ``F.linear``, SDPA, ``F.rms_norm`` in the model's dtype.
- 'torch-fp8': 'torch' with the expert grouped GEMMs and the dense linears (attention Q/K/V/O, dense and
  shared-expert MLPs) in fp8 with dynamic rowwise scaling through ``torch._scaled_mm`` and
  ``torch._scaled_grouped_mm`` on sm90 GPUs, emulated exactly elsewhere (:mod:`executor.kernels.fp8`).
  ``TrainingSpec.precision == 'fp8'`` selects it (executor.profile), with bf16 parameters and activations.
A Transformer Engine backend is not built: neither machine this project runs on has TE, so it could not
be tested.
"""

from __future__ import annotations

from executor.kernels.base import KernelBackend
from executor.kernels.fp8 import TorchFp8Backend
from executor.kernels.torch_backend import TorchBackend
from spec.errors import SpecError

__all__ = ["KernelBackend", "get_backend"]

_BACKENDS = {"torch": TorchBackend, "torch-fp8": TorchFp8Backend}


def get_backend(name: str = "torch") -> KernelBackend:
    """The kernel backend called ``name`` ('torch' or 'torch-fp8')."""
    if name not in _BACKENDS:
        raise SpecError(f"unknown kernel backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()
