"""One small kernel interface: grouped GEMM, causal GQA attention and RMSNorm.

``get_backend('torch')`` always works (``torch._grouped_mm`` and SDPA). A Transformer Engine backend
is not built yet: neither machine this project runs on has TE, so it could not be tested.
"""

from __future__ import annotations

from executor.kernels.base import KernelBackend
from executor.kernels.torch_backend import TorchBackend

__all__ = ["KernelBackend", "get_backend"]

_BACKENDS = {"torch": TorchBackend}


def get_backend(name: str = "torch") -> KernelBackend:
    """The kernel backend called ``name`` (only 'torch' today)."""
    from costmodel.errors import SpecError

    if name not in _BACKENDS:
        raise SpecError(f"unknown kernel backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()
