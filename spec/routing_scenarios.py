"""Routing scenarios of a one-rank slice: how many routed token copies each expert receives.

A slice (``foldtune verify``) measures one rank of a large layout on one device, so it cannot learn the routing
from a real router over real data: it is told. A scenario is an expert load vector (each expert's share of the
routed token copies, as ``TrainingSpec.moe_expert_load`` holds it), so the cost model prices the same load the
executor runs: :func:`even_load` (every expert the mean) or :func:`hot_expert_load` (expert 0 at ``factor``
times the mean, the others sharing the rest). :func:`routed_counts` turns a load into whole token copies per
expert for ``tokens`` tokens of ``topk`` choices each, as one rank's router would hand them to the dispatcher.

Expert 0 lives on EP rank 0 (experts are placed in blocks of E/ep), so the slice of EP rank 0 under
:func:`hot_expert_load` is the busiest rank, the one that paces an EP layout.
"""

from __future__ import annotations

from spec.errors import SpecError

SCENARIOS = ("even", "skewed")
DEFAULT_HOT_FACTOR = 2.0


def even_load(num_experts: int) -> tuple[float, ...]:
    """Every expert the same share."""
    return (1.0,) * num_experts


def hot_expert_load(num_experts: int, factor: float = DEFAULT_HOT_FACTOR) -> tuple[float, ...]:
    """Expert 0 at ``factor`` x the mean share, the other experts equal, the mean 1.0 (shares, not counts).

    ``factor`` must lie in [1, num_experts] (all copies on one expert at most); one expert is always even."""
    if num_experts <= 1:
        return even_load(num_experts)
    if not 1.0 <= factor <= num_experts:
        raise SpecError(f"a hot expert's factor must lie in [1, {num_experts}] (the experts), got {factor}")
    rest = (num_experts - factor) / (num_experts - 1)
    return (float(factor),) + (rest,) * (num_experts - 1)


def scenario_load(scenario: str, num_experts: int, factor: float = DEFAULT_HOT_FACTOR) -> tuple[float, ...]:
    """The load vector of a named scenario (:data:`SCENARIOS`)."""
    if scenario == "even":
        return even_load(num_experts)
    if scenario == "skewed":
        return hot_expert_load(num_experts, factor)
    raise SpecError(f"routing scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")


def routed_counts(load: tuple[float, ...], tokens: int, topk: int) -> list[int]:
    """Token copies per expert for ``tokens`` tokens of ``topk`` distinct experts each: the load's shares of
    ``tokens * topk`` rounded by largest remainder, no expert above ``tokens`` (a token picks an expert once),
    what an expert cannot take given to the next ones in share order. Sums to ``tokens * topk``."""
    experts = len(load)
    if topk > experts:
        raise SpecError(f"top-k ({topk}) exceeds the experts ({experts})")
    total = tokens * topk
    weight = sum(load)
    exact = [total * share / weight for share in load]
    counts = [min(tokens, int(x)) for x in exact]
    order = sorted(range(experts), key=lambda e: (-(exact[e] - int(exact[e])), -load[e], e))
    left = total - sum(counts)
    while left > 0:  # largest remainder first, then by share; each pass gives every open expert one copy at most
        moved = 0
        for e in order:
            if left == 0:
                break
            if counts[e] < tokens:
                counts[e] += 1
                left -= 1
                moved += 1
        if moved == 0:  # cannot happen while topk <= experts: tokens * experts >= total
            raise SpecError(f"{total} token copies do not fit {experts} experts of {tokens} tokens each")
    return counts
