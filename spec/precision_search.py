"""Precision as a searched knob of a tuning job: the precisions it may measure and how the flag is stored.

A job submitted with ``search_precision`` keeps its training spec as given and carries the flag in the stored
training spec under :data:`SEARCH_PRECISION_KEY` (beside the router options, ``spec.router_options``), so a
job that searched precision has its own signature: its best trial may be fp8, which is not the answer to
the same workload asked at one precision. The flag is stored only when on, so other jobs' signatures do
not change.
"""

from __future__ import annotations

from typing import Any

from spec.multimodal import split_images
from spec.router_options import split_router

SEARCHED_PRECISIONS = ("bf16", "fp8")  # what search_precision adds to the job's own precision
SEARCH_PRECISION_KEY = "search_precision"  # a stored job training_spec's flag (only when on)


def split_precision_search(stored: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A stored training spec (router options already split off) as its TrainingSpec fields and the flag."""
    spec = {k: v for k, v in stored.items() if k != SEARCH_PRECISION_KEY}
    return spec, bool(stored.get(SEARCH_PRECISION_KEY, False))


def with_precision_search(training_spec: dict[str, Any], search: bool) -> dict[str, Any]:
    """``training_spec`` as stored with a job: the flag added only when on."""
    return {**training_spec, SEARCH_PRECISION_KEY: True} if search else dict(training_spec)


def trial_training(stored: dict[str, Any], precision: str | None) -> dict[str, Any]:
    """A job's stored training spec as TrainingSpec fields (router options and the flag split off), at the
    precision one of its trials ran (``precision`` None: as stored, e.g. a trial that does not say); a
    vision-language job's image inputs are split off too."""
    spec, _ = split_precision_search(split_images(split_router(stored)[0])[0])
    return spec if not precision else {**spec, "precision": precision}


def wanted_precisions(own: str) -> tuple[str, ...]:
    """What a job searching precision asks for: its own precision first, then bf16 and fp8 (the GPU may
    drop fp8: ``planner.SearchSpace.precisions_for``)."""
    return tuple(dict.fromkeys((own,) + SEARCHED_PRECISIONS))
