"""The (model, training, cluster) a user names on a command line: catalog names, a profile file, numbers.

``foldtune plan`` and the benchmark drivers take the same kind of options (a catalog model, optionally cut
to fewer layers, a GPU count, a catalog GPU or a calibrated profile file, training numbers); this builds
the specs from them in one place.
"""

from __future__ import annotations

from typing import Any

from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.profile_io import load_profile
from spec.training_spec import TrainingSpec


def build_specs(model: str | ModelSpec, gpus: int, *, gpu: str | None = None, profile: str | None = None,
                layers: int | None = None, min_headroom: float | None = None,
                **training: Any) -> tuple[ModelSpec, TrainingSpec, ClusterSpec]:
    """(catalog ``model`` (or the ModelSpec itself), cut to ``layers`` when given; a TrainingSpec of the
    ``training`` fields; ``gpus`` GPUs of the hardware profile in the file ``profile``, else of the catalog
    hardware ``gpu``, keeping ``min_headroom`` free per GPU, None: the default).

    Raises CatalogError for an unknown name or an unreadable profile file, SpecError for a bad value."""
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    if layers:
        spec = spec.with_layers(layers)
    hardware = load_profile(profile) if profile else get_hardware(gpu)
    cluster = (ClusterSpec(hardware, gpus) if min_headroom is None
               else ClusterSpec(hardware, gpus, min_headroom=min_headroom))
    return spec, TrainingSpec(**training), cluster
