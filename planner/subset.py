"""A capped benchmark's layouts: at most ``k`` of a layout space, spread over the dimensions whose cost-model
terms differ most, so that a short accuracy run still sees every parallel size and knob value."""

from __future__ import annotations

from typing import Any

from spec.parallel_config import ParallelConfig

# The layout dimensions a subset must spread over (ParallelConfig fields; recompute and dispatcher are
# the knobs whose cost-model terms differ most besides the parallel sizes).
DIVERSITY_DIMS = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "micro_batch_size", "recompute",
                  "moe_token_dispatcher_type", "sequence_parallel")


def _features(config: ParallelConfig) -> tuple[tuple[str, Any], ...]:
    d = config.to_dict()
    d["dp"] = config.dp
    d["recompute"] = (config.recompute_granularity, tuple(config.recompute_modules))
    return tuple((dim, d[dim]) for dim in DIVERSITY_DIMS)


def diverse_subset(configs: list[ParallelConfig], k: int) -> list[ParallelConfig]:
    """At most ``k`` layouts spread over :data:`DIVERSITY_DIMS`, deterministically (enumeration order kept).

    Greedy: each pick is the layout adding the most (dimension, value) pairs not yet covered, then the
    most pairs of such pairs (tp=2 with ep=1, ...), ties going to the earliest in enumeration order; so
    every value of every dimension appears before any combination repeats.
    """
    if k >= len(configs):
        return list(configs)
    feats = [_features(c) for c in configs]
    singles: set = set()
    pairs: set = set()
    chosen: list[int] = []
    left = list(range(len(configs)))
    while len(chosen) < k and left:
        def gain(i: int) -> tuple[int, int, int]:
            f = feats[i]
            new_pairs = sum((f[a], f[b]) not in pairs for a in range(len(f)) for b in range(a + 1, len(f)))
            return (sum(x not in singles for x in f), new_pairs, -i)
        best = max(left, key=gain)
        left.remove(best)
        chosen.append(best)
        f = feats[best]
        singles.update(f)
        pairs.update((f[a], f[b]) for a in range(len(f)) for b in range(a + 1, len(f)))
    return [configs[i] for i in sorted(chosen)]
