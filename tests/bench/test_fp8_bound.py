"""bench/fp8_bound.py: the step's GEMM inventory, the bound arithmetic (hand-worked), the bf16 operands'
forms, and the CLI's refusals."""

import json

import pytest
import torch

from bench import fp8_bound
from bench.fp8_bound import Gemm, bounds, step_gemms
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
    got = bounds(ROWS, 0.100)
    # every GEMM in fp8: 4·1 + 2·(3−4) + 1·3 + 2·4 = 13 ms saved
    assert got["torch_kernels"]["fp8_step_s"] == pytest.approx(0.087)
    assert got["torch_kernels"]["speedup"] == pytest.approx(100 / 87)
    # the executor: the LM head stays bf16, the wgrad takes bf16 (3 < 4 ms): 4 + 0 + 0 + 8 = 12 ms
    assert got["executor_choices"]["fp8_step_s"] == pytest.approx(0.088)
    # grouped at the dense fp8 rate: 4 + 2·0.5 + 3 + 2·5 = 18 ms
    assert got["grouped_at_dense_rate"]["fp8_step_s"] == pytest.approx(0.082)
    assert not any(b["reaches_bar"] for b in got.values())
    scaled = bounds(ROWS, 0.100, grouped_scale=1.5)  # grouped savings ×1.5: 4 − 3 + 3 + 12 = 16 ms
    assert scaled["torch_kernels"]["fp8_step_s"] == pytest.approx(0.084)
    assert bounds([_row("x", 10, 1, 5)], 0.100)["torch_kernels"]["reaches_bar"]  # 45 ms saved: 1.82


def test_bf16_ops_compute_the_gemm_they_name():
    """The grouped forms contract what they should: the wgrad over each group's rows (16 of the 64 here), one
    [m, n] per group, against a per-group product of the same operands (bf16_op draws dy [rows, m], then x)."""
    dev = torch.device("cpu")
    wgrad = Gemm("w", m=32, n=48, k=64, per_step=1, groups=4, wgrad=True)
    torch.manual_seed(3)
    out = fp8_bound.bf16_op(wgrad, dev)()
    torch.manual_seed(3)
    dy, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16)
    assert out.shape == (4, 32, 48)
    for group in range(4):
        rows = slice(16 * group, 16 * (group + 1))
        want = dy[rows].float().t() @ x[rows].float()
        torch.testing.assert_close(out[group].float(), want, rtol=2e-2, atol=2e-2)
    fwd = Gemm("f", m=64, n=32, k=48, per_step=1, groups=4)
    assert fp8_bound.bf16_op(fwd, dev)().shape == (64, 32)
    assert fp8_bound.bf16_op(Gemm("d", 8, 24, 16, 1), dev)().shape == (8, 24)


def test_profiled_grouped_seconds_reads_cutlass_kernels_only():
    step = {"bf16": {"top_kernels_per_step": [
        {"name": "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm", "ms": 30.0},
        {"name": "nvjet_sm90_tst_320x128", "ms": 10.0}, {"name": "_accumulate_kernel", "ms": 38.0},
        {"name": "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm", "ms": 5.0}]}}
    assert fp8_bound.profiled_grouped_seconds(step) == pytest.approx(0.035)
    assert fp8_bound.profiled_grouped_seconds({"bf16": {}}) is None


def test_cli_refuses_a_missing_report_and_a_machine_without_sm90(tmp_path, capsys):
    assert fp8_bound.main(["--step-json", str(tmp_path / "absent.json")]) == 2
    assert "is not a bench.fp8_step report" in capsys.readouterr().err
    report = tmp_path / "step.json"
    report.write_text(json.dumps({"bf16": {"median_step_s": 0.25}}))
    if not torch.cuda.is_available():
        assert fp8_bound.main(["--step-json", str(report)]) == 2
        assert "compute capability 9.0" in capsys.readouterr().err
