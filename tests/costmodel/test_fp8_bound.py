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
    # the head bf16, every other GEMM its faster at the dense rate: 4·1 + 2·(3−2.5) + 0 + 2·(10−5) = 15 ms
    assert got["bf16_head_at_dense_rate"]["fp8_step_s"] == pytest.approx(0.085)
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


def _per_token(gemms, tokens):
    return sum(g.flops * g.per_step for g in gemms) / tokens


def test_qwen3_proxy_inventory_is_the_model_flops_less_the_attention_core():
    """Qwen3-30B-A3B cut to 4 layers, 8 micro-batches of 1 x 4096: every GEMM spec.flops counts, and no other;
    the difference is the causal core (6 · layers · seq/2 · heads · head_dim · 2 for QK and PV)."""
    from spec.flops import flops_per_token
    from spec.proxy import proxy_model

    spec = get_model("qwen3-30b-a3b")
    gemms = step_gemms(spec, seq=4096, layers=4, micro_batches=8, micro_batch_size=1)
    proxy = proxy_model(spec, 4)
    core = 6 * 4 * (4096 / 2) * 32 * 128 * 2
    assert _per_token(gemms, 8 * 4096) == pytest.approx(flops_per_token(proxy, 4096) - core, rel=1e-12)
    by = {g.name: g for g in gemms}
    assert (by["wk fwd"].n, by["wk fwd"].k) == (4 * 128, 2048)          # 4 KV heads of 128
    assert (by["fc1 fwd"].m, by["fc1 fwd"].n, by["fc1 fwd"].groups) == (4096 * 8, 2 * 768, 128)
    assert by["fc1 fwd"].per_step == 4 * 8 and "mlp w1 fwd" not in by and "shared w1 fwd" not in by
    assert (by["lm_head wgrad"].m, by["lm_head wgrad"].k) == (151936, 4096)


def test_deepseek_v2_lite_inventory_has_mla_a_dense_first_layer_and_shared_experts():
    """DeepSeek-V2-Lite cut to 4 layers (1 dense, 3 MoE), one micro-batch of 8 x 4096: MLA's four projections
    on every layer, the dense MLP on one, the experts and the shared experts on three; the sum is spec.flops'
    count less the causal core and the latent norm's 6 FLOPs a rank-dimension it counts."""
    from spec.flops import flops_per_token
    from spec.proxy import proxy_model

    spec = get_model("deepseek-v2-lite")
    gemms = step_gemms(spec, seq=4096, layers=4, micro_batches=1, micro_batch_size=8)
    tokens = 8 * 4096
    core = 6 * 4 * (4096 * 16 * (128 + 64) / 2 + 4096 * 16 * 128 / 2)
    norms = 6 * 4 * 512
    assert _per_token(gemms, tokens) == pytest.approx(flops_per_token(proxy_model(spec, 4), 4096) - core - norms,
                                                      rel=1e-12)
    by = {g.name: g for g in gemms}
    assert [n for n in ("q_proj", "kv_down", "kv_up", "wo") if f"{n} fwd" in by] == ["q_proj", "kv_down", "kv_up", "wo"]
    assert (by["kv_down fwd"].m, by["kv_down fwd"].n, by["kv_down fwd"].per_step) == (tokens, 512 + 64, 4)
    assert (by["mlp w1 fwd"].n, by["mlp w1 fwd"].per_step) == (10944, 1)
    assert (by["shared w2 dgrad"].n, by["shared w2 dgrad"].per_step) == (2816, 3)
    assert (by["fc2 wgrad"].m, by["fc2 wgrad"].n, by["fc2 wgrad"].k) == (2048, 1408, tokens * 6)
