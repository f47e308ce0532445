"""OLMoE's whole-width q/k RMSNorm (``qk_layernorm_scope='all'``) under TP equals the single-process run.

The norm of a token's q spans all heads, which TP splits: each rank sums the squares of its slice and the
sums are added over TP (forward and backward). Compared as in test_equivalence: losses, step-1 gradients
gathered to full shape, routed tokens, parameters after three AdamW steps (fp32, rtol 1e-4). The mutations
show the comparison sees the norm's span and the gradient's sum over TP.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor import tp_rms_norm
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.verify import Scenario, compare, layout_worker, reference

# OLMoE in miniature (pre-softmax top-k, whole-width q/k norms); GQA kept so that the k norm is narrower
OLMOE = dataclasses.replace(get_model("tiny-moe"), name="tiny-olmoe", qk_layernorm=True, qk_layernorm_scope="all",
                            moe_router_pre_softmax=True)
SCENARIO = Scenario("olmoe", OLMOE, ExecutorOptions(moe_aux_loss_coeff=1e-2), adam_eps=1e-5)
LAYOUTS = ("tp2 dp2", "tp2 cp2")  # sequence parallel is on with tp2; cp2 splits the sequence as well


@functools.cache
def _reference() -> dict:
    return reference(ParallelConfig(world_size=1), SCENARIO)


def _launch(labels: tuple[str, ...], world: int) -> list[dict]:
    _reference()  # imports torch.optim before the fork
    runs = [(ParallelConfig.parse(label, world_size=world), SCENARIO) for label in labels]
    launched = launch(layout_worker, world, (runs,), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    return launched.results[0]["results"]


def test_norm_weights_span_all_heads_and_per_head_norm_differs():
    ref = _reference()
    d = OLMOE.head_dim
    assert ref["params"]["layers.0.attention.q_norm.weight"].shape == (OLMOE.num_attention_heads * d,)
    assert ref["params"]["layers.0.attention.k_norm.weight"].shape == (OLMOE.num_kv_heads * d,)
    per_head = reference(ParallelConfig(world_size=1), dataclasses.replace(
        SCENARIO, model=dataclasses.replace(OLMOE, qk_layernorm_scope="head")))
    assert not torch.allclose(torch.tensor(per_head["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_tp2_with_dp_and_cp_matches_single_process():
    ref = _reference()
    for label, got in zip(LAYOUTS, _launch(LAYOUTS, 4)):
        assert compare(ref, got) == [], label


@pytest.mark.slow
def test_summing_the_forward_only_breaks_the_gradients(monkeypatch):
    # the backward's dot product left per rank (as an all-reduce with a pass-through backward would leave it)
    monkeypatch.setattr(tp_rms_norm, "_reduce_grad", lambda dot, group: dot)
    problems = compare(_reference(), _launch(("tp2",), 2)[0])
    assert any(p.startswith("grads") and "attention.w" in p for p in problems), problems


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_rank_norm_and_gradients_equal_autograd_of_the_formula(dtype):
    """The hand-written backward against autograd of the executor's rms_norm numerics, one rank."""
    from executor.parallel.groups import single_process_state

    group = single_process_state().tp
    gen = torch.Generator().manual_seed(0)
    x0, w0, g = (torch.randn(*shape, generator=gen) for shape in ((5, 3, 32), (32,), (5, 3, 32)))
    x0, w0, g = x0.to(dtype), (1 + 0.1 * w0).to(dtype), g.to(dtype)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    rx, rw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = tp_rms_norm.tp_rms_norm(x, w, 32, 1e-6, group)
    ref = torch.nn.functional.rms_norm(rx.float(), (32,), None, 1e-6).to(dtype) * rw
    (out.float() * g.float()).sum().backward()
    (ref.float() * g.float()).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, rx.grad, **tol)
    torch.testing.assert_close(w.grad, rw.grad, **tol)
