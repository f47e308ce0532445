"""Put the component measurements of several ``foldtune calibrate --model`` runs into one machine profile.

A component run (one GPU, one model shape) saves its measured seconds beside a profile of its own. Its
factors are ratios against *that* profile's prediction. :func:`merged_profile` recomputes every shape's
factors against the target profile (the machine calibration the planner will use) from the stored measured
seconds, so the factors and the curves they correct come from the same profile. Nothing end-to-end goes in.

    foldtune calibrate merge --profile machine.json --components a.json,b.json --out merged.json
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from costmodel.calibrate.component_factors import ComponentReport, build_report
from costmodel.calibrate.host_factors import HostProbe, host_factors
from spec.catalog import get_model
from spec.errors import CatalogError
from spec.hardware import HardwareProfile
from spec.model_spec import ModelSpec


def model_of(name: str) -> ModelSpec:
    """The catalog model of a report's name: 'mixtral-8x7b' or a proxy 'mixtral-8x7b@2L'."""
    base, _, layers = name.partition("@")
    spec = get_model(base)
    return spec.with_layers(int(layers[:-1])) if layers.endswith("L") and layers[:-1].isdigit() else spec


def component_record(stored: Any, source: str) -> dict:
    """The component report a ``calibrate --model`` run kept in its raw record (``stored`` is the JSON
    content of the file ``source``); CatalogError naming ``source`` when it holds none."""
    raw = (stored.get("raw") if isinstance(stored, dict) else None) or {}
    if "components" not in raw:
        raise CatalogError(f"{source}: no component measurements (run foldtune calibrate --model ...)")
    return raw["components"]


def merged_profile(target: HardwareProfile, reports: list[dict]) -> tuple[HardwareProfile, list[ComponentReport]]:
    """``target`` with one component-factor entry per report, each recomputed against ``target``."""
    factors = {k: dict(v) for k, v in target.component_factors}
    rebuilt = []
    for r in reports:
        measured = {c["name"]: c["measured_s"] for c in r["components"]}
        spec = model_of(r["model"])
        report = build_report(spec, r["seq_length"], r["micro_batch_size"], r["precision"],
                              r["device"], measured, target, r.get("timing"))
        if r.get("host_probe"):  # the host probe's seconds, re-priced against the target's host floor
            found = host_factors(spec, HostProbe.from_record(r["host_probe"]), r["precision"], target)
            report = replace(report, factors={**report.factors, **found})
        factors[report.key] = report.factors
        rebuilt.append(report)
    return replace(target, component_factors=factors), rebuilt
