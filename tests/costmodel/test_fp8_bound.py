"""costmodel.fp8_bound: the step's GEMM inventory and the bound arithmetic (hand-worked)."""

import pytest

from costmodel.fp8_bound import Gemm, bounds, profiled_grouped_seconds, step_gemms
from spec.catalog import get_model


def test_step_gemms_are_six_n_d_of_the_proxy():
    """Σ FLOPs of the inventory = 6 · tokens · (GEMM parameters a token touches): per layer the attention
    projections and top-2 experts' three matrices, and the LM head; 2 layers, 4 micro-batches of 4096."""
    gemms = step_gemms(get_model("mixtral-8x7b"))
    assert len(gemms) == 4 * 3 + 2 * 3 + 3
    h, f, q, kv, vocab, tokens = 4096, 14336, 4096, 1024, 32000, 4 * 4096
    per_token = 2 * (h * (q + 2 * kv) + q * h + 2 * 3 * f * h) + vocab * h
    assert sum(g.flops * g.per_step for g in gemms) == 6 * tokens * per_token
    fc1 = {g.name: g for g in gemms}["fc1 fwd"]
    assert (fc1.m, fc1.n, fc1.k, fc1.groups, fc1.per_step) == (8192, 2 * f, h, 8, 8)
    wgrad = {g.name: g for g in gemms}["fc2 wgrad"]
    assert (wgrad.m, wgrad.n, wgrad.k, wgrad.wgrad) == (h, f, 8192, True)
    assert [g.name for g in gemms if not g.in_fp8] == ["lm_head fwd", "lm_head dgrad", "lm_head wgrad"]


def _row(name, bf16, fp8, per_step, dense=None, groups=1, wgrad=False, in_fp8=True):
    g = Gemm(name, 16, 16, 16, per_step, groups, wgrad, in_fp8)
    return {**g.__dict__, "bf16_s": bf16 / 1e3, "fp8_s": fp8 / 1e3,
            "fp8_dense_s": (fp8 if dense is None else dense) / 1e3}


ROWS = [_row("dense", 2, 1, 4), _row("expert wgrad", 3, 4, 2, dense=2.5, groups=8, wgrad=True),
        _row("lm head", 5, 2, 1, in_fp8=False), _row("expert fwd", 10, 6, 2, dense=5, groups=8)]


def test_bounds_hand_worked():
    got = bounds(ROWS, 0.100, 1.25)
    # every GEMM in fp8: 4·1 + 2·(3−4) + 1·3 + 2·4 = 13 ms saved
    assert got["torch_kernels"]["fp8_step_s"] == pytest.approx(0.087)
    assert got["torch_kernels"]["speedup"] == pytest.approx(100 / 87)
    # the executor: the LM head stays bf16, the wgrad takes bf16 (3 < 4 ms): 4 + 0 + 0 + 8 = 12 ms
    assert got["executor_choices"]["fp8_step_s"] == pytest.approx(0.088)
    # grouped at the dense fp8 rate: 4 + 2·0.5 + 3 + 2·5 = 18 ms
    assert got["grouped_at_dense_rate"]["fp8_step_s"] == pytest.approx(0.082)
    assert not any(b["reaches_bar"] for b in got.values())
    scaled = bounds(ROWS, 0.100, 1.25, grouped_scale=1.5)  # grouped savings ×1.5: 4 − 3 + 3 + 12 = 16 ms
    assert scaled["torch_kernels"]["fp8_step_s"] == pytest.approx(0.084)
    assert bounds([_row("x", 10, 1, 5)], 0.100, 1.25)["torch_kernels"]["reaches_bar"]  # 45 ms saved: 1.82


def test_profiled_grouped_seconds_reads_cutlass_kernels_only():
    step = {"bf16": {"top_kernels_per_step": [
        {"name": "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm", "ms": 30.0},
        {"name": "nvjet_sm90_tst_320x128", "ms": 10.0}, {"name": "_accumulate_kernel", "ms": 38.0},
        {"name": "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm", "ms": 5.0}]}}
    assert profiled_grouped_seconds(step) == pytest.approx(0.035)
    assert profiled_grouped_seconds({"bf16": {}}) is None
