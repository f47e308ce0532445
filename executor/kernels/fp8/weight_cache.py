"""The fp8 weight cache (:mod:`executor.kernels.fp8`): each weight's e4m3 forms, kept while its value lasts.

Weights are quantised once per value, not per call (:func:`quantized_weight`): their forward and dgrad
forms are cached, keyed on the parameter, its version counter and data pointer, as Transformer Engine
caches fp8 weights across the micro-batches of a step. The cache holds 1 byte per weight element per form (2 once
forward and dgrad have run) plus fp32 scales per row; FOLDTUNE_FP8_WEIGHT_CACHE=0 turns it off.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.kernels.aliasing import written_through_buffer
from executor.kernels.fp8.quantize import quantize_both, quantize_rowwise

# ---- weights: quantised once per update ----------------------------------------------------------------

@dataclass
class _CachedWeight:
    """The e4m3 forms made of one weight tensor (``base``) while it had ``state`` = (_version, data_ptr)."""

    base: weakref.ref
    state: tuple[int, int]
    forms: dict


_WEIGHT_CACHE: dict[int, _CachedWeight] = {}  # id(base) -> its forms; an entry dies with its tensor
_WEIGHT_COUNTS: Counter = Counter()  # weight quantisations: "quantised", "reused", "uncached"


def _cacheable(base: torch.Tensor) -> bool:
    """Whether ``base``'s version counter sees every write to its values: a leaf that owns its storage
    exactly (no other tensor with a counter of its own aliases it) and is not written through a buffer
    (:mod:`executor.kernels.aliasing`)."""
    if base.is_inference() or not base.is_leaf or not (base.requires_grad or isinstance(base, torch.nn.Parameter)):
        return False
    if base.storage_offset() or base.untyped_storage().nbytes() != base.numel() * base.element_size():
        return False
    return id(base) not in written_through_buffer()


def weight_cache_enabled() -> bool:
    return os.environ.get("FOLDTUNE_FP8_WEIGHT_CACHE", "1") != "0"


def quantized_weight(w: torch.Tensor, transposed: bool = False, both: bool = False,
                     blocks: Callable[[torch.Tensor], tuple] | None = None) -> tuple:
    """:func:`quantize_rowwise` of ``w`` (the forward's B) or, ``transposed``, of ``w`` with its last two
    dims swapped (the dgrad's B), made once per value of the weight and reused until it changes.

    Entries are keyed on the tensor whose storage ``w`` views (the parameter; ``w`` may be a view of it
    such as ``w13.flatten(1, 2)``) and the view's geometry, and are valid while that tensor's ``_version``
    and data pointer stay the same: an optimizer's in-place update, a checkpoint load (``copy_``) or a
    ``.data =`` swap makes the next call quantise afresh, so a cached form is never stale; across the
    micro-batches of a step (and the recomputed forward of activation checkpointing) the weights are
    quantised once. Not cached (quantised per call): tensors that are not leaves or not parameters, that
    alias a larger storage, or that an overlapped parameter all-gather writes behind their version counter;
    writes through ``.data`` aliases are invisible to the counter and must not be made to a parameter in
    use here. FOLDTUNE_FP8_WEIGHT_CACHE=0 turns the cache off.

    ``both`` (the forward of a weight that will get a gradient, whose backward needs the dgrad form): where
    a form is missing, make the forward and dgrad forms together (:func:`quantize_both`: two reads of the
    weight instead of four), so the backward finds its form cached.

    ``blocks``: the weight in another scaling, ``blocks(w)`` making its (forward form, dgrad form) pair at
    once (the grouped kernels' 128 × 128 blocks, :func:`executor.kernels.fp8.grouped_quant.quantize_weight`);
    the pair is cached as one form of its own and returned (``transposed`` and ``both`` are then unused).

    Memory: a cached weight holds its e4m3 forms until it changes, dies or :func:`clear_weight_cache` (the
    trainer calls it before each optimizer step, so the cache never sits beside Adam's temporaries) — 1 byte per element for each
    form (2 bytes per element once forward and dgrad have run) plus fp32 scales (4 bytes per row of
    each form); a superseded entry is freed before its replacement is made.
    """
    def make():
        if blocks is not None:
            return blocks(w)
        return quantize_rowwise(w.transpose(-2, -1) if transposed else w)

    def form_of(t: bool) -> tuple:
        return ("blocks" if blocks is not None else t, w.storage_offset(), tuple(w.shape), tuple(w.stride()))

    base = w if w._base is None else w._base
    if not weight_cache_enabled() or not _cacheable(base):
        _WEIGHT_COUNTS["uncached"] += 1
        return make()  # one form: without the cache the other would not be kept for the backward
    key, state = id(base), (base._version, base.data_ptr())
    entry = _WEIGHT_CACHE.get(key)
    if entry is None or entry.base() is not base:
        entry = _WEIGHT_CACHE[key] = _CachedWeight(weakref.ref(base), state, {})
        weakref.finalize(base, _WEIGHT_CACHE.pop, key, None)
    if entry.state != state:
        entry.forms.clear()  # stale: free it before the new forms are made
        entry.state = state
    form = form_of(transposed)
    if form in entry.forms:  # (the other form's key is built only where it is asked for: host time a call)
        _WEIGHT_COUNTS["reused"] += 1
    elif both and blocks is None and form_of(not transposed) not in entry.forms:
        _WEIGHT_COUNTS["quantised"] += 2
        _WEIGHT_COUNTS["both_at_once"] += 1
        rows, cols = quantize_both(w)
        entry.forms[form_of(False)], entry.forms[form_of(True)] = rows, cols
    else:
        _WEIGHT_COUNTS["quantised"] += 1
        entry.forms[form] = make()
    return entry.forms[form]


def weight_counts() -> dict[str, int]:
    """Weight quantisations in this process so far: 'quantised' (forms made and cached), 'reused' (a cached
    form served), 'uncached' (made for one call), 'both_at_once' (of the 'quantised', pairs of forms made in
    one :func:`quantize_both`)."""
    return dict(_WEIGHT_COUNTS)


def clear_weight_cache() -> None:
    """Drop every cached weight form (their memory returns to the allocator); the counts go on (a trainer
    clears the cache before every optimizer step, and the counts are read across steps)."""
    _WEIGHT_CACHE.clear()


def reset_weight_counts() -> None:
    """Zero the counts of :func:`weight_counts` (a kept rank starting another trial)."""
    _WEIGHT_COUNTS.clear()
