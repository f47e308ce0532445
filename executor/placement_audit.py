"""Where a tuning job's trials ran, checked against the plan: each succeeded trial's ranks where the planner put
them (ranks kG..kG+G-1 on one Ray node, G GPUs per node), no two ranks on one GPU, and trials that ran at the
same time (their measurements' ``run_window``, Unix seconds) on disjoint GPUs. Trials are dicts with
``number``, ``status`` and ``measurement`` (its ``placement``: per rank the Ray ``node`` and ``gpus``), as the
service database stores them; ``bench/multinode_check.py`` reads them from there."""

from __future__ import annotations


def rank_devices(placement: list[dict]) -> list[tuple[str, str]]:
    """(Ray node id, GPU id) per rank; a rank without a GPU counts as the node's CPU."""
    return [(p.get("node", "?"), ",".join(map(str, p.get("gpus") or [])) or "cpu") for p in placement]


def placement_problems(trials: list[dict], gpus_per_node: int, want_gpus: int | None = None) -> list[str]:
    """What is wrong with where the succeeded trials' ranks ran (empty: nothing)."""
    problems = []
    done = [t for t in trials if t["status"] == "succeeded"]
    if not done:
        return ["no succeeded trial"]
    for t in done:
        m, n = t["measurement"], t["number"]
        placement = m.get("placement") or []
        if len(placement) != m.get("world_size"):
            problems.append(f"trial {n}: placement of {len(placement)} ranks for a world of {m.get('world_size')}")
            continue
        devices = rank_devices(placement)
        gpu_devices = [d for d in devices if d[1] != "cpu"]
        if len(set(gpu_devices)) != len(gpu_devices):
            problems.append(f"trial {n}: two ranks on one GPU: {devices}")
        for r in range(len(placement)):
            for s in range(r + 1, len(placement)):
                same_planned = r // gpus_per_node == s // gpus_per_node
                if same_planned != (devices[r][0] == devices[s][0]):
                    problems.append(f"trial {n}: ranks {r} and {s} are {'not ' if same_planned else ''}on one Ray "
                                    f"node, the planner put them {'together' if same_planned else 'apart'}")
        if want_gpus is not None and len(set(gpu_devices)) != want_gpus:
            problems.append(f"trial {n}: ranks on {len(set(gpu_devices))} distinct GPU(s), wanted {want_gpus}: "
                            f"{devices}")
    return problems


def overlapping_pairs(trials: list[dict]) -> list[tuple[int, int, float]]:
    """(trial a, trial b, seconds both ran) for succeeded trials whose run windows intersect."""
    done = [t for t in trials if t["status"] == "succeeded" and len(t["measurement"].get("run_window") or []) == 2]
    pairs = []
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            (a0, a1), (b0, b1) = a["measurement"]["run_window"], b["measurement"]["run_window"]
            both = min(a1, b1) - max(a0, b0)
            if both > 0:
                pairs.append((a["number"], b["number"], both))
    return pairs


def shared_gpus(trials: list[dict], a: int, b: int) -> set[tuple[str, str]]:
    """GPUs (node, id) that trials ``a`` and ``b`` both used (must be none when they overlap)."""
    by_number = {t["number"]: set(rank_devices(t["measurement"].get("placement") or [])) for t in trials}
    return {d for d in by_number[a] & by_number[b] if d[1] != "cpu"}
