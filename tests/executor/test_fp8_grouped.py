"""foldtune's grouped fp8 GEMM (executor/kernels/fp8/grouped_gemm.py) and its quantisation
(grouped_quant.py): the Triton kernels in Triton's CPU interpreter (the tests marked ``inner_only``, run by
``test_grouped_kernels_in_triton_interpreter``), the CPU emulation and the executor option in this process.

What each product must equal:
- the Triton kernel, the emulation (the same dequantised operands multiplied in fp32) within bf16 rounding
  and fp32 summation order (2^-7 relative, as the torch kernels' first-use check);
- the emulation, the float64 product of the dequantised operands within the bf16 output rounding (2^-8
  relative) and fp32 summation slack: the GEMM itself adds nothing but rounding;
- the product of the bf16 operands before quantisation, inside e4m3's statistical band (a relative
  Frobenius error in [0.01, 0.05], tests/executor/test_fp8.py's module docstring): the quantisation is
  e4m3's, no coarser (e5m2 or a wrong scale) and not skipped (bf16: < 0.005).
Experts of 0, 1 and odd token counts, first and last experts empty, all in both scalings.
"""

from __future__ import annotations

import functools

import pytest
import torch

from executor.kernels import fp8 as fp8_pkg, get_backend
from executor.kernels.fp8 import grouped_gemm as gg, grouped_quant as gq
from executor.kernels.fp8.quantize import INV_E4M3_MAX
from executor.data import global_batch, micro_batches
from executor.model import MoEGPT
from executor.moe import GroupedExperts
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.errors import SpecError
from tests.executor.triton_child import inner_only

BAND = (0.01, 0.05)
COUNTS = {"empty ends": (0, 1, 67, 0, 9), "one expert": (33,), "odd": (3, 0, 130, 5)}


def _gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _offs(counts) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _spans(counts):
    ends = torch.tensor(counts).cumsum(0).tolist()
    return list(zip([0, *ends], ends))


def _close_to_exact(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rounding: float) -> None:
    """``got`` (bf16) = a·bᵀ of fp32 ``a`` [m, k], ``b`` [n, k] within the bf16 output's ``rounding``
    (relative) and fp32 summation."""
    ref = a.double() @ b.double().t()
    slack = rounding * ref.abs() + 2.0**-20 * (a.double().abs() @ b.double().abs().t())
    assert bool(((got.double() - ref).abs() <= slack).all()), float(((got.double() - ref).abs() - slack).max())


def _in_band(got: torch.Tensor, ref: torch.Tensor) -> None:
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert BAND[0] <= rel <= BAND[1], rel


def _products(counts, scaling, kernel, k=80, n=48, config_m=None, config_k=None, seed=0):
    """The three products of a linear layer through the grouped GEMM: (x, w, dy, offs, y, dx, dw) with their
    quantised operands' dequantised values (xr, wf, dyr, wt, dyt, xt)."""
    m = sum(counts)
    offs = _offs(counts)
    x, dy, w = _gaussian(m, k, seed=seed), _gaussian(m, n, seed=seed + 1), _gaussian(len(counts), n, k, seed=seed + 2)
    xr, xt = gq.quantize_activation(x, offs, scaling, rows=True, tokens=True, kernel=kernel)
    dyr, dyt = gq.quantize_activation(dy, offs, scaling, rows=True, tokens=True, kernel=kernel)
    fwd, bwd = gq.quantize_weight(w, scaling, kernel)
    y = gg.m_grouped(xr, fwd, offs, scaling, kernel, config=config_m)
    dx = gg.m_grouped(dyr, bwd, offs, scaling, kernel, config=config_m)
    dw = gg.k_grouped(dyt, xt, offs, scaling, kernel, config=config_k)
    deq = {"x": gq.dequantize_rows(*xr, scaling), "w": gq.dequantize_rows(*fwd, scaling),
           "dy": gq.dequantize_rows(*dyr, scaling), "wt": gq.dequantize_rows(*bwd, scaling),
           "dyt": gq.dequantize_tokens(*dyt, offs, scaling), "xt": gq.dequantize_tokens(*xt, offs, scaling)}
    return (x, w, dy, offs), (y, dx, dw), deq


def _check_products(counts, scaling, kernel, **kw):
    # bf16 rounding to nearest: half an ulp, 2^-8 relative; Triton's interpreter truncates fp32 to bf16 (a
    # GPU rounds to nearest), a whole ulp
    rounding = 2.0**-7 if kernel else 2.0**-8
    (x, w, dy, offs), (y, dx, dw), d = _products(counts, scaling, kernel, **kw)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    slot = gq.token_slot_of_rows(offs, x.shape[0])
    for g, (lo, hi) in enumerate(_spans(counts)):
        if hi == lo:
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))  # an expert without tokens: a zero gradient
            continue
        cols = slot[lo:hi]
        _close_to_exact(y[lo:hi], d["x"][lo:hi], d["w"][g], rounding)
        _close_to_exact(dx[lo:hi], d["dy"][lo:hi], d["wt"][g], rounding)
        _close_to_exact(dw[g], d["dyt"][:, cols], d["xt"][:, cols], rounding)
    spans = [(g, lo, hi) for g, (lo, hi) in enumerate(_spans(counts)) if hi > lo]
    xf, wf, dyf = x.float(), w.float(), dy.float()
    _in_band(y, torch.cat([xf[lo:hi] @ wf[g].t() for g, lo, hi in spans]))
    _in_band(dx, torch.cat([dyf[lo:hi] @ wf[g] for g, lo, hi in spans]))
    _in_band(torch.stack([dw[g] for g, _, _ in spans]), torch.stack([dyf[lo:hi].t() @ xf[lo:hi] for _, lo, hi in spans]))
    return y, dx, dw


# ---- this process: the emulation, the layouts, the option ----

def test_token_slots_hand_worked():
    """Experts of 0, 1, 130, 0, 7 tokens: blocks 0, 1, 2, 0, 1 → tokens at slots 0, 128..257, 384..390;
    the bound 128·(⌈138/128⌉ + 5) = 896 covers the 512 used."""
    offs = _offs((0, 1, 130, 0, 7))
    assert gq.token_slot_of_rows(offs, 138).tolist() == [0, *range(128, 258), *range(384, 391)]
    assert int(gq.token_slots_used(offs)) == 512 and gq.token_slots(138, 5) == 896


@pytest.mark.parametrize("scaling", gq.SCALINGS)
def test_activation_forms_hand_worked(scaling):
    """Row 0 of 200 channels holds 448 at channel 0 and 4480 at channel 150 (1 elsewhere): rowwise its scale
    is 4480/448 (its amax), blockwise 448/448 for channels 0-127 and 4480/448 for 128-199; in the token form
    (expert 0 = rows 0, 1; expert 2 = row 2) channel 150's scale is 4480/448 and channel 0's 448/448 for
    expert 0, and 1/448 for expert 2 (its one row of ones)."""
    x = torch.ones(3, 200, dtype=torch.bfloat16)
    x[0, 0], x[0, 150] = 448.0, 4480.0
    offs = _offs((2, 0, 1))
    (q, s), (qt, st) = gq.quantize_activation(x, offs, scaling, rows=True, tokens=True)

    def scale(amax):  # amax · fp32(1/448), as the quantisation computes it
        return torch.tensor(amax, dtype=torch.float32) * INV_E4M3_MAX

    if scaling == "rowwise":
        assert torch.equal(s, scale([4480.0, 1.0, 1.0])) and st.shape == (3, 200)
        assert st[0, 150] == scale(4480.0) and st[0, 0] == scale(448.0) and st[0, 1] == scale(1.0)
        assert torch.equal(st[1], torch.ones(200))  # expert 1 has no tokens
    else:
        assert s.shape == (2, 3) and s[0, 0] == scale(448.0) and s[1, 0] == scale(4480.0)
        assert st.shape == (gq.token_slots(3, 3) // 128, 200)
        assert st[0, 150] == scale(4480.0) and st[0, 0] == scale(448.0) and st[1, 0] == scale(1.0)
    assert q[0, 150].float() == 448.0 and qt[150, 0].float() == 448.0 and qt[150, 128].float() == 448.0
    assert torch.equal(qt[:, 2:128].float(), torch.zeros(200, 126))  # expert 0's padding slots


@pytest.mark.parametrize("scaling", gq.SCALINGS)
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_emulated_products_equal_the_dequantised_product(counts, scaling):
    _check_products(counts, scaling, kernel=False)


def test_blockwise_weight_forms_are_one_quantisation_transposed():
    """The dgrad form of a 128 × 128-block weight is the forward form's bytes transposed and its scales'
    transpose: one quantisation serves both GEMMs."""
    (q, s), (qt, st) = gq.quantize_weight(_gaussian(3, 200, 136, seed=4), "blockwise")
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8)) and torch.equal(st, s.transpose(1, 2))
    assert s.shape == (3, 2, 2)


def test_blockwise_scales_follow_each_block():
    """A weight whose 128 × 128 block (1, 0) is 1000× the others: that block's scale alone is 1000×, so the
    other blocks keep e4m3's precision (rowwise, a row through the large block would lose them)."""
    w = _gaussian(1, 256, 256, seed=3)
    w[0, 128:, :128] *= 1000
    (q, s), _ = gq.quantize_weight(w, "blockwise")
    ratio = s[0] / s[0, 0, 0]
    assert 300 < float(ratio[1, 0]) < 3000 and float(ratio.max() / ratio.min()) < 3000
    assert float(ratio[0, 1]) < 2 and float(ratio[1, 1]) < 2
    back = gq.dequantize_rows(q, s, "blockwise")
    small = (back[0, :128] - w[0, :128].float()).norm() / w[0, :128].float().norm()
    assert 0.01 < float(small) < 0.05


def test_grouped_mm_autograd_on_cpu_runs_the_emulation_and_matches_the_products():
    """The autograd function (the CPU path: emulation) gives forward, dgrad and wgrad equal to the three
    products computed from the same quantisation, and counts emulated calls."""
    counts = COUNTS["empty ends"]
    for scaling in gq.SCALINGS:
        (x, w, dy, offs), (y, dx, dw), _ = _products(counts, scaling, kernel=False)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        before = gg.counts().get("emulated", 0)
        out = gg.grouped_mm(xg, wg, offs, scaling)
        out.backward(dy)
        assert gg.counts()["emulated"] == before + 3
        assert torch.equal(out, y) and torch.equal(xg.grad, dx) and torch.equal(wg.grad, dw)


def test_the_option_is_checked_and_defaults_to_the_fastest_of_fp8_and_bf16():
    assert ExecutorOptions().fp8_expert_gemm == "fastest"
    with pytest.raises(SpecError, match="fp8_expert_gemm"):
        ExecutorOptions(fp8_expert_gemm="blockwise")


@pytest.mark.parametrize("option, scaling, with_torch", [("foldtune-rowwise", "rowwise", False),
                                                          ("foldtune-blockwise", "blockwise", False),
                                                          ("auto", "rowwise", True)])
def test_the_option_picks_the_scaling_and_whether_torchs_kernel_is_a_candidate(option, scaling, with_torch):
    experts = _experts(option, "torch-fp8")
    assert experts._gmm.func is gg.grouped_mm
    assert experts._gmm.keywords == {"scaling": scaling, "torch_candidate": with_torch}


def _experts(option: str, backend: str, dtype=torch.bfloat16):
    spec = get_model("tiny-moe")
    options = ExecutorOptions(fp8_expert_gemm=option)
    return GroupedExperts(spec, options, single_process_state(), 0, get_backend(backend), torch.device("cpu"), dtype)


def _layer_grads(experts: GroupedExperts, counts, seed: int = 11):
    torch.manual_seed(seed)
    h = experts.w13.shape[-1]
    x = (torch.randn(sum(counts), h) * 0.5).to(experts.w13.dtype).requires_grad_()
    y = experts(x, torch.tensor(counts))
    y.backward(_gaussian(*y.shape, seed=seed + 1))
    return y.detach().float(), x.grad.float(), experts.w13.grad.float(), experts.w2.grad.float()


@pytest.mark.parametrize("option", ["foldtune-rowwise", "foldtune-blockwise", "auto"])
def test_experts_with_the_option_run_foldtunes_kernels_and_match_bf16(option):
    """GroupedExperts under precision fp8 with the option: every expert GEMM goes through foldtune's grouped
    path (3 a GEMM: 6), and the output and the gradients of input and weights equal the bf16 layer's
    within fp8's error (relative Frobenius 1-10 %, several GEMMs deep), not bit for bit."""
    counts = (0, 5, 40, 0, 3, 17, 1, 30)
    bf16 = _layer_grads(_experts("torch", "torch"), counts)
    before = gg.counts().get("emulated", 0)
    fp8 = _layer_grads(_experts(option, "torch-fp8"), counts)
    assert gg.counts()["emulated"] == before + 6
    for got, want in zip(fp8, bf16):
        rel = float((got - want).norm() / want.norm())
        assert 0.005 < rel < 0.1, rel


def test_the_option_leaves_other_precisions_and_the_default_alone():
    before = dict(gg.counts())
    _layer_grads(_experts("foldtune-blockwise", "torch"), (4, 4, 0, 0, 0, 0, 0, 8))
    _layer_grads(_experts("torch", "torch-fp8"), (4, 4, 0, 0, 0, 0, 0, 8))
    assert gg.counts() == before


def test_blockwise_weights_are_quantised_once_per_value_and_cached_as_a_pair():
    fp8_pkg.clear_weight_cache()
    w = torch.nn.Parameter(_gaussian(2, 48, 80, seed=5))
    start = fp8_pkg.weight_counts().get("quantised", 0)
    maker = functools.partial(gq.quantize_weight, scaling="blockwise")
    first = fp8_pkg.quantized_weight(w, blocks=maker)
    assert fp8_pkg.quantized_weight(w, blocks=maker) is first
    with torch.no_grad():
        w.mul_(2)
    again = fp8_pkg.quantized_weight(w, blocks=maker)
    assert again is not first and torch.equal(again[0][1], first[0][1] * 2)
    assert fp8_pkg.weight_counts()["quantised"] - start == 2
    fp8_pkg.clear_weight_cache()


def test_the_tuner_keeps_the_fastest_config_that_runs_and_agrees(monkeypatch):
    """Of the candidates, one fails to compile and one (the fastest) writes a different result: both are
    skipped with a warning and the fastest of the rest is kept, once per key; off the GPU, or with
    FOLDTUNE_FP8_GG_TUNE=0, the first candidate without running anything."""
    monkeypatch.delenv("FOLDTUNE_FP8_GG_TUNE", raising=False)
    configs = tuple(gg.Config(bm, 128, 128, 8, 4, 3, False) for bm in (16, 32, 64, 128))
    monkeypatch.setitem(gg.CONFIGS, ("m", "rowwise"), configs)
    out = torch.zeros(4)
    seconds = {16: 3.0, 32: 2.0, 64: 1.0, 128: 0.5}
    ran = []

    def launch(cfg):
        ran.append(cfg.block_m)
        if cfg.block_m == 32:
            raise RuntimeError("out of shared memory")
        return out.fill_(2.0 if cfg.block_m == 128 else 1.0)

    def timer(call):
        call()
        return seconds[ran[-1]]

    key = ("test", len(gg._TUNED))
    with pytest.warns(UserWarning, match="skipped") as caught:
        assert gg.tuned("m", "rowwise", key, launch, torch.device("cuda"), timer).block_m == 64
    assert len(caught) == 2 and set(ran) == {16, 32, 64, 128}
    ran.clear()
    assert gg.tuned("m", "rowwise", key, launch, torch.device("cuda"), timer).block_m == 64 and not ran
    assert gg.tuned("m", "rowwise", key, launch, torch.device("cpu"), timer) is configs[0] and not ran
    monkeypatch.setenv("FOLDTUNE_FP8_GG_TUNE", "0")
    assert gg.tuned("m", "rowwise", (*key, 1), launch, torch.device("cuda"), timer) is configs[0] and not ran


def test_the_tuner_keeps_torchs_kernel_where_it_is_faster_and_keys_on_it(monkeypatch):
    """With torch's kernel as an extra candidate, the tuner keeps it where it times fastest and agrees with
    the first candidate; the same shape tuned without it is a choice of its own (not torch's); a torch
    kernel whose result differs is skipped like any config."""
    monkeypatch.delenv("FOLDTUNE_FP8_GG_TUNE", raising=False)
    configs = (gg.Config(64, 128, 128, 8, 4, 4, False), gg.Config(64, 128, 128, 8, 4, 4, True, flatten=True))
    monkeypatch.setitem(gg.CONFIGS, ("m", "rowwise"), configs)
    seconds = {configs[0]: 2.0, configs[1]: 1.5, gg.TORCH_KERNEL: 1.0}
    torch_result = [1.0]
    ran = []

    def launch(cfg):
        ran.append(cfg)
        return torch.full((4,), torch_result[0] if cfg.engine == "torch" else 1.0)

    def timer(call):
        call()
        return seconds[ran[-1]]

    key = ("torch-candidate", len(gg._TUNED))
    cuda = torch.device("cuda")
    assert gg.tuned("m", "rowwise", key, launch, cuda, timer, extra=(gg.TORCH_KERNEL,)) is gg.TORCH_KERNEL
    assert gg.tuned("m", "rowwise", key, launch, cuda, timer) is configs[1]
    torch_result[0] = 1.5
    with pytest.warns(UserWarning, match="torch kernel skipped"):
        assert gg.tuned("m", "rowwise", (*key, 1), launch, cuda, timer, extra=(gg.TORCH_KERNEL,)) is configs[1]
    assert gg.TORCH_KERNEL.label() == "torch kernel" and configs[1].label() == "64x128x128 g8 w4 s4 tma flat"


def test_torchs_kernel_gets_its_operands_in_its_own_layout(monkeypatch):
    """The 'torch' engine hands the row form, the weight form transposed to [G, K, N] column-major, the
    scales [M] and [G, N] and the offsets to torch._scaled_grouped_mm (a CPU stand-in that checks those
    layouts and multiplies as its documentation says), and its result is the emulation's."""
    counts = (0, 5, 40, 0, 3)
    offs = _offs(counts)
    x, w = _gaussian(sum(counts), 64, seed=3), _gaussian(len(counts), 32, 64, seed=4)
    rows, _ = gq.quantize_activation(x, offs, "rowwise", kernel=False)
    fwd, _ = gq.quantize_weight(w, "rowwise", False)

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        g, k, n = b.shape
        assert a.dtype == b.dtype == gq.E4M3 and a.shape[1] == k and b.stride(1) == 1 and out_dtype == gg.OUT
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (g, n) and offs.dtype == torch.int32
        out = torch.zeros(a.shape[0], n)
        for e, (lo, hi) in enumerate(_spans(counts)):
            out[lo:hi] = (a[lo:hi].float() * scale_a[lo:hi, None]) @ (b[e].float() * scale_b[e][None, :])
        return out.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)
    got = gg.m_grouped(rows, fwd, offs, "rowwise", True, config=gg.TORCH_KERNEL)
    want = gg.m_grouped(rows, fwd, offs, "rowwise", False)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * float(want.float().abs().max()))
    assert gg.last_config("m") is gg.TORCH_KERNEL


def test_the_wgrad_refuses_an_expert_gradient_past_32_bit_offsets():
    """The k-grouped kernels address an expert's [P, Q] gradient in 32 bits: 2^16 x 2^15 elements is refused
    before anything launches (no wrapped offsets writing elsewhere)."""
    e4m3 = torch.float8_e4m3fn
    a = (torch.zeros(2**16, 128, dtype=e4m3), torch.ones(1, 2**16))
    b = (torch.zeros(2**15, 128, dtype=e4m3), torch.ones(1, 2**15))
    with pytest.raises(ValueError, match="32-bit"):
        gg._launch_k(_configs("k", "rowwise")[0], a=a, b=b, offs=torch.tensor([128], dtype=torch.int32),
                     scaling="rowwise")


def test_the_self_check_passes_on_the_emulation():
    gg.compare_on("cpu", kernel=False)


# ---- the Triton kernels, in Triton's interpreter ----

def test_grouped_kernels_in_triton_interpreter(triton_interpreter):
    """The Triton kernels below run in a child pytest with TRITON_INTERPRET=1 (Triton reads it at import)."""
    triton_interpreter.check(__file__)


@inner_only
@pytest.mark.parametrize("scaling", gq.SCALINGS)
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_triton_quantisation_is_the_torch_path_byte_for_byte(counts, scaling):
    """Both forms and their scales, channels not a multiple of 128 (a partial block), a row 1000× the rest;
    the token form over the slots the GEMM reads; the weights' forms likewise."""
    offs = _offs(counts)
    x = _gaussian(sum(counts), 200, seed=1)
    x[0] *= 1000
    got = gq.quantize_activation(x, offs, scaling, rows=True, tokens=True, kernel=True)
    want = gq.quantize_activation(x, offs, scaling, rows=True, tokens=True, kernel=False)
    used = int(gq.token_slots_used(offs))
    gg._same_bytes(got[0], want[0])
    (qt, st), (qt_ref, st_ref) = got[1], want[1]
    if scaling == "blockwise":
        st, st_ref = st[:used // 128], st_ref[:used // 128]
    gg._same_bytes((qt[:, :used], st), (qt_ref[:, :used], st_ref))
    w = _gaussian(len(counts), 200, 136, seed=2)
    for g_form, w_form in zip(gq.quantize_weight(w, scaling, True), gq.quantize_weight(w, scaling, False)):
        gg._same_bytes(g_form, w_form)
    tokens_only = gq.quantize_activation(x, offs, scaling, rows=False, tokens=True, kernel=True)
    assert tokens_only[0] is None and torch.equal(tokens_only[1][0][:, :used].view(torch.uint8),
                                                  qt_ref[:, :used].view(torch.uint8))


def _configs(kind, scaling):
    return gg.CONFIGS[(kind, scaling)]


@inner_only
@pytest.mark.parametrize("scaling", gq.SCALINGS)
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_triton_products_equal_the_dequantised_product(counts, scaling):
    """Forward, dgrad and wgrad through the kernels (the first config: pointer loads, 3 persistent programs
    walking every tile) against float64 of the dequantised operands and the bf16 operands; and equal to the
    emulation within bf16 rounding."""
    got = _check_products(counts, scaling, kernel=True)
    want = _products(counts, scaling, kernel=False)[1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-3 * float(w.float().abs().max()))


@inner_only
@pytest.mark.parametrize("scaling", gq.SCALINGS)
def test_every_config_gives_the_same_products(scaling):
    """Every candidate the tuner may pick (tiles, TMA descriptors or pointers, programs an SM) gives the
    products of the first; where K is not a multiple of 16 the TMA candidates fall back to pointers, with
    masked K steps."""
    counts = COUNTS["empty ends"]
    configs_m, configs_k = _configs("m", scaling), _configs("k", scaling)
    assert any(c.flatten for c in configs_m)  # the fused tile and contraction loop is among those checked
    # one program an SM, pointers and TMA (a program count alone changes no compiled code: one with two)
    once = [i for i, c in enumerate(configs_m) if c.per_sm == 1][1:] + [configs_m.index(
        next(c for c in configs_m if c.per_sm == 2))]
    tma_twin = next(i for i, c in enumerate(configs_m) if c.tma)  # the first's tiles through TMA
    for k, which in ((80, once), (72, (tma_twin,))):
        want = _products(counts, scaling, True, k=k, config_m=configs_m[0], config_k=configs_k[0])[1]
        for i in which:
            cm, ck = configs_m[i], configs_k[min(i, len(configs_k) - 1)]  # the flattened configs: m-grouped only
            got = _products(counts, scaling, True, k=k, config_m=cm, config_k=ck)[1]
            for g, w in zip(got, want):
                torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-3 * float(w.float().abs().max()))


@inner_only
@pytest.mark.parametrize("scaling", gq.SCALINGS)
def test_flattened_configs_walk_experts_of_different_lengths(scaling):
    """The flattened configs (m-grouped: one fused loop; k-grouped: one walk over (tile, step) pairs) against
    the first config, where the experts' token blocks differ (1, 2 and 3 blocks of 128 and empty experts
    between) and 3 programs walk 7 experts' tiles: a program's steps carry over from one expert to the
    next, and an empty expert's tile is zeros."""
    counts = (0, 200, 0, 0, 129, 1, 300)
    configs_m, configs_k = _configs("m", scaling), _configs("k", scaling)
    want = _products(counts, scaling, True, config_m=configs_m[0], config_k=configs_k[0])[1]
    flat = [(cm, ck) for cm, ck in zip(configs_m, configs_k) if cm.flatten and ck.flatten and cm.per_sm == 1]
    assert flat
    for cm, ck in flat:
        got = _products(counts, scaling, True, config_m=cm, config_k=ck)[1]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-3 * float(w.float().abs().max()))
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert not got[2][empty].any()


@inner_only
def test_triton_self_check_passes():
    gg.compare_on("cpu", kernel=True)


@inner_only
def test_triton_self_check_fails_on_a_wrong_product(monkeypatch):
    real = gg._launch_k

    def off_by_one_percent(cfg, **kwargs):
        return real(cfg, **kwargs) * 1.01

    monkeypatch.setattr(gg, "_launch_k", off_by_one_percent)
    with pytest.raises(AssertionError):
        gg.compare_on("cpu", kernel=True)


@inner_only
def test_triton_self_check_fails_on_a_wrong_byte(monkeypatch):
    real = gq._act_triton

    def flipped(*args):
        rows, tokens = real(*args)
        rows[0].view(torch.uint8).view(-1)[5] ^= 1
        return rows, tokens

    monkeypatch.setattr(gq, "_act_triton", flipped)
    with pytest.raises(AssertionError, match="bytes differ"):
        gg.compare_on("cpu", kernel=True)


@inner_only
@pytest.mark.parametrize("option", ["foldtune-rowwise", "foldtune-blockwise"])
def test_triton_experts_match_bf16_and_the_emulation(option, monkeypatch):
    """The experts' layer through the kernels: output and gradients equal the emulated fp8 layer's within
    bf16 rounding over a few GEMMs (the interpreter truncates to bf16: up to an ulp an output, biased, so 4 %
    after two GEMMs and the SwiGLU between), and the bf16 layer's within fp8's error."""
    counts = (0, 5, 40, 0, 3, 17, 1, 30)
    emulated = _layer_grads(_experts(option, "torch-fp8"), counts)
    monkeypatch.setattr(gg, "kernels_ok", lambda device: True)
    before = gg.counts().get("kernel", 0)
    kernels = _layer_grads(_experts(option, "torch-fp8"), counts)
    assert gg.counts()["kernel"] == before + 6
    bf16 = _layer_grads(_experts("torch", "torch"), counts)
    for got, emu, want in zip(kernels, emulated, bf16):
        assert float((got - emu).norm() / emu.norm()) < 0.04
        assert 0.005 < float((got - want).norm() / want.norm()) < 0.1


def _two_steps(option: str, backend: str) -> list[float]:
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    options = ExecutorOptions(kernel_backend=backend, fp8_expert_gemm=option)
    model = MoEGPT(spec, single_process_state(ParallelConfig(world_size=1)), options, 32, dtype=torch.bfloat16)
    trainer = Trainer(model, lr=1e-2)
    losses = []
    for _ in range(2):
        batch = global_batch(spec.vocab_size, 32, 4, 1234, 0)  # the same batch: its loss must fall
        losses.append(trainer.step(micro_batches(batch, 1, 0, 2, "cpu")).loss)
    return losses


def test_tiny_moe_training_with_foldtunes_blockwise_experts_tracks_bf16():
    """Two Adam steps of tiny-moe (lr 1e-2) on one batch with the experts on foldtune's blockwise path: the
    losses stay within 0.2 % of bf16's, are not bf16's nor torch's rowwise fp8 path's, and fall; every expert
    GEMM of every layer and micro-batch went through it (3 a GEMM, 2 GEMMs, 2 layers, 2 micro-batches, 2 steps)."""
    before = gg.counts().get("emulated", 0)
    blockwise = _two_steps("foldtune-blockwise", "torch-fp8")
    assert gg.counts()["emulated"] - before == 3 * 2 * 2 * 2 * 2
    bf16, rowwise_torch = _two_steps("torch", "torch"), _two_steps("torch", "torch-fp8")
    assert blockwise != bf16 and blockwise != rowwise_torch
    for got, want in zip(blockwise, bf16):
        assert got == pytest.approx(want, rel=2e-3)
    assert blockwise[1] < blockwise[0]


# ---- the measurement core of bench/fp8_grouped_gemm.py ----

def _fake_clock(monkeypatch):
    from executor.microbench import fp8_grouped as mb

    timed = []

    class Timing:
        seconds = 1e-3

    def time_host_ahead(call, device, calls, windows):
        timed.append(call)
        return Timing()

    monkeypatch.setattr(mb, "time_host_ahead", time_host_ahead)
    return mb, timed


def test_the_microbench_keeps_token_counts_apart(monkeypatch):
    """Products made for two micro-batch sizes carry their token count, and the per-layer sums add only the
    products of one size (forward, dgrad, wgrad; two quantisations)."""
    mb, timed = _fake_clock(monkeypatch)
    spec = get_model("tiny-moe")
    items = [p for tokens in (32, 64) for p in mb.products("tiny-moe", spec, tokens) if p.weight == "w2"]
    rows = mb.measure(items, torch.device("cpu"), False, ("rowwise",), calls=1, progress=lambda _: None,
                      max_rel_err=0.06)
    assert [(r["tokens"], r["product"]) for r in rows] == [(t, p) for t in (32, 64) for p in mb.PRODUCTS]
    assert all(0.01 < r["rowwise_rel_err"] < 0.05 for r in rows)
    layers = mb.layer_rows(rows, ("rowwise",))
    assert [(layer["tokens"], layer["weight"]) for layer in layers] == [(32, "w2"), (64, "w2")]
    assert layers[0]["rowwise_s"] == pytest.approx(3 * 1e-3 + 2 * 1e-3)
    assert layers[0]["flops"] == sum(r["flops"] for r in rows if r["tokens"] == 32)


def test_the_microbench_stops_before_timing_a_wrong_result(monkeypatch):
    """A kernel 20 % off (far outside e4m3's band against bf16) stops the measurement with WrongResult
    before anything of that product is timed."""
    mb, timed = _fake_clock(monkeypatch)
    real = gg.m_grouped
    monkeypatch.setattr(gg, "m_grouped", lambda *args, **kwargs: real(*args, **kwargs) * 1.2)
    fwd = mb.products("tiny-moe", get_model("tiny-moe"), 64)[:1]
    with pytest.raises(mb.WrongResult, match="w13 fwd at 64 tokens, rowwise"):
        mb.measure(fwd, torch.device("cpu"), False, ("rowwise",), calls=1, progress=lambda _: None, max_rel_err=0.06)
    assert not timed
