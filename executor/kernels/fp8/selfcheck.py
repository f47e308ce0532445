"""First-use self-checks of the fp8 paths (:mod:`executor.kernels.fp8`), once per device and process, through
:func:`executor.kernels.triton_permute.checked_once` (on a thread of their own; a check that raises turns its
path off, with a warning): the scaled GEMMs against the emulation (within bf16 rounding, 2^-7 relative), and
the Triton quantisation, two-pass and one-kernel rowwise, against the torch ops byte for byte (scales
exactly, e4m3 bytes one for one). A failed check costs speed, never the run: the GEMMs are emulated, the
quantisation stays on the torch ops (on two Triton passes where only the one-kernel path failed).
``_CHECKED`` holds the verdicts, keyed (device,), ("quantise", device) and ("rows", device).

The gates that read them (:func:`executor.kernels.fp8.gemm.kernels_ok`, ``quantize._use_triton`` and
``quantize._fused_rows_ok``) import this module when they run: it imports theirs.
"""

from __future__ import annotations

from collections import Counter

import torch

from executor.kernels.fp8.gemm import _COUNTS, scaled_grouped_nt, scaled_grouped_wgrad, scaled_mm_nt
from executor.kernels.fp8.quantize import (
    _quantize_groups_colwise_torch,
    _quantize_groups_colwise_triton,
    _quantize_rows_fused,
    _quantize_rowwise_torch,
    _quantize_rowwise_two_pass,
    padded_groups,
)

_CHECKED: dict[tuple, bool] = {}  # first-use verdicts, one per key (module docstring): True where the check passed


# ---- first-use self-check -------------------------------------------------------------------------------

def _check_against_emulation(device: str) -> None:
    """Raise if a kernel differs from the emulation by more than bf16 rounding (2^-7 relative: one or two
    bf16 ulps after a different fp32 summation order) on random data: dense forward and a wgrad whose
    token count is no multiple of 16; grouped forward, dgrad and wgrad with an empty group, a group of 5
    rows and a final group of 67."""
    counted = Counter(_COUNTS)
    try:
        _compare_on(device)
    finally:  # the check's own calls are not the run's
        _COUNTS.clear()
        _COUNTS.update(counted)


def _compare_on(device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    def same(kernel, emulated):
        torch.testing.assert_close(kernel.float(), emulated.float(), rtol=2**-7,
                                   atol=1e-3 * float(emulated.abs().max()))

    x, dy, w = rand(72, 64), rand(72, 48), rand(3, 48, 64)
    offs = torch.tensor([5, 5, 72], device=device, dtype=torch.int32)
    same(scaled_mm_nt(x, w[0], True), scaled_mm_nt(x, w[0], False))
    same(scaled_mm_nt(dy.t(), x.t(), True), scaled_mm_nt(dy.t(), x.t(), False))
    same(scaled_grouped_nt(x, w, offs, True), scaled_grouped_nt(x, w, offs, False))
    wt = w.transpose(-2, -1)
    same(scaled_grouped_nt(dy, wt, offs, True), scaled_grouped_nt(dy, wt, offs, False))
    same(scaled_grouped_wgrad(dy, x, offs, True), scaled_grouped_wgrad(dy, x, offs, False))


def _bf16_ladder(device) -> torch.Tensor:
    """Every finite bf16 value of magnitude up to 448, both signs, as a [4, n] tensor whose rows all have
    amax 448: scale 1, so the cast sees each value exactly (all of e4m3's rounding cases, subnormals too)."""
    codes = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16)  # 0x43E0 is 448.0
    values = codes.view(torch.bfloat16).to(device)
    return torch.stack([values, -values, values.flip(0), -values.flip(0)])


def _compare_quantised(name: str, got: tuple, want: tuple) -> None:
    """Raise unless two (q, scale) pairs are equal: scales exactly, e4m3 bytes one for one."""
    (q, scale), (q_ref, scale_ref) = got, want
    if not torch.equal(scale, scale_ref):
        raise AssertionError(f"Triton quantisation scales differ from torch's ({name})")
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if bool(differ.any()):
        at = differ.nonzero()[0].tolist()
        raise AssertionError(f"Triton e4m3 bytes differ from torch's ({name}): {int(differ.sum())} of "
                             f"{differ.numel()}, first at {at}: {int(q.view(torch.uint8)[tuple(at)])} "
                             f"against {int(q_ref.view(torch.uint8)[tuple(at)])}")


def _check_fused_rows(_: str, device: str) -> None:
    """Raise unless the one-kernel rowwise quantisation gives the torch path's scales and bytes: the bf16
    ladder (rows longer than a chunk), rows of mixed magnitude in 3-D with partial tiles, a 2-D slice."""
    x = _mixed_rows(device)
    cases = (("ladder", _bf16_ladder(device)), ("3-D", x), ("2-D", x[0, :37]), ("long rows", x.view(6, -1)))
    for name, t in cases:
        _compare_quantised(name, _quantize_rows_fused(t), _quantize_rowwise_torch(t))


def _mixed_rows(device) -> torch.Tensor:
    """[3, 70, 100] bf16 Gaussian rows with a large row, a tiny one and a zero one."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 70, 100, device=device, generator=gen)
    x[0, 1] *= 1e4
    x[1, 2] *= 1e-30
    x[2, 3] = 0.0
    return x.to(torch.bfloat16)


def _check_triton_quantise(_: str, device: str) -> None:
    """Raise unless the two-pass Triton quantisation writes the torch path's scales and bytes: the bf16
    ladder; rows of mixed magnitude in 3-D with partial tiles, rowwise and through a transposed view; per-
    expert column scaling with an empty group, a group of 5 and one of 67 rows."""
    x = _mixed_rows(device)
    offs = torch.tensor([5, 5, 72], device=device, dtype=torch.int32)
    groups = padded_groups(offs, 72)
    cases = [("ladder", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (_bf16_ladder(device),)),
             ("rowwise 3-D", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x,)),
             ("transposed", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x.transpose(1, 2),)),
             ("2-D", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x[0, :37],)),
             ("groups colwise", _quantize_groups_colwise_triton, _quantize_groups_colwise_torch,
              (x[0].t()[:72], groups))]
    for name, triton_path, torch_path, args in cases:
        _compare_quantised(name, triton_path(*args), torch_path(*args))
