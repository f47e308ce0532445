"""Per-call seconds of the executor's exchanges that the bandwidth model does not price.

The bandwidth curves price a collective by its bytes (latency inside the curve, timed on bare collectives);
the executor's CP K/V exchange and its token dispatchers pay more per call than that: the ops around the
collectives (reorders, index selections, split sizes), their Python, and the alltoall dispatcher's host
synchronisation for its split sizes, during which the device idles. ``foldtune calibrate`` on two or more
ranks times the executor's own code at one small shape and stores what it measured beyond the model's price
(``HardwareProfile.cp_exchange_fixed_s``, ``dispatcher_fixed_s``: seconds per call, forward + backward,
floored at 0; ``costmodel.calibrate.fixed_costs``). This module resolves them for the time model:

- measured: the profile's value;
- not measured: a rule of thumb, labelled so — the call's collectives (the host-op counts of
  ``costmodel.host`` / ``costmodel.dispatch``) at ``HardwareProfile.collective_launch_seconds`` each (the
  measured or default seconds of a near-empty collective). It is not derived from any exchange measurement.

The time model adds half of a call's seconds forward and half backward (the forward's all-gathers or
all-to-alls mirror the backward's reduce-scatters or all-to-alls); recomputation re-runs the forward half.
The CP chunk kernels' own per-call cost is priced in ``costmodel.context_parallel`` (0 when not measured).
"""

from __future__ import annotations

from costmodel.dispatch import PRICING
from costmodel.host import CP_PER_LAYER
from spec.hardware import HardwareProfile

# key of the CP K/V exchange in :func:`exchange_fixed`'s mapping (the dispatchers use their own names)
CP_EXCHANGE = "cp_exchange"


def cp_exchange_fixed(hardware: HardwareProfile) -> float:
    """Seconds per CP K/V exchange of one attention layer and micro-batch, forward + backward, beyond its
    bandwidth price: measured, else its collectives (K and V all-gathered, their gradients reduce-scattered)
    at the collective launch seconds (rule of thumb, not measured)."""
    if hardware.cp_exchange_fixed_s is not None:
        return hardware.cp_exchange_fixed_s
    return CP_PER_LAYER.collectives * hardware.collective_launch_seconds


def dispatcher_fixed(hardware: HardwareProfile, name: str) -> float:
    """Seconds per dispatch + combine of one MoE layer and micro-batch, forward + backward, of dispatcher
    ``name`` beyond its bandwidth price: measured, else the dispatcher's collectives per call
    (``DispatcherPricing.call_collectives``) at the collective launch seconds (rule of thumb, not measured)."""
    measured = dict(hardware.dispatcher_fixed_s).get(name)
    if measured is not None:
        return measured
    return PRICING[name].call_collectives * hardware.collective_launch_seconds


def exchange_fixed(hardware: HardwareProfile) -> dict[str, float]:
    """:data:`CP_EXCHANGE` and every registered dispatcher's name -> its seconds per call (above)."""
    out = {name: dispatcher_fixed(hardware, name) for name in PRICING}
    out[CP_EXCHANGE] = cp_exchange_fixed(hardware)
    return out
