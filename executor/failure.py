"""The one out-of-memory detector of the launchers: which exceptions a rank reports as out of memory."""

from __future__ import annotations

# CPU ranks run under an address-space limit (their 'device memory'): beyond it the allocator fails
# with one of these messages instead of raising a MemoryError.
_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` means the rank ran out of memory: torch's OutOfMemoryError (CUDA), a MemoryError,
    or an allocator message saying so (torch's CPU allocator raises a plain RuntimeError)."""
    text = str(exc).lower()
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or any(t in text for t in _OOM_TEXTS))
