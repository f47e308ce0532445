"""FP8 GEMMs with rowwise current scaling (executor/kernels/fp8.py), on CPU through the emulation.

Tolerances come from e4m3's precision. With u = 2^-4 (half the spacing of e4m3's 3 mantissa bits,
relative) and subnormal spacing 2^-9, a value v of a row with scale s dequantises within
u·|v| + s·2^-10. A product of two such values errs by at most (2u + u²)·|a||b| plus the subnormal terms,
so C = A·Bᵀ errs elementwise by at most

    (2u + u²)·(|A|·|B|ᵀ) + (1 + u)·(Σ|a_m|·ε_b,n + ε_a,m·Σ|b_n|) + K·ε_a,m·ε_b,n     (ε = s·2^-10)

before the bf16 output rounding (2^-8 relative). That worst case is loose, so each GEMM also has to land
in e4m3's statistical band: a uniform relative rounding error of ±u has RMS u/√3 ≈ 0.036 at the top of a
binade and ≈ 0.025 over Gaussian data (measured 0.025–0.026 per operand, 0.036 for the product of two);
the tests accept a relative Frobenius error in [0.01, 0.05] — e5m2 operands (measured 0.05 each, ≈ 0.07
for the product) or no quantisation (bf16: < 0.005) fall outside it.
"""

from __future__ import annotations

import pytest
import torch

from costmodel.catalog import get_model
from executor.data import global_batch, micro_batches
from executor.kernels import fp8, get_backend
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.profile import DTYPES, options_for_precision
from executor.train_step import Trainer

U = 2.0**-4
SUBNORMAL_HALF_SPACING = 2.0**-10
BF16_ROUNDING = 2.0**-8
BAND = (0.01, 0.05)


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The elementwise worst-case |fp8(a)·fp8(b)ᵀ − a·bᵀ| of rowwise-quantised a [M, K] and b [N, K], plus
    bf16 output rounding and fp32 summation slack (module docstring)."""
    a, b = a.double().abs(), b.double().abs()
    eps_a = a.amax(1) / fp8.E4M3_MAX * SUBNORMAL_HALF_SPACING
    eps_b = b.amax(1) / fp8.E4M3_MAX * SUBNORMAL_HALF_SPACING
    mag = a @ b.t()
    quant = ((2 * U + U * U) * mag + (1 + U) * (a.sum(1)[:, None] * eps_b[None, :] + eps_a[:, None] * b.sum(1)[None, :])
             + a.shape[1] * eps_a[:, None] * eps_b[None, :])
    return quant + BF16_ROUNDING * (mag + quant) + 1e-6 * mag


def _check_gemm(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` ≈ a·bᵀ within the worst-case bound and inside e4m3's statistical band."""
    ref = a.double() @ b.double().t()
    err = (got.double() - ref).abs()
    assert bool((err <= _bound(a, b)).all()), float((err - _bound(a, b)).max())
    if ref.numel() >= 256:  # enough elements for the RMS to mean something
        rel = float((got.double() - ref).norm() / ref.norm())
        assert BAND[0] <= rel <= BAND[1], rel


def _gaussian(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- quantisation ----

def test_rowwise_scale_is_amax_over_448_and_round_trip_stays_within_e4m3_precision():
    x = _gaussian(6, 64, dtype=torch.float32)
    x[1] *= 1e4  # a large row: scales are per row, so it does not crush the others
    x[2] *= 1e-4
    x[3] = 0.0  # all zeros: scale 1, not 0/0
    x[4, :8] = torch.tensor([1e-9, -1e-9, 0, 0, 0, 0, 0, 0])  # far below the row's subnormal range: flush to 0
    q, scale = fp8.quantize_rowwise(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    amax = x.abs().amax(1)
    expected = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert scale.dtype == torch.float32 and torch.equal(scale, expected)
    assert torch.equal(q[3].float(), torch.zeros(64))
    live = amax > 0
    assert torch.equal(q.float().abs().amax(1)[live], torch.full((5,), 448.0))  # the row max maps to 448
    back = fp8.dequantize(q, scale)
    assert bool(((back - x).abs() <= U * x.abs() * (1 + 1e-6) + scale[:, None] * SUBNORMAL_HALF_SPACING).all())
    assert torch.equal(back[4, :2], torch.zeros(2))


def test_rows_of_tiny_values_keep_a_finite_reciprocal_scale():
    """amax/448 below fp32's normal range would make 1/scale infinite and a zero in the row 0·∞ = NaN."""
    x = torch.full((2, 32), 1e-38)
    x[:, 1] = 0.0
    x[1, 0] = 1e-30
    q, scale = fp8.quantize_rowwise(x)
    assert not bool(torch.isnan(q.float()).any()) and bool((scale >= torch.finfo(torch.float32).tiny).all())
    assert torch.equal(q[:, 1].float(), torch.zeros(2))


def test_rows_made_of_e4m3_values_quantise_losslessly_so_the_gemm_is_exact():
    """A row whose values are e4m3 numbers times 2^k with max 448·2^k has scale 2^k: nothing is lost, and
    the emulated GEMM equals the fp32 product rounded to bf16."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 126, (24, 32), generator=gen, dtype=torch.uint8)  # finite positive e4m3 codes
    values = codes.view(torch.float8_e4m3fn).float() * (torch.randint(0, 2, (24, 32), generator=gen) * 2 - 1)
    values[:, 0] = 448.0
    values = values * 2.0 ** torch.arange(-6, 18)[:, None].float()
    a, b = values[:16], values[16:]
    q, scale = fp8.quantize_rowwise(a)
    assert torch.equal(fp8.dequantize(q, scale), a)
    assert torch.equal(fp8.scaled_mm_nt(a, b, kernel=False), (a @ b.t()).to(torch.bfloat16))


# ---- dense linear ----

@pytest.mark.parametrize("m", [48, 37])  # 37 tokens: the wgrad contraction is no multiple of 16
def test_fp8_linear_forward_and_backward_match_fp32_within_e4m3_bounds(m):
    x = _gaussian(m, 64, seed=2).requires_grad_()
    w = _gaussian(48, 64, seed=3).requires_grad_()
    dy = _gaussian(m, 48, seed=4)
    y = fp8.linear(x.view(m, 1, 64), w)
    assert y.shape == (m, 1, 48) and y.dtype == torch.bfloat16
    y.backward(dy.view(m, 1, 48))
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    _check_gemm(y.detach().view(m, 48), xf, wf)
    _check_gemm(x.grad, dyf, wf.t())  # dgrad: dy·w, w quantised per column
    _check_gemm(w.grad, dyf.t(), xf.t())  # wgrad: dyᵀ·x, both quantised along the tokens
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_torch_backend_linear_is_f_linear_bit_for_bit():
    x, w = _gaussian(5, 3, 64), _gaussian(32, 64, seed=1)
    assert torch.equal(get_backend("torch").linear(x, w), torch.nn.functional.linear(x, w))


# ---- grouped (experts) ----

COUNTS = [5, 0, 21, 16, 0, 3]  # empty groups, a group of one 16-row block, groups of no multiple of 16


def _groups(counts):
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    bounds = [0, *offs.tolist()]
    return offs, list(zip(bounds, bounds[1:]))


def test_padded_groups_hand_worked():
    """counts 5, 0, 67 → 16, 16 and the rest of 16·⌈72/16⌉ + 16·3 = 128 rows; rows keep their order."""
    layout = fp8.padded_groups(torch.tensor([5, 5, 72], dtype=torch.int32), 72)
    assert layout.rows == 128 and layout.offs_G.tolist() == [16, 32, 128]
    assert layout.dest_M.tolist() == [0, 1, 2, 3, 4, *range(32, 99)]
    assert layout.group_of_block.tolist() == [0, 1] + [2] * 6


def test_fp8_grouped_gemm_forward_dgrad_wgrad_match_fp32_per_group():
    offs, spans = _groups(COUNTS)
    m, g, n, k = sum(COUNTS), len(COUNTS), 48, 64
    x = _gaussian(m, k, seed=5).requires_grad_()
    w = _gaussian(g, n, k, seed=6).requires_grad_()
    dy = _gaussian(m, n, seed=7)
    y = get_backend("torch-fp8").grouped_mm(x, w, offs)
    y.backward(dy)
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    for group, (lo, hi) in enumerate(spans):
        if hi > lo:
            _check_gemm(y.detach()[lo:hi], xf[lo:hi], wf[group])
            _check_gemm(x.grad[lo:hi], dyf[lo:hi], wf[group].t())
            _check_gemm(w.grad[group], dyf[lo:hi].t(), xf[lo:hi].t())
        else:
            assert torch.equal(w.grad[group], torch.zeros(n, k, dtype=torch.bfloat16))
    ref = torch.cat([xf[lo:hi].double() @ wf[i].double().t() for i, (lo, hi) in enumerate(spans)])
    rel = float((y.detach().double() - ref).norm() / ref.norm())  # the band over all groups together
    assert BAND[0] <= rel <= BAND[1], rel


def test_bf16_wgrad_option_gives_the_unquantised_weight_gradient(monkeypatch):
    offs, spans = _groups(COUNTS)
    x = _gaussian(sum(COUNTS), 32, seed=8).requires_grad_()
    w = _gaussian(len(COUNTS), 16, 32, seed=9).requires_grad_()
    dy = _gaussian(sum(COUNTS), 16, seed=10)
    monkeypatch.setenv("FOLDTUNE_FP8_WGRAD", "bf16")
    fp8.grouped_mm(x, w, offs).backward(dy)
    want = torch._grouped_mm(dy.t(), x.detach(), offs=offs)
    assert torch.equal(w.grad, want)


def test_cpu_gemms_say_they_are_emulated():
    before = fp8.gemm_counts().get("emulated", 0)
    fp8.linear(_gaussian(4, 16), _gaussian(16, 16))
    assert fp8.gemm_counts()["emulated"] == before + 1
    assert fp8.emulation_reason("cpu") == "no fp8 GEMM kernels on cpu"


# ---- selection and a training step ----

def test_precision_fp8_selects_the_fp8_backend_with_bf16_parameters():
    assert DTYPES["fp8"] == torch.bfloat16
    assert options_for_precision(ExecutorOptions(), "fp8").kernel_backend == "torch-fp8"
    assert options_for_precision(ExecutorOptions(), "bf16").kernel_backend == "torch"


def _two_steps(backend: str) -> list[float]:
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    model = MoEGPT(spec, single_process_state(), ExecutorOptions(kernel_backend=backend), 32, dtype=torch.bfloat16)
    assert model.kernels.name == backend
    trainer = Trainer(model, lr=1e-2)
    losses = []
    for _ in range(2):
        batch = global_batch(spec.vocab_size, 32, 4, 1234, 0)  # the same batch: its loss must fall
        losses.append(trainer.step(micro_batches(batch, 1, 0, 2, "cpu")).loss)
    return losses


def test_tiny_moe_training_steps_in_fp8_track_bf16():
    """Two Adam steps of tiny-moe (lr 1e-2) on one batch: the fp8 losses stay within 0.2% of bf16's
    (measured 0.01%), are not bf16's (the GEMMs did quantise), and fall."""
    before = fp8.gemm_counts().get("emulated", 0)
    fp8_losses = _two_steps("torch-fp8")
    # per micro-batch and step: 4 linears + 2 grouped GEMMs per layer forward, 2 GEMMs each backward
    assert fp8.gemm_counts()["emulated"] - before == 2 * 2 * 2 * (4 + 2) * 3
    bf16_losses = _two_steps("torch")
    assert fp8_losses != bf16_losses
    for got, want in zip(fp8_losses, bf16_losses):
        assert got == pytest.approx(want, rel=2e-3)
    assert fp8_losses[1] < fp8_losses[0]  # it trains


def test_bench_smoke_mode_runs_on_cpu(tmp_path):
    """bench/fp8_check.py --device cpu --tiny: emulated GEMMs land in the e4m3 band, every speed variant runs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fp8.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "fp8_check.py"
    subprocess.run([sys.executable, str(bench), "--device", "cpu", "--tiny", "--parts", "agree,speed", "--iters", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["agree"]["kernels"] is False
    for name in ("grouped_fwd", "grouped_dgrad", "grouped_wgrad", "linear_fwd", "linear_dgrad", "linear_wgrad"):
        assert BAND[0] <= res["agree"][name]["emulated_rel_err_vs_fp32"] <= BAND[1]
    assert all(res["speed"][v]["ffn_fwd_bwd_s"] > 0 for v in ("bf16", "fp8", "fp8_bf16_wgrad"))
