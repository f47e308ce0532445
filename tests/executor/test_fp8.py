"""FP8 GEMMs with rowwise current scaling (executor/kernels/fp8/), on CPU through the emulation.

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

import contextlib

import pytest
import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor.data import global_batch, micro_batches
from executor.kernels import first_use, fp8, get_backend
from executor.kernels.fp8 import gemm, quantize, weight_cache
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.profile import DTYPES, options_for_precision
from executor.train_step import Trainer
from tests.executor.triton_child import inner_only

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
    """scale = amax · fp32(1/448) (one rounding, the same on CPU, CUDA and in Triton: within an ulp of
    amax/448); q · scale recovers x within e4m3's precision."""
    x = _gaussian(6, 64, dtype=torch.float32)
    x[1] *= 1e4  # a large row: scales are per row, so it does not crush the others
    x[2] *= 1e-4
    x[3] = 0.0  # all zeros: scale 1, not 0/0
    x[4, :8] = torch.tensor([1e-9, -1e-9, 0, 0, 0, 0, 0, 0])  # far below the row's subnormal range: flush to 0
    q, scale = fp8.quantize_rowwise(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    amax = x.abs().amax(1)
    expected = torch.where(amax > 0, amax * torch.tensor(1 / 448, dtype=torch.float32), torch.ones_like(amax))
    assert scale.dtype == torch.float32 and torch.equal(scale, expected)
    assert torch.allclose(scale, torch.where(amax > 0, amax / 448, 1.0), rtol=2**-23, atol=0)
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


def test_fp8_grouped_gemm_forward_dgrad_wgrad_match_fp32_per_group(monkeypatch):
    monkeypatch.setenv("FOLDTUNE_FP8_WGRAD", "fp8")  # the wgrad in fp8 too (opt-in)
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


@pytest.mark.parametrize("setting", [None, "bf16", "fp8"])
def test_expert_wgrad_is_bf16_unless_fp8_is_asked(monkeypatch, setting):
    """By default (and with FOLDTUNE_FP8_WGRAD=bf16) the expert weight gradient is the unquantised bf16
    grouped GEMM, bit for bit; with FOLDTUNE_FP8_WGRAD=fp8 it is quantised (not bf16's)."""
    offs, spans = _groups(COUNTS)
    x = _gaussian(sum(COUNTS), 32, seed=8).requires_grad_()
    w = _gaussian(len(COUNTS), 16, 32, seed=9).requires_grad_()
    dy = _gaussian(sum(COUNTS), 16, seed=10)
    if setting is None:
        monkeypatch.delenv("FOLDTUNE_FP8_WGRAD", raising=False)
    else:
        monkeypatch.setenv("FOLDTUNE_FP8_WGRAD", setting)
    fp8.grouped_mm(x, w, offs).backward(dy)
    want = torch._grouped_mm(dy.t(), x.detach(), offs=offs)
    assert torch.equal(w.grad, want) == (setting != "fp8")


def test_cpu_gemms_say_they_are_emulated():
    before = fp8.gemm_counts().get("emulated", 0)
    fp8.linear(_gaussian(4, 16), _gaussian(16, 16))
    assert fp8.gemm_counts()["emulated"] == before + 1
    assert fp8.emulation_reason("cpu") == "no fp8 GEMM kernels on cpu"


def test_kernels_off_by_environment_after_first_use_are_off(monkeypatch):
    # an sm90 device whose self-check passed: the kernels run until FOLDTUNE_FP8_KERNELS=0 is set, and
    # from then on both the GEMMs and the reported reason say emulated (no cached verdict outlives it)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(gemm, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", getattr(torch, "_scaled_grouped_mm", None), raising=False)
    monkeypatch.setitem(gemm._CHECKED, (str(gpu),), True)
    monkeypatch.delenv("FOLDTUNE_FP8_KERNELS", raising=False)
    assert fp8.kernels_ok(gpu) and fp8.emulation_reason(gpu) is None
    monkeypatch.setenv("FOLDTUNE_FP8_KERNELS", "0")
    assert not fp8.kernels_ok(gpu) and fp8.emulation_reason(gpu) == "FOLDTUNE_FP8_KERNELS=0"


# ---- selection and a training step ----

def test_precision_fp8_selects_the_fp8_backend_with_bf16_parameters():
    assert DTYPES["fp8"] == torch.bfloat16
    assert options_for_precision(ExecutorOptions(), "fp8").kernel_backend == "torch-fp8"
    assert options_for_precision(ExecutorOptions(), "bf16").kernel_backend == "torch"


def _two_steps(backend: str, recompute: str = "none") -> list[float]:
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    state = single_process_state(ParallelConfig(world_size=1, recompute_granularity=recompute))
    model = MoEGPT(spec, state, ExecutorOptions(kernel_backend=backend), 32, dtype=torch.bfloat16)
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
    # per micro-batch and step: 4 linears + 2 grouped GEMMs per layer forward; backward 2 GEMMs per linear,
    # 1 per grouped GEMM (its wgrad is bf16 by default)
    assert fp8.gemm_counts()["emulated"] - before == 2 * 2 * 2 * (4 * 3 + 2 * 2)
    bf16_losses = _two_steps("torch")
    assert fp8_losses != bf16_losses
    for got, want in zip(fp8_losses, bf16_losses):
        assert got == pytest.approx(want, rel=2e-3)
    assert fp8_losses[1] < fp8_losses[0]  # it trains


@pytest.mark.slow  # a child process of the bench script
def test_bench_smoke_mode_runs_on_cpu(tmp_path):
    """python -m bench.fp8_check --device cpu --tiny: emulated GEMMs land in the e4m3 band, every speed variant
    runs (from the repository root, as the bench drivers are run)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fp8.json"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "bench.fp8_check", "--device", "cpu", "--tiny", "--parts", "agree,speed",
                    "--iters", "1", "--out", str(out)], check=True, capture_output=True, timeout=120, cwd=root)
    res = json.loads(out.read_text())
    assert res["agree"]["kernels"] is False
    for name in ("grouped_fwd", "grouped_dgrad", "grouped_wgrad", "linear_fwd", "linear_dgrad", "linear_wgrad"):
        assert BAND[0] <= res["agree"][name]["emulated_rel_err_vs_fp32"] <= BAND[1]
    assert all(res["speed"][v]["ffn_fwd_bwd_s"] > 0
               for v in ("bf16", "fp8_torch_quant", "fp8_uncached", "fp8", "fp8_fp8_wgrad"))


# ---- the weight cache ----

@pytest.fixture
def cached(monkeypatch):
    """The weight cache on (whatever the environment says), empty; returns a counter reader."""
    monkeypatch.delenv("FOLDTUNE_FP8_WEIGHT_CACHE", raising=False)
    fp8.clear_weight_cache()
    start = fp8.weight_counts()

    def since():
        now = fp8.weight_counts()
        return {k: now.get(k, 0) - start.get(k, 0) for k in ("quantised", "reused", "uncached")}

    yield since
    fp8.clear_weight_cache()


def _linear_step(x, w, dy):
    x = x.detach().requires_grad_()
    y = fp8.linear(x, w)
    y.backward(dy)
    return y.detach(), x.grad


def test_an_unchanged_weight_is_quantised_once_for_forward_and_once_for_dgrad(cached):
    """The forward makes both forms at once (the dgrad's is then served from the cache)."""
    w = torch.nn.Parameter(_gaussian(48, 64, seed=11))
    x, dy = _gaussian(16, 64, seed=12), _gaussian(16, 48, seed=13)
    both = fp8.weight_counts().get("both_at_once", 0)
    first = _linear_step(x, w, dy)
    assert cached() == {"quantised": 2, "reused": 1, "uncached": 0}
    assert fp8.weight_counts()["both_at_once"] == both + 1
    second = _linear_step(x, w, dy)
    assert cached() == {"quantised": 2, "reused": 3, "uncached": 0}
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def _uncached_linear_step(x, w, dy, monkeypatch):
    monkeypatch.setenv("FOLDTUNE_FP8_WEIGHT_CACHE", "0")
    try:
        return _linear_step(x, w, dy)
    finally:
        monkeypatch.delenv("FOLDTUNE_FP8_WEIGHT_CACHE")


@pytest.mark.parametrize("update", ["in_place", "optimizer", "load", "data_swap"])
def test_a_changed_weight_is_quantised_afresh(cached, monkeypatch, update):
    """After an in-place update (by hand, by torch's foreach Adam, by a state-dict load) or a ``.data``
    swap, the next call quantises again and equals the uncached path bit for bit."""
    w = torch.nn.Parameter(_gaussian(48, 64, seed=14))
    x, dy = _gaussian(16, 64, seed=15), _gaussian(16, 48, seed=16)
    _linear_step(x, w, dy)
    new = _gaussian(48, 64, seed=17)
    if update == "in_place":
        with torch.no_grad():
            w.mul_(0.5)
    elif update == "optimizer":
        w.grad = new
        torch.optim.Adam([w], lr=0.1, foreach=True).step()
    elif update == "load":
        holder = torch.nn.Linear(64, 48, bias=False)
        holder.weight = w
        holder.load_state_dict({"weight": new})
    else:
        w.data = new
    got = _linear_step(x, w, dy)
    assert cached() == {"quantised": 4, "reused": 2, "uncached": 0}
    want = _uncached_linear_step(x, w, dy, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_expert_weights_through_a_view_hit_the_cache_and_die_with_the_parameter(cached):
    """The MoE layer passes ``w13.flatten(1, 2)``, a new view every call: the cache keys on the parameter."""
    offs, _ = _groups(COUNTS)
    w13 = torch.nn.Parameter(_gaussian(len(COUNTS), 2, 8, 32, seed=18))
    x, dy = _gaussian(sum(COUNTS), 32, seed=19).requires_grad_(), _gaussian(sum(COUNTS), 16, seed=20)
    for _ in range(3):
        fp8.grouped_mm(x, w13.flatten(1, 2), offs).backward(dy)
    assert cached() == {"quantised": 2, "reused": 5, "uncached": 0}
    assert len(weight_cache._WEIGHT_CACHE) == 1
    del w13
    assert len(weight_cache._WEIGHT_CACHE) == 0


def test_weights_whose_version_counter_misses_writes_are_not_cached(cached):
    """A parameter made a view of a larger buffer, and one that an overlapped parameter all-gather writes
    (executor.optimizer registers those in executor.kernels.aliasing), is quantised on every call."""
    from executor.kernels.aliasing import register_written_through_buffer

    class Owner:  # stands in for the optimizer: the registration lives as long as it does
        pass

    x, dy = _gaussian(16, 64, seed=21), _gaussian(16, 32, seed=22)
    flat = torch.zeros(2 * 32 * 64, dtype=torch.bfloat16)
    in_buffer = torch.nn.Parameter(_gaussian(32, 64, seed=23))
    in_buffer.data = flat[:32 * 64].view(32, 64)
    gathered = torch.nn.Parameter(_gaussian(32, 64, seed=24))

    # what the optimizer registers for a parameter its overlapped all-gather writes (tests/executor/
    # test_param_gather.py checks the registration against a real overlapped optimizer)
    owner = Owner()
    register_written_through_buffer(owner, [gathered])
    _linear_step(x, in_buffer, dy)
    _linear_step(x, gathered, dy)
    assert cached() == {"quantised": 0, "reused": 0, "uncached": 4}
    register_written_through_buffer(owner, [])


def test_training_with_the_cache_equals_training_without_it(cached, monkeypatch):
    """Two Adam steps of two micro-batches each (MixedPrecisionAdam writes the weights back in place):
    the same losses bit for bit with and without the cache, and each weight form is made once per step."""
    with_cache = _two_steps("torch-fp8")
    counts = cached()
    monkeypatch.setenv("FOLDTUNE_FP8_WEIGHT_CACHE", "0")
    assert _two_steps("torch-fp8") == with_cache
    spec = get_model("tiny-moe")
    forms = spec.num_layers * (4 + 2) * 2  # forward and dgrad forms of 4 linears and 2 expert GEMMs a layer
    steps, micro = 2, 2
    # the first forward of a step makes both forms of a weight, its backward reuses the dgrad form
    assert counts == {"quantised": steps * forms, "reused": steps * (forms // 2 + (micro - 1) * forms),
                      "uncached": 0}



@pytest.mark.slow
def test_full_recompute_quantises_each_weight_form_once_a_step_too(cached):
    """Under activation checkpointing the backward's saved tensors come back as new tensor objects: the weight
    forms must still come from the cache (the weight rides on the autograd context, not in its saved tensors),
    so a step quantises each form once as without recompute — and trains the same."""
    plain = _two_steps("torch-fp8")
    cached()  # reset the baseline
    start = cached()
    recomputed = _two_steps("torch-fp8", recompute="full")
    counts = {k: v - start[k] for k, v in cached().items()}
    spec = get_model("tiny-moe")
    forms = spec.num_layers * (4 + 2) * 2
    assert counts["quantised"] == 2 * forms and counts["uncached"] == 0
    assert recomputed == plain


def test_the_trainer_frees_the_weight_cache_before_the_optimizer_step(cached, monkeypatch):
    """When Adam runs, no fp8 weight form is held (they would be stale a moment later); the next step
    makes them again."""
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    model = MoEGPT(spec, single_process_state(), ExecutorOptions(kernel_backend="torch-fp8"), 32,
                   dtype=torch.bfloat16)
    trainer = Trainer(model, lr=1e-2)
    held = []
    real_step = trainer.optimizer.step

    def step():
        held.append(sum(len(e.forms) for e in weight_cache._WEIGHT_CACHE.values()))
        return real_step()

    monkeypatch.setattr(trainer.optimizer, "step", step)
    for i in range(2):
        trainer.step(micro_batches(global_batch(spec.vocab_size, 32, 2, 1234, i), 1, 0, 1, "cpu"))
    assert held == [0, 0]
    forms = spec.num_layers * (4 + 2) * 2
    assert cached()["quantised"] == 2 * forms


def test_quantize_both_is_the_two_rowwise_quantisations():
    """Both forms (rows of x, rows of xᵀ) equal quantize_rowwise of x and of its transpose, 2-D and 3-D."""
    for x in (_gaussian(37, 80, seed=30), _gaussian(3, 20, 48, seed=31)):
        (q, s), (qt, st) = quantize.quantize_both(x)
        for got, want in (((q, s), quantize.quantize_rowwise(x)),
                          ((qt, st), quantize.quantize_rowwise(x.transpose(-2, -1)))):
            quantize._compare_quantised("both", got, want)
        assert qt.is_contiguous() and qt.shape == x.transpose(-2, -1).shape


def test_fp8_linear_saves_the_transposed_fp8_input_not_the_bf16_one():
    """With a weight gradient to make, the layer keeps xᵀ in e4m3 (1 byte an element) for the wgrad, and
    the gradients equal those of quantising x and dy separately (the code before both-forms)."""
    w = torch.nn.Parameter(_gaussian(48, 64, seed=32))
    x = _gaussian(16, 64, seed=33).requires_grad_()
    dy = _gaussian(16, 48, seed=34)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8.linear(x, w)
    assert not any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in saved)
    assert any(t.dtype == fp8.E4M3 and t.shape == (64, 16) for t in saved)
    y.backward(dy)
    qw, qwt = quantize.quantize_rowwise(w.detach()), quantize.quantize_rowwise(w.detach().t())
    deq = quantize.dequantize
    want_y = (deq(*quantize.quantize_rowwise(x.detach())) @ deq(*qw).t()).to(torch.bfloat16)
    want_dx = (deq(*quantize.quantize_rowwise(dy)) @ deq(*qwt).t()).to(torch.bfloat16)
    want_dw = (deq(*quantize.quantize_rowwise(dy.t())) @ deq(*quantize.quantize_rowwise(x.detach().t())).t())
    assert torch.equal(y.detach(), want_y)
    assert torch.equal(x.grad, want_dx)
    assert torch.equal(w.grad, want_dw.to(torch.bfloat16))


def test_fast_accumulation_is_opt_in_and_only_on_the_kernels(monkeypatch):
    """FOLDTUNE_FP8_FAST_ACCUM=1 asks for it; on CPU (no kernels) it stays off, unset it is off."""
    monkeypatch.delenv("FOLDTUNE_FP8_FAST_ACCUM", raising=False)
    assert not gemm.fast_accum_ok(torch.device("cpu"))
    monkeypatch.setenv("FOLDTUNE_FP8_FAST_ACCUM", "1")
    assert not gemm.fast_accum_ok(torch.device("cpu"))


def test_fast_accumulation_check_passes_on_the_emulation_and_fails_on_a_wrong_result(monkeypatch):
    """The first-use check compares the fast-accumulation forward GEMMs with the emulation: with the kernels
    stood in by the emulation it passes; a result off by 1 % fails it."""
    real_mm, real_grouped = gemm.scaled_mm_nt, gemm.scaled_grouped_nt

    def emulated_mm(a, b, kernel, *args, **kw):
        return real_mm(a, b, False, *args, **{k: v for k, v in kw.items() if k != "fast_accum"})

    def emulated_grouped(a, b, offs, kernel, *args, **kw):
        return real_grouped(a, b, offs, False, *args, **{k: v for k, v in kw.items() if k != "fast_accum"})

    monkeypatch.setattr(gemm, "scaled_mm_nt", emulated_mm)
    monkeypatch.setattr(gemm, "scaled_grouped_nt", emulated_grouped)
    gemm._check_fast_accum("fast_accum", "cpu")

    def off(a, b, offs, kernel, *args, **kw):
        out = emulated_grouped(a, b, offs, kernel, *args, **kw)
        return out * 1.01 if kw.get("fast_accum") else out

    monkeypatch.setattr(gemm, "scaled_grouped_nt", off)
    with pytest.raises(AssertionError):
        gemm._check_fast_accum("fast_accum", "cpu")

def test_hardware_rounding_is_off_on_cpu_and_where_its_check_fails(monkeypatch):
    """The GPU's e4m3 conversion is used only on CUDA, with FOLDTUNE_FP8_HW_CAST not 0, after its first-use
    check passed: a failing check leaves the integer rounding on (with a warning), and asks only once."""
    assert not quantize._hw_cast(torch.device("cpu"))
    calls = []

    def differs(*key):
        calls.append(key)
        raise AssertionError("Triton e4m3 bytes differ from torch's (fp32 values)")

    monkeypatch.setattr(quantize, "_check_hw_cast", differs)
    monkeypatch.setattr(quantize, "_CHECKED", {})
    # the real checked_once, whose check thread would enter the CUDA device this machine lacks
    monkeypatch.setattr(first_use.torch.cuda, "device", lambda _device: contextlib.nullcontext())
    gpu = torch.device("cuda", 0)  # a key only: the patched check touches no device
    with pytest.warns(UserWarning, match="hardware e4m3 conversion off"):
        assert not quantize._hw_cast(gpu)
    assert not quantize._hw_cast(gpu) and calls == [("hw_cast", "cuda:0")]
    monkeypatch.setattr(quantize, "_CHECKED", {("hw_cast", "cuda:0"): True})
    assert quantize._hw_cast(gpu)
    monkeypatch.setenv("FOLDTUNE_FP8_HW_CAST", "0")
    assert not quantize._hw_cast(gpu)


# ---- the Triton quantisation, in Triton's interpreter ----

def test_triton_quantisation_in_interpreter(triton_interpreter):
    """The Triton kernels below run in a child pytest with TRITON_INTERPRET=1 (Triton reads it at import)."""
    triton_interpreter.check(__file__, expected=9)


@inner_only
def test_triton_e4m3_rounding_is_torchs_on_every_kind_of_fp32():
    """Random fp32 bit patterns (every exponent, both signs, NaNs) and the edge cases: the kernel's bytes are
    torch's cast's."""
    bits = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=torch.Generator().manual_seed(0))
    edges = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e30, float("inf"), float("nan"), 2.0**-6,
                          2.0**-6 * 0.999, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-11, 2.0**-7, 1e-45, 0.0])
    v = torch.cat([bits.to(torch.int32).view(torch.float32), edges, -edges])
    q = torch.empty(1, 1, v.numel(), dtype=torch.float8_e4m3fn)
    quantize._launch_cast(q, v.view(1, 1, -1), torch.ones(1, 1), (1, 1, 0))
    assert torch.equal(q.view(torch.uint8).flatten(), v.to(torch.float8_e4m3fn).view(torch.uint8))


@inner_only
def test_triton_quantisation_passes_its_self_checks():
    """Rowwise (3-D, 2-D, through a transposed view, the bf16 ladder) and per-expert column scaling with
    empty and short groups, in two passes; rowwise in one kernel (rows longer than its chunk too): scales
    and bytes equal the torch path's."""
    quantize._check_triton_quantise("quantise", "cpu")
    quantize._check_fused_rows("rows", "cpu")
    x = _gaussian(5, 3000, seed=25)  # rows of six chunks and a partial one; held whole, 4096 lanes, 1096 masked
    for whole in (True, False):
        quantize._compare_quantised(f"long rows, whole {whole}", quantize._quantize_rows_fused(x, whole=whole),
                                    quantize._quantize_rowwise_torch(x))


@inner_only
def test_triton_rounding_check_passes_the_integer_rounding():
    """The hardware-conversion check's cases (fp32 values as amax scaling makes them, subnormals and
    rounding boundaries among them) and its comparisons, run with the integer rounding: equal to torch's cast.
    (The GPU's conversion itself is checked on the GPU, at first use.)"""
    quantize._check_rounding(False, "cpu", values=4096)
    assert getattr(quantize._CAST_MODE, "hw", None) is None  # the forcing ends with the check


@inner_only
def test_triton_rowwise_quantisation_matches_the_public_function():
    """quantize_rowwise's dispatch: the fused kernel for row-contiguous operands, two passes for a
    transposed one; both equal the torch path."""
    w = _gaussian(3, 48, 64, seed=26)
    for t in (w, w.transpose(-2, -1), w[1]):
        quantize._compare_quantised("dispatch", quantize._quantize_rowwise_triton(t),
                                    quantize._quantize_rowwise_torch(t))


@inner_only
@pytest.mark.parametrize("path,check", [("_quantize_rowwise_two_pass", "_check_triton_quantise"),
                                        ("_quantize_rows_fused", "_check_fused_rows")])
def test_triton_self_checks_fail_on_a_wrong_byte(monkeypatch, path, check):
    real = getattr(quantize, path)  # the name the check reads

    def off_by_one(x, **kwargs):
        q, scale = real(x, **kwargs)
        q.view(torch.uint8).view(-1)[7] ^= 1
        return q, scale

    monkeypatch.setattr(quantize, path, off_by_one)
    with pytest.raises(AssertionError, match="bytes differ"):
        getattr(quantize, check)("quantise", "cpu")



@inner_only
def test_triton_both_forms_pass_their_self_check_and_match_torch():
    """Row and column amaxes in one read, both casts in another: the bf16 ladder, mixed rows with partial
    tiles and zero rows and columns, 2-D and 3-D; scales and bytes equal the torch path's for both forms."""
    quantize._check_both("both", "cpu")
    for x in (_gaussian(130, 200, seed=35), _gaussian(2, 65, 64, seed=36)):
        (q, s), (qt, st) = quantize._quantize_both_triton(x)
        (q_ref, s_ref), (qt_ref, st_ref) = quantize._quantize_both_torch(x)
        quantize._compare_quantised("rows", (q, s), (q_ref, s_ref))
        quantize._compare_quantised("transposed", (qt, st), (qt_ref, st_ref))


@inner_only
def test_triton_both_forms_check_fails_on_a_wrong_transposed_byte(monkeypatch):
    real = quantize._quantize_both_triton

    def off_by_one(x):
        rows, (qt, st) = real(x)
        qt.view(torch.uint8).view(-1)[11] ^= 1
        return rows, (qt, st)

    monkeypatch.setattr(quantize, "_quantize_both_triton", off_by_one)
    with pytest.raises(AssertionError, match="bytes differ"):
        quantize._check_both("both", "cpu")


def _adam_steps_through_fp8(steps: int = 3, micro: int = 2) -> tuple[list[float], list[torch.Tensor]]:
    """``steps`` Adam steps (lr 1e-2, ``micro`` micro-batches each) of an expert grouped GEMM (an empty
    expert among four) feeding a dense fp8 linear: accumulate, then step in place — without the trainer's
    clear_weight_cache, so that only the cache's version keying keeps the weights fresh. Returns the
    micro-batch losses and the final weights."""
    torch.manual_seed(3)
    w_experts = torch.nn.Parameter(torch.randn(4, 48, 64).to(torch.bfloat16) * 0.1)
    w_dense = torch.nn.Parameter(torch.randn(32, 48).to(torch.bfloat16) * 0.1)
    opt = torch.optim.Adam([w_experts, w_dense], lr=1e-2)
    offs = torch.tensor([10, 10, 50, 70], dtype=torch.int32)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for i in range(micro):
            x = _gaussian(70, 64, seed=100 + step * micro + i).requires_grad_()
            loss = fp8.linear(fp8.grouped_mm(x, w_experts, offs), w_dense).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses, [w_experts.detach().clone(), w_dense.detach().clone()]


@inner_only
def test_triton_quantisation_trains_exactly_as_the_torch_path_across_optimizer_steps(cached, monkeypatch):
    """The GPU path's quantisation (one-kernel rows, both forms at once, column amax, per-expert wgrad
    scaling) in the interpreter, through forward, dgrad and wgrad of the expert and dense GEMMs over three
    Adam steps with the weight cache on: losses and updated weights equal the torch path's bit for bit, and
    each weight is quantised afresh once per step (a stale cached weight would change the losses)."""
    torch_run = _adam_steps_through_fp8()
    before = fp8.weight_counts().get("both_at_once", 0)
    monkeypatch.setattr(quantize, "_use_triton", lambda device: True)
    triton_run = _adam_steps_through_fp8()
    assert triton_run[0] == torch_run[0]
    assert all(torch.equal(a, b) for a, b in zip(triton_run[1], torch_run[1]))
    assert fp8.weight_counts()["both_at_once"] - before == 3 * 2  # 3 steps, 2 weights: fresh every step
    assert len(set(torch_run[0])) == len(torch_run[0]) and torch_run[0][-1] < torch_run[0][0]  # it trains
