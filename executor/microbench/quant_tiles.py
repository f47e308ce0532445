"""The fp8 quantisation kernels (executor/kernels/fp8/quantize.py) at one training step's shapes, under each
launch-tile variant: per case the device seconds (host ahead, :func:`executor.microbench.timing.time_host_ahead`),
whether its bytes and scales equal the torch path's (a tile that changes a byte is reported, never picked),
and its bandwidth; per family the step's seconds (Σ calls × time) and the fastest equal variant.

The cases (:data:`CASES`) are the quantisations of the Mixtral-shaped proxy of ``bench/fp8_step.py`` (2
layers, seq 4096, 4 micro-batches of 1: 8192 routed rows a layer and micro-batch, hidden 4096, ffn 14336, 8
experts), each with how often a step runs it. Bytes counted: the operand read once, the e4m3 outputs and
scales written once — the least any implementation moves. ``bench/fp8_quant_speed.py`` prints and stores it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from executor.kernels.fp8 import quantize
from executor.microbench.timing import time_host_ahead

BF16 = torch.bfloat16
M, H, F, G, TOKENS, QKV = 8192, 4096, 14336, 8, 4096, 6144  # routed rows, hidden, ffn, experts, tokens, q+k+v
LAYER_MB = 8  # 2 layers x 4 micro-batches


@dataclass(frozen=True)
class Case:
    """One quantisation a step runs: the kernel family, the operand's shape, calls a step."""

    family: str  # "rows", "groups", "both"
    name: str
    shape: tuple[int, ...]
    calls: int


CASES = (Case("rows", "x [M, h]", (M, H), LAYER_MB), Case("rows", "h [M, f]", (M, F), LAYER_MB),
         Case("rows", "dy [M, h]", (M, H), LAYER_MB), Case("rows", "d(gate,up) [M, 2f]", (M, 2 * F), LAYER_MB),
         Case("groups", "x [M, h]", (M, H), LAYER_MB), Case("groups", "h [M, f]", (M, F), LAYER_MB),
         Case("groups", "dy [M, h]", (M, H), LAYER_MB), Case("groups", "d(gate,up) [M, 2f]", (M, 2 * F), LAYER_MB),
         Case("both", "w13 [G, 2f, h]", (G, 2 * F, H), 2), Case("both", "w2 [G, h, f]", (G, H, F), 2),
         Case("both", "dense x [t, h]", (TOKENS, H), 2 * LAYER_MB),
         Case("both", "dense dy qkv [t, qkv]", (TOKENS, QKV), LAYER_MB),
         Case("both", "dense dy o [t, h]", (TOKENS, H), LAYER_MB))

# tiles tried per kernel family: {TILES key: [values]}; the current TILES value is always tried too
SWEEP = {
    "rows": {"rows_whole": [(4096, 16), (8192, 16), (8192, 32), (16384, 32), (16384, 64), (32768, 64)]},
    "groups": {"group_amax": [(32, 128, 4, 8192), (32, 128, 4, 16384), (64, 128, 4, 8192), (128, 128, 8, 2048),
                              (128, 128, 8, 8192), (64, 256, 8, 8192), (16, 128, 4, 16384)],
               "cast_across": [(128, 64, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8), (32, 128, 4)]},
    "both": {"both_amax": [(64, 256, 8), (256, 64, 8), (256, 128, 8), (64, 128, 4), (128, 256, 8)],
             "both_cast": [(128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4), (32, 64, 4)]},
}
TINY_SCALE = 64  # a smoke run divides every dim by this (CPU, Triton's interpreter)


def _operand(case: Case, dev: torch.device, scale: int) -> torch.Tensor:
    shape = tuple(max(16, d // scale) if i else d for i, d in enumerate(case.shape)) if case.family == "both" \
        else tuple(max(16, d // scale) for d in case.shape)
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.name.encode()))  # the same data every run
    return torch.randn(shape, device=dev, generator=gen).to(BF16)


def _groups(m: int, dev: torch.device) -> quantize.PaddedGroups:
    """Uneven routing as a random router gives it: group sizes no multiples of 16."""
    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(G, generator=gen) + 0.5
    counts = (weights / weights.sum() * m).long()
    counts[-1] += m - counts.sum()
    return quantize.padded_groups(torch.cumsum(counts, 0).to(dev, torch.int32), m)


def _runner(case: Case, t: torch.Tensor, groups):
    if case.family == "rows":
        return lambda: quantize._quantize_rows_fused(t)
    if case.family == "groups":
        return lambda: quantize._quantize_groups_colwise_triton(t, groups)
    return lambda: quantize._quantize_both_triton(t)


def _reference(case: Case, t: torch.Tensor, groups):
    if case.family == "rows":
        return [quantize._quantize_rowwise_torch(t)]
    if case.family == "groups":
        return [quantize._quantize_groups_colwise_torch(t, groups)]
    return list(quantize._quantize_both_torch(t))


def _bytes_moved(case: Case, t: torch.Tensor, groups) -> int:
    """The operand read once; e4m3 outputs (two for both forms; the padded layout for groups) and scales written."""
    rows, c = t.numel() // t.shape[-1], t.shape[-1]
    if case.family == "rows":
        return t.numel() * 2 + t.numel() + rows * 4
    if case.family == "groups":
        return t.numel() * 2 + groups.rows * c + G * c * 4
    return t.numel() * 2 + 2 * t.numel() + (rows + t.numel() // t.shape[-2]) * 4


def _equal(got, want: list) -> bool:
    """Whether ``got`` (one (q, scale) pair, or quantize_both's two) has the bytes and scales of ``want``."""
    got = [got] if isinstance(got[0], torch.Tensor) else list(got)
    return all(torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
               for (q, s), (q_ref, s_ref) in zip(got, want))


INTEGER_ROUNDING = "integer rounding"  # a variant: the current tiles, rounding by integer ops (not the GPU's cvt)


def _device_seconds(op, dev: torch.device, calls: int | None) -> float:
    """Device seconds of one call with the host ahead, as in a step (the small operands' launches take the
    host longer than the GPU their kernels: wall clock would time the host)."""
    return time_host_ahead(op, dev, calls=calls or 8, windows=3).seconds


def variants(family: str) -> list:
    """The TILES overrides tried for ``family``: the current tiles first, then the same with the integer
    rounding, then each swept value of one key."""
    out = [{}, INTEGER_ROUNDING]
    for key, values in SWEEP[family].items():
        out += [{key: v} for v in values if v != quantize.TILES[key]]
    return out


def measure(dev: torch.device, scale: int = 1, families=("rows", "groups", "both"), iters: int | None = None) -> dict:
    """Per family and tile variant (:func:`variants`): per-case seconds, equality with the torch path and GB/s,
    the step's total seconds, and the fastest variant whose every case equals the torch path (``best``);
    every dim divided by ``scale`` (a CPU smoke run under Triton's interpreter), ``iters`` calls a window
    (None: 8)."""
    res = {"tiles": dict(quantize.TILES), "hw_cast": quantize._hw_cast(dev), "families": {}}
    data = [(case, t, _groups(t.shape[0], dev) if case.family == "groups" else None)
            for case in CASES if case.family in families for t in [_operand(case, dev, scale)]]
    biggest = max((t for _, t, _ in data), key=torch.Tensor.numel)
    copy_s = _device_seconds(lambda: torch.empty_like(biggest).copy_(biggest), dev, iters)
    res["copy_GBps"] = 2 * biggest.numel() * 2 / copy_s / 1e9
    for family in families:
        cases = [(c, t, g) for c, t, g in data if c.family == family]
        refs = [_reference(c, t, g) for c, t, g in cases]
        rows = []
        for override in variants(family):
            saved = dict(quantize.TILES)
            if override == INTEGER_ROUNDING:
                quantize._CAST_MODE.hw = False
            else:
                quantize.TILES.update(override)
            try:
                per_case = {}
                for (case, t, groups), want in zip(cases, refs):
                    run = _runner(case, t, groups)
                    same = _equal(run(), want)
                    s = _device_seconds(run, dev, iters)
                    per_case[case.name] = {"s": s, "equal": same,
                                           "GBps": _bytes_moved(case, t, groups) / s / 1e9}
                step = sum(c.calls * per_case[c.name]["s"] for c, _, _ in cases)
                rows.append({"tiles": override or "current", "per_case": per_case, "step_s": step,
                             "all_equal": all(v["equal"] for v in per_case.values())})
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported, not picked
                rows.append({"tiles": override, "error": f"{type(exc).__name__}: {exc}"[:300]})
            finally:
                quantize._CAST_MODE.hw = None
                quantize.TILES.clear()
                quantize.TILES.update(saved)
        ok = [r for r in rows if r.get("all_equal")]
        best = min(ok, key=lambda r: r["step_s"]) if ok else None
        res["families"][family] = {"variants": rows, "best": best["tiles"] if best else None}
    return res
