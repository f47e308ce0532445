"""The experts' one-node FFN (executor/grouped_swiglu.py) against autograd through the same ops."""

import dataclasses

import pytest
import torch

from executor.grouped_swiglu import grouped_swiglu
from executor.kernels import get_backend
from executor.kernels.triton_swiglu import reference
from executor.moe import GroupedExperts
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from spec.catalog import get_model


def _autograd_ffn(x, w13, w2, offs):
    gate_up = torch._grouped_mm(x, w13.flatten(1, 2).transpose(-2, -1), offs=offs)
    return torch._grouped_mm(reference(gate_up), w2.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("recompute_act", [False, True])
def test_one_node_ffn_equals_autograd_with_an_empty_expert(recompute_act):
    torch.manual_seed(0)
    e, h, f = 4, 16, 24
    counts = torch.tensor([10, 0, 17, 13])  # an expert with no rows
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), h, requires_grad=True)
    w13 = torch.randn(e, 2, f, h, requires_grad=True)
    w2 = torch.randn(e, h, f, requires_grad=True)
    gy = torch.randn(x.shape[0], h)
    y = grouped_swiglu(x, w13, w2, offs, recompute_act)
    want = _autograd_ffn(x, w13, w2, offs)
    torch.testing.assert_close(y, want)
    for got, ref in zip(torch.autograd.grad(y, (x, w13, w2), gy), torch.autograd.grad(want, (x, w13, w2), gy)):
        torch.testing.assert_close(got, ref)


def test_the_experts_run_as_one_node_only_where_the_plain_torch_backend_runs_them():
    spec = get_model("tiny-moe")
    state, dev = single_process_state(), torch.device("cpu")
    x = torch.randn(12, spec.hidden_size, requires_grad=True)
    counts = torch.tensor([3] * 4 + [0] * (spec.num_experts - 4))
    plain = GroupedExperts(spec, ExecutorOptions(), state, 0, get_backend("torch"), dev, torch.float32)
    assert type(plain(x, counts).grad_fn).__name__ == "_GroupedSwiGLUBackward"
    biased = dataclasses.replace(spec, add_bias_linear=True)
    graph = GroupedExperts(biased, ExecutorOptions(), state, 0, get_backend("torch"), dev, torch.float32)
    assert type(graph(x, counts).grad_fn).__name__ != "_GroupedSwiGLUBackward"
