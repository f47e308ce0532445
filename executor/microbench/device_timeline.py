"""A profiled step read as a device timeline: where the device sat idle and what the host did meanwhile, and
which host ops launched the small kernels (torch.profiler's ``prof.events()``; bench/stack_profile.py).

Times are microseconds in the events and milliseconds per step in the results.
"""

from __future__ import annotations

import torch

from executor.microbench.intervals import busy_us, gaps


def device_timeline(events, steps: int, top: int = 8) -> dict:
    """Where the device sat idle in the profiled steps (milliseconds per step): the span from the first device
    operation (kernel, copy, memset) to the last, the union of their intervals (busy) and the rest (idle),
    and the ``top`` longest idle gaps, each with the device operations before and after it and the three
    shortest host events (aten ops, CUDA runtime calls) that were running across it: a host that blocks in a
    synchronizing call, or that is still issuing the next kernel, shows there."""
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type != torch.autograd.DeviceType.CUDA]
    if not device:
        return {}
    spans = sorted(((e.time_range.start, e.time_range.end, e.name) for e in device))
    intervals = [(s, e) for s, e, _ in spans]
    span = max(e for _, e in intervals) - spans[0][0]
    busy = busy_us(intervals)
    idle = sorted(gaps(intervals), key=lambda g: g[0] - g[1])[:top]
    rows = []
    for start, end in idle:
        before = max((sp for sp in spans if sp[1] <= start), key=lambda sp: sp[1], default=None)
        after = min((sp for sp in spans if sp[0] >= end), key=lambda sp: sp[0], default=None)
        mid = (start + end) / 2
        across = sorted((e.time_range.end - e.time_range.start, e.name) for e in host
                        if e.time_range.start <= mid <= e.time_range.end)[:3]
        rows.append({"ms": (end - start) / 1e3, "before": before[2][:80] if before else None,
                     "after": after[2][:80] if after else None,
                     "host_across": [{"name": n[:60], "ms": d / 1e3} for d, n in across]})
    return {"span_ms": span / steps / 1e3, "busy_ms": busy / steps / 1e3, "idle_ms": (span - busy) / steps / 1e3,
            "device_ops": len(device) / steps, "top_gaps": rows}


def kernel_launchers(events, steps: int, match: tuple[str, ...] = ("elementwise", "Cat", "copy", "reduce"),
                     top: int = 12) -> list[dict]:
    """Which host ops launched the device kernels whose names contain one of ``match`` (elementwise work that
    fusion could remove): per (kernel, chain of host ops from the launching op up to three parents, autograd's
    backward nodes among them), the calls and milliseconds per step, the ``top`` longest first."""
    rows: dict[tuple[str, str], list[float]] = {}
    for evt in events:
        kernels = [k for k in getattr(evt, "kernels", []) or [] if any(m in k.name for m in match)]
        if not kernels:
            continue
        chain, parent = [evt.name], evt.cpu_parent
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parent.cpu_parent
        for k in kernels:
            row = rows.setdefault((k.name[:60], " < ".join(c[:50] for c in chain)), [0, 0.0])
            row[0] += 1
            row[1] += k.duration
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": kernel, "launched_by": chain, "calls": n / steps, "ms": us / steps / 1e3}
            for (kernel, chain), (n, us) in ranked]


def format_timeline(t: dict) -> str:
    """:func:`device_timeline`'s result as the bench prints it, with the ``synchronizing_calls`` and
    ``launchers`` the caller added (:mod:`executor.microbench.sync_debug`, :func:`kernel_launchers`)."""
    lines = [f"  device per step: span {t['span_ms']:.2f} ms, busy {t['busy_ms']:.2f}, idle {t['idle_ms']:.2f} "
             f"({t['device_ops']:.0f} device ops); {len(t['synchronizing_calls'])} synchronizing calls"]
    lines += [f"    sync: {c}" for c in t["synchronizing_calls"][:8]]
    for g in t["top_gaps"]:
        host = "; ".join(f"{h['name']} {h['ms']:.3f}" for h in g["host_across"])
        lines.append(f"    gap {g['ms']:.3f} ms after {str(g['before'])[:40]} before {str(g['after'])[:40]} "
                     f"| host: {host}")
    for row in t.get("launchers", []):
        lines.append(f"    {row['ms']:.3f} ms {row['calls']:4.1f}x {row['kernel'][:40]} <- {row['launched_by'][:120]}")
    return "\n".join(lines)
