"""What every per-model cost term shares: a cache keyed by the model object, and one norm's parameter count.

A leaf of the cost model (it imports nothing of it), so that the pricing of an attention kind
(:mod:`costmodel.attention_pricing`) and the counts built on it (:mod:`costmodel.params`) both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

from spec.model_spec import ModelSpec

_T = TypeVar("_T")


def per_model_cache(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Cache ``fn(model, *positional)`` per model *object*: a planner sweep asks about one model 10⁵ times,
    and hashing a large frozen ModelSpec on every call (as ``lru_cache`` would) costs more than the work."""
    caches: dict[int, tuple[ModelSpec, dict]] = {}

    @wraps(fn)
    def cached(model: ModelSpec, *args):
        entry = caches.get(id(model))
        if entry is None or entry[0] is not model:  # a new object (or a recycled id)
            if len(caches) >= 64:
                caches.clear()
            entry = caches[id(model)] = (model, {})
        memo = entry[1]
        if args in memo:
            return memo[args]
        value = memo[args] = fn(model, *args)
        return value

    return cached


def norm_params(model: ModelSpec, width: int) -> int:
    """Parameters of one norm over ``width`` elements: LayerNorm's weight and bias, RMSNorm's weight."""
    return 2 * width if model.normalization == "layernorm" else width
