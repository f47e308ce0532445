"""ExecutorOptions.fp8_expert_gemm 'fastest' (executor/kernels/fp8/expert_pick.py): per expert GEMM shape,
bf16 or fp8 as the first call's timing chose (fp8 only where faster by spec.fp8_choice.FP8_CHOICE_MARGIN, medians of
alternating rounds). On CPU the timing is injected (``timer``/``TIMER``) to
force either verdict; the CUDA timing itself is checked on a GPU (the last test)."""

from __future__ import annotations

import pytest
import torch

from executor.data import global_batch, micro_batches
from executor.kernels import fp8, get_backend
from executor.kernels.fp8 import expert_pick as pick, gemm as fp8_gemm
from executor.kernels.torch_backend import TorchBackend
from executor.measurement import Measurement
from executor.model import MoEGPT
from executor.moe import GroupedExperts
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.profile import _fp8_report, expert_gemm_paths
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.fp8_choice import FP8_CHOICE_MARGIN
from spec.parallel_config import ParallelConfig

COUNTS = (5, 0, 27, 16)
# the paths one shape's timing runs: pick.ROUNDS rounds of both, the first path alternating
ONE_TIMING = ["bf16", "fp8", "fp8", "bf16", "bf16", "fp8"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test starts with no verdicts, no counts and no injected timer."""
    monkeypatch.setattr(pick, "_VERDICTS", {})
    monkeypatch.setattr(pick, "TIMER", None)
    pick.reset_counts()
    yield
    pick.reset_counts()


def _operands(counts=COUNTS, n=32, k=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=gen).to(torch.bfloat16)
    w = torch.randn(len(counts), n, k, generator=gen).to(torch.bfloat16)
    dy = torch.randn(sum(counts), n, generator=gen).to(torch.bfloat16)
    offs = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    return x, w, dy, offs


def _forced(winner: str, timed: list):
    """A timer under which ``winner`` is the faster path; it runs each call (as a real timer does) and
    records the paths it timed."""
    def timer(path, call):
        call()
        timed.append(path)
        return 1.0 if path == winner else 2.0
    return timer


def _grads(gmm, x, w, dy, offs):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gmm(xg, wg, offs)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


@pytest.mark.parametrize("winner", ["bf16", "fp8"])
def test_the_chosen_path_gives_exactly_that_paths_outputs_and_gradients(winner):
    """Whichever path the timing keeps, the layer's output, dgrad and wgrad are exactly that path's: bf16's
    ``torch._grouped_mm`` (the 'torch' backend) or the fp8 'torch' option's (its CPU emulation); both paths
    were timed, once."""
    x, w, dy, offs = _operands()
    timed = []
    got = _grads(lambda *a: pick.grouped_mm(*a, timer=_forced(winner, timed)), x, w, dy, offs)
    want = _grads(TorchBackend().grouped_mm if winner == "bf16" else fp8_gemm.grouped_mm, x, w, dy, offs)
    other = _grads(fp8_gemm.grouped_mm if winner == "bf16" else TorchBackend().grouped_mm, x, w, dy, offs)
    assert timed == ONE_TIMING
    assert all(torch.equal(g, wnt) for g, wnt in zip(got, want))
    # output and dgrad tell the paths apart; the 'torch' option's wgrad is bf16's own (FOLDTUNE_FP8_WGRAD)
    assert not torch.equal(got[0], other[0]) and not torch.equal(got[1], other[1])


def test_the_timing_runs_the_whole_layer_of_each_path_without_touching_the_parameters_gradient():
    """Each timed call is a forward plus dgrad and wgrad of its own path (the fp8 one counts its two fp8
    GEMMs: forward and dgrad; its wgrad is bf16), asked through autograd.grad: the weight's .grad stays
    unset until the layer's own backward."""
    x, w, _, offs = _operands()
    w = w.requires_grad_()
    seen = {}

    def timer(path, call):
        before = fp8.gemm_counts().get("emulated", 0)
        call()
        seen[path] = fp8.gemm_counts().get("emulated", 0) - before
        return 1.0
    y = pick.grouped_mm(x.requires_grad_(), w, offs, timer=timer)
    assert seen == {"bf16": 0, "fp8": 2}
    assert w.grad is None and x.grad is None and y.requires_grad


def test_the_verdict_is_kept_per_shape_and_the_report_says_which_shapes_ran_bf16():
    """Timed once per (experts, N, K, rows rounded up to a power of two, backward or not): rows 48 and 60
    share a verdict; another N or 65 rows is timed afresh. The report counts shapes by path and calls by
    shape; the verdicts outlive reset_counts, the counts do not."""
    timed = []
    timer = _forced("bf16", timed)
    x, w, _, offs = _operands()  # 48 rows
    pick.grouped_mm(x, w, offs, timer=timer)
    x60, w60, _, offs60 = _operands(counts=(30, 0, 14, 16))
    pick.grouped_mm(x60, w60, offs60, timer=timer)
    assert timed == ONE_TIMING
    fp8_timer = _forced("fp8", timed)
    x2, w2, _, offs2 = _operands(n=16)
    pick.grouped_mm(x2, w2, offs2, timer=fp8_timer)
    x3, w3, _, offs3 = _operands(counts=(5, 0, 27, 33))
    pick.grouped_mm(x3, w3, offs3, timer=fp8_timer)
    assert len(timed) == 3 * len(ONE_TIMING)
    report = pick.report()
    assert report["bf16"] == 1 and report["fp8"] == 2 and report["fp8 untimed"] == 0
    assert report["bf16_shapes"] == {"4 x 32 x 48, rows <= 64": 2}
    assert report["fp8_shapes"] == {"4 x 16 x 48, rows <= 64": 1, "4 x 32 x 48, rows <= 128": 1}
    pick.reset_counts()
    pick.grouped_mm(x, w, offs, timer=fp8_timer)
    assert len(timed) == 3 * len(ONE_TIMING) and pick.report()["bf16_shapes"] == {"4 x 32 x 48, rows <= 64": 1}


def test_without_a_timer_off_cuda_it_runs_fp8_untimed_and_keeps_no_verdict():
    """On CPU nothing is timed: the call is the 'torch' option's fp8 emulation, bit for bit, reported as an
    untimed fp8 shape, and no verdict is kept (a timer given later still times the shape)."""
    x, w, dy, offs = _operands()
    got = _grads(pick.grouped_mm, x, w, dy, offs)
    want = _grads(fp8_gemm.grouped_mm, x, w, dy, offs)
    assert all(torch.equal(g, wt) for g, wt in zip(got, want))
    assert pick.report()["fp8 untimed"] == 1 and pick.report()["bf16"] == pick.report()["fp8"] == 0
    assert pick._VERDICTS == {}
    timed = []
    pick.grouped_mm(x, w, offs, timer=_forced("bf16", timed))
    assert timed == ONE_TIMING


def test_a_path_that_fails_to_run_is_skipped_with_a_warning():
    """A path whose timing raises (an out-of-memory, say) is not chosen; if both raise, fp8."""
    x, w, _, offs = _operands()

    def bf16_fails(path, call):
        if path == "bf16":
            raise RuntimeError("out of memory")
        return 5.0
    with pytest.warns(UserWarning, match="bf16 GEMM not timed"):
        pick.grouped_mm(x, w, offs, timer=bf16_fails)
    assert pick.report()["fp8"] == 1

    def both_fail(path, call):
        raise RuntimeError("out of memory")
    x2, w2, _, offs2 = _operands(n=16)
    with pytest.warns(UserWarning, match="not timed"):
        pick.grouped_mm(x2, w2, offs2, timer=both_fail)
    assert pick.report()["fp8"] == 2


def _scripted(times: dict[str, list[float]]):
    """A timer returning each path's scripted seconds in turn (running each call, as a real timer does)."""
    left = {path: list(t) for path, t in times.items()}

    def timer(path, call):
        call()
        return left[path].pop(0)
    return timer


@pytest.mark.parametrize("fp8_s,expected", [(0.98, "bf16"), (0.969, "fp8"), (0.90, "fp8"), (1.05, "bf16")])
def test_fp8_must_beat_bf16_by_the_margin(fp8_s, expected):
    """bf16 1.0 s a round; fp8 is kept only where it is more than FP8_CHOICE_MARGIN (3 %) faster."""
    assert FP8_CHOICE_MARGIN == 0.03
    x, w, _, offs = _operands()
    pick.grouped_mm(x, w, offs, timer=_scripted({"bf16": [1.0] * 3, "fp8": [fp8_s] * 3}))
    assert pick.report()[expected] == 1


def test_the_verdict_compares_medians_so_one_lucky_round_does_not_decide():
    """fp8 timed 0.5 s once and 1.2 s twice against bf16's steady 1.0 s: its median loses; the mirror case
    (bf16 lucky once) keeps fp8."""
    x, w, _, offs = _operands()
    pick.grouped_mm(x, w, offs, timer=_scripted({"bf16": [1.0, 1.0, 1.0], "fp8": [0.5, 1.2, 1.2]}))
    x2, w2, _, offs2 = _operands(n=16)
    pick.grouped_mm(x2, w2, offs2, timer=_scripted({"bf16": [0.5, 1.2, 1.2], "fp8": [0.9, 0.9, 0.9]}))
    assert pick.report()["bf16_shapes"] == {"4 x 32 x 48, rows <= 64": 1}
    assert pick.report()["fp8_shapes"] == {"4 x 16 x 48, rows <= 64": 1}


def test_a_path_failing_in_a_later_round_is_dropped_and_the_other_runs():
    """bf16 times fine once, then runs out of memory: it is dropped (one warning) and fp8 runs, even though
    bf16's one timing was faster."""
    x, w, _, offs = _operands()
    calls = {"bf16": 0}

    def timer(path, call):
        if path == "bf16":
            calls["bf16"] += 1
            if calls["bf16"] > 1:
                raise RuntimeError("out of memory")
            return 0.5
        return 1.0
    with pytest.warns(UserWarning, match="bf16 GEMM not timed"):
        pick.grouped_mm(x, w, offs, timer=timer)
    assert calls["bf16"] == 2 and pick.report()["fp8"] == 1


def test_no_rows_is_the_bf16_empty_product_and_not_a_shape():
    x, w, _, _ = _operands()
    w = w.requires_grad_()
    y = pick.grouped_mm(x[:0], w, torch.zeros(4, dtype=torch.int32), timer=_forced("fp8", []))
    assert y.shape == (0, 32) and y.grad_fn is not None and pick.report()["fp8"] == 0


def test_fastest_is_the_default_and_wired_only_under_the_fp8_backend():
    assert ExecutorOptions().fp8_expert_gemm == "fastest"
    spec, state = get_model("tiny-moe"), single_process_state()

    def experts(backend):
        return GroupedExperts(spec, ExecutorOptions(), state, 0, get_backend(backend), torch.device("cpu"),
                              torch.bfloat16)
    assert experts("torch-fp8")._gmm is pick.grouped_mm
    assert experts("torch")._gmm.__func__ is TorchBackend.grouped_mm


def _one_step(option: str, timer=None) -> float:
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    pick.TIMER = timer
    options = ExecutorOptions(kernel_backend="torch-fp8", fp8_expert_gemm=option)
    model = MoEGPT(spec, single_process_state(ParallelConfig(world_size=1)), options, 32, dtype=torch.bfloat16)
    batch = global_batch(spec.vocab_size, 32, 4, 1234, 0)
    return Trainer(model, lr=1e-2).step(micro_batches(batch, 1, 0, 2, "cpu")).loss


def test_tiny_moe_step_runs_each_verdict_and_the_profile_report_counts_the_bf16_shapes():
    """A training step of tiny-moe with precision fp8 and 'fastest': where fp8 is timed faster the loss is
    the 'torch' option's exactly; where bf16 is, it differs from it (the experts ran bf16, the dense
    linears fp8), and the rank's fp8 report (what the profile folds into Measurement.fp8_expert_gemms) says
    that tiny-moe's two expert GEMM shapes ran bf16."""
    torch_option = _one_step("torch")
    pick.reset_counts()
    assert _one_step("fastest", _forced("fp8", [])) == torch_option
    fp8_shapes = _fp8_report(torch.device("cpu"))["expert_gemm_shapes"]["fp8_shapes"]
    assert len([s for s in fp8_shapes if not s.startswith("dense")]) == 2  # the experts' two
    assert any(s.startswith("dense") for s in fp8_shapes)  # and the dense linears, chosen alike
    pick._VERDICTS.clear()
    pick.reset_counts()
    assert _one_step("fastest", _forced("bf16", [])) != torch_option
    shapes = _fp8_report(torch.device("cpu"))["expert_gemm_shapes"]
    experts = [s for s in shapes["bf16_shapes"] if not s.startswith("dense")]
    assert len(experts) == 2 and shapes["bf16"] > 2 and shapes["fp8"] == 0
    paths = expert_gemm_paths([{"fp8": {"expert_gemm_shapes": shapes}}] * 2)
    assert paths["bf16"] == shapes["bf16"] and all(calls % 2 == 0 for calls in paths["bf16_shapes"].values())
    measured = Measurement(ok=True, model="tiny-moe", step_time=1.0, tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0,
                           fp8_expert_gemms=paths)
    assert f"{shapes['bf16']} of {shapes['bf16']} GEMM shapes (experts, dense linears) ran in bf16" \
        in measured.summary()
    assert Measurement.from_dict(measured.to_dict()).fp8_expert_gemms == paths


@pytest.mark.parametrize("path", ["bf16", "fp8"])
def test_a_dense_linear_runs_the_chosen_path_and_fp8_dense_keeps_fp8(path, monkeypatch):
    """A dense linear of the fp8 backend gives exactly the chosen path's output and gradients (F.linear or the
    fp8 linear), its verdict kept per shape; FOLDTUNE_FP8_DENSE=fp8 runs fp8 without timing anything."""
    pick._VERDICTS.clear()
    pick.reset_counts()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 48, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(32, 48, generator=gen).to(torch.bfloat16).requires_grad_()
    timed = []
    y = pick.linear(x, w, timer=_forced(path, timed))
    reference = torch.nn.functional.linear if path == "bf16" else fp8_gemm.linear
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = reference(x2, w2)
    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(dy)
    y2.backward(dy)
    assert y.shape == (2, 8, 32) and torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    assert timed and pick.report()[path] == 1
    assert next(iter(pick.report()[f"{path}_shapes"])) == "dense 32 x 48, rows <= 16"
    timed.clear()
    pick.linear(x, w, timer=_forced(path, timed))
    assert not timed  # the verdict is kept
    monkeypatch.setenv("FOLDTUNE_FP8_DENSE", "fp8")
    pick._VERDICTS.clear()
    assert torch.equal(pick.linear(x, w, timer=_forced("bf16", timed)), fp8_gemm.linear(x, w)) and not timed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the expert GEMMs on a CUDA GPU")
def test_on_a_gpu_the_first_call_times_both_paths_and_keeps_its_choice():
    """On a CUDA GPU without an injected timer: a Qwen3-30B-A3B-like expert linear (128 experts of 768 x
    2048, 4096 tokens x top-8) is timed once, the verdict kept, and the call's output and gradients are
    exactly those of the path chosen."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    g, n, k, m = 128, 768, 2048, 32768
    counts = torch.full((g,), m // g, device=device)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(g, n, k, device=device, generator=gen).to(torch.bfloat16) * 0.02)
    dy = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    xg = x.clone().requires_grad_()
    y = pick.grouped_mm(xg, w, offs)
    y.backward(dy)
    (key, path), = pick._RUNS
    assert pick._VERDICTS[key] == path and path in ("bf16", "fp8")
    reference = TorchBackend().grouped_mm if path == "bf16" else fp8_gemm.grouped_mm
    xr, wr = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = reference(xr, wr, offs)
    yr.backward(dy)
    assert torch.equal(y, yr) and torch.equal(xg.grad, xr.grad) and torch.equal(w.grad, wr.grad)
    print(f"expert linear {g} x {n} x {k}, {m} rows: {path} kept")


def test_timing_inside_a_checkpointed_forward_leaves_the_recomputation_alone():
    """The first call may come from a forward under activation checkpointing: the timing's own autograd
    work (on its thread) is not counted by the checkpoint's saved-tensor hooks, so the recomputation
    matches and the gradients equal the uncheckpointed layer's."""
    x, w, dy, offs = _operands()
    timer = _forced("bf16", [])
    want = _grads(lambda *a: pick.grouped_mm(*a, timer=timer), x, w, dy, offs)
    pick._VERDICTS.clear()

    def checkpointed(xg, wg, offs_g):
        return torch.utils.checkpoint.checkpoint(lambda a, b: pick.grouped_mm(a, b, offs_g, timer=timer), xg, wg,
                                                 use_reentrant=False)
    got = _grads(checkpointed, x, w, dy, offs)
    assert all(torch.equal(g, wt) for g, wt in zip(got, want))
