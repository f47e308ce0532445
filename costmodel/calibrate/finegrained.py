"""Profile fields from a fine-grained MoE run (``bench/finegrained_moe.py``): host seconds per local expert, the
router's and the permutation's factors. ``foldtune calibrate finegrained`` applies them to a profile.

The run (one GPU, real widths, ``executor/microbench/finegrained.py``) stores raw seconds only; this module
derives, against the *target* profile's own prediction (as ``foldtune calibrate merge`` recomputes component
factors), so that each factor corrects the curves it will be applied with:

* ``local_expert_host_s``: the slope of the executor MoE layer's host issue seconds (forward + backward, one
  micro-batch) over its local experts, fitted over every model at once with one intercept per model (least
  squares, :func:`pooled_slope`); a negative slope (the executor's grouped kernels issue nothing per expert, so
  the true slope is about 0 and noise can make it negative) is stored as 0, which is a measurement;
* ``expert_loop_host_s``: the same slope for one GEMM launch per expert and pass (6 per local expert);
* ``moe_router_factor``: the router's measured forward + backward seconds over the priced ones, summed over
  the run's largest token count of each model (``sum measured / sum priced``: the long points weigh most, where
  the device and not the host sets the time);
* ``moe_permute_factor``: the same for the permutation (the dispatcher's phases 'dispatch' and 'combine' of the
  in-step timing; the exchange stub left out) against priced permute + sort by local expert + unpermute.

The priced seconds come from ``costmodel.finegrained.priced_point`` on the target with the four fields cleared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from costmodel.finegrained import priced_host_probe, priced_point
from costmodel.host import TE_GROUPED_LINEAR_PER_LOCAL_EXPERT, seconds_per_op
from spec.errors import CatalogError
from spec.hardware import HardwareProfile

RECORD_KIND = "finegrained_moe"
FIELDS = ("local_expert_host_s", "expert_loop_host_s", "moe_router_factor", "moe_permute_factor")


@dataclass(frozen=True)
class FineFactors:
    """The four profile fields (None where the run measured too little for one) and how each was derived."""

    local_expert_host_s: float | None
    expert_loop_host_s: float | None
    moe_router_factor: float | None
    moe_permute_factor: float | None
    basis: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in FIELDS}


def catalog_name(model: str) -> str:
    """The name :func:`costmodel.finegrained.routed_proxy` rebuilds a record's model from ('deepseek-v3@1L' ->
    'deepseek-v3', 'deepseek-v3@tiny@1L' -> 'deepseek-v3@tiny')."""
    return "@".join(p for p in model.split("@") if not (p.endswith("L") and p[:-1].isdigit()))


def check_record(stored: Any, source: str) -> dict:
    """The fine-grained record held in ``stored`` (the JSON content of file ``source``); CatalogError naming
    ``source`` and what is missing when it is not one."""
    if not isinstance(stored, dict) or stored.get("kind") != RECORD_KIND:
        raise CatalogError(f"{source}: not a fine-grained MoE result (write one with bench/finegrained_moe.py)")
    missing = [k for k in ("points", "router", "host") if not isinstance(stored.get(k), list)]
    if missing:
        raise CatalogError(f"{source}: fine-grained MoE result without {', '.join(missing)}")
    return stored


def pooled_slope(groups: dict[str, list[tuple[float, float]]]) -> float | None:
    """Least-squares slope of y over x shared by every group, each group with its own intercept; None with
    fewer than two distinct x in every group."""
    num = den = 0.0
    for pts in groups.values():
        if len({x for x, _ in pts}) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    return num / den if den > 0 else None


def _host_slope(host: list[dict], key: str) -> tuple[float | None, float | None]:
    """(slope stored: >= 0, slope fitted) of ``key`` seconds over local experts."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for h in host:
        if _usable(h.get(key)):
            groups.setdefault(h["model"], []).append((float(h["local_experts"]), float(h[key])))
    fitted = pooled_slope(groups)
    return (None if fitted is None else max(0.0, fitted)), fitted


def _usable(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _largest(rows: list[dict]) -> list[dict]:
    """The rows at each model's largest token count."""
    top: dict[str, int] = {}
    for r in rows:
        top[r["model"]] = max(top.get(r["model"], 0), int(r["tokens"]))
    return [r for r in rows if int(r["tokens"]) == top[r["model"]]]


def derive(record: dict, target: HardwareProfile) -> FineFactors:
    """:class:`FineFactors` of a checked ``record`` against ``target`` (module docstring)."""
    base = replace(target, **{name: None for name in FIELDS})
    local_s, local_fit = _host_slope(record["host"], "layer_host_s")
    loop_s, loop_fit = _host_slope(record["host"], "loop_host_s")
    router_meas = router_pred = 0.0
    for r in _largest([r for r in record["router"] if _usable(r.get("router_s"))]):
        router_meas += r["router_s"]
        # the router's price does not depend on the local experts: any count that divides the experts
        router_pred += priced_point(catalog_name(r["model"]), _any_local(record, r["model"]), int(r["tokens"]),
                                    base).pieces["router"]
    perm_meas = perm_pred = 0.0
    for p in _largest([p for p in record["points"] if _usable(p.get("permutation_s"))]):
        perm_meas += p["permutation_s"]
        perm_pred += priced_point(catalog_name(p["model"]), int(p["local_experts"]), int(p["tokens"]),
                                  base).permutation_s
    router = router_meas / router_pred if router_pred > 0 and router_meas > 0 else None
    permute = perm_meas / perm_pred if perm_pred > 0 and perm_meas > 0 else None
    basis = {"local_expert_host_s_fit": local_fit, "expert_loop_host_s_fit": loop_fit,
             "router_measured_s": router_meas, "router_priced_s": router_pred,
             "permutation_measured_s": perm_meas, "permutation_priced_s": perm_pred, "priced_on": target.name}
    return FineFactors(local_s, loop_s, router, permute, basis)


def _any_local(record: dict, model: str) -> int:
    counts = sorted({int(p["local_experts"]) for p in record["points"] if p["model"] == model})
    if not counts:
        counts = sorted({int(h["local_experts"]) for h in record["host"] if h["model"] == model})
    return counts[0] if counts else 1


def apply(target: HardwareProfile, factors: FineFactors) -> HardwareProfile:
    """``target`` with every field ``factors`` measured (the others kept)."""
    found = {k: v for k, v in factors.fields().items() if v is not None}
    return replace(target, **found)


def comparison(record: dict, hardware: HardwareProfile) -> dict[str, list[dict]]:
    """Measured against priced, per row of a checked ``record`` on ``hardware`` (seconds, forward + backward of one
    micro-batch): 'points' (router: the router alone at the point's tokens; permutation; experts; the exchange
    stub, priced 0 here as no bytes move), 'host' (the executor layer's and the per-expert loop's issue seconds
    against the host the model prices for that layer: its ops, and 6 launches per expert for the loop)."""
    routers = {(r["model"], int(r["tokens"])): r.get("router_s") for r in record["router"]}
    points = []
    for p in record["points"]:
        priced = priced_point(catalog_name(p["model"]), int(p["local_experts"]), int(p["tokens"]), hardware)
        points.append({
            "model": p["model"], "local_experts": p["local_experts"], "ep": p["ep"], "tokens": p["tokens"],
            "received_rows": p.get("received_rows"),
            "router_s": routers.get((p["model"], int(p["tokens"]))), "router_priced_s": priced.pieces["router"],
            "router_phase_s": p.get("router_phase_s"),
            "permutation_s": p.get("permutation_s"), "permutation_priced_s": priced.permutation_s,
            "experts_s": p.get("experts_phase_s"), "experts_priced_s": priced.experts_s,
            "grouped_gemm_priced_s": priced.pieces["grouped_gemm"],
            "exchange_stub_s": p.get("exchange_stub_s"), "step_s": p.get("step_s")})
    host = []
    for h in record["host"]:
        layer, per_expert = priced_host_probe(catalog_name(h["model"]), int(h["local_experts"]), hardware)
        host.append({"model": h["model"], "local_experts": h["local_experts"], "tokens": h["tokens"],
                     "layer_host_s": h.get("layer_host_s"), "layer_host_priced_s": layer,
                     "per_expert_priced_s": per_expert, "loop_host_s": h.get("loop_host_s"),
                     "loop_per_expert_priced_s": _loop_priced(hardware)})
    return {"points": points, "host": host}


def _loop_priced(hardware: HardwareProfile) -> float:
    """Host seconds the model prices per local expert of a per-expert-launch runtime (TE's GroupedLinear)."""
    if hardware.expert_loop_host_s is not None:
        return hardware.expert_loop_host_s
    return TE_GROUPED_LINEAR_PER_LOCAL_EXPERT.ops * seconds_per_op(hardware)
