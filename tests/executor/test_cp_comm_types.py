"""The CP communication types on the executor's side (executor/parallel/cp_exchange.py, ring_attention.py): the
names every layer registers, the ring against causal attention over the whole sequence (outputs and gradients,
gloo), the all-to-all's head/sequence exchange and its inverse, the ring's flash blocks against its matmul
blocks, and the hierarchical sub-groups. Whole layouts against the single-process run are in
test_equivalence.py (``cp_comm`` layouts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from costmodel.context_parallel import CP_PRICING
from executor.attention import Attention
from executor.kernels import get_backend
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.parallel.context_parallel import cp_positions
from executor.parallel.cp_exchange import CP_EXCHANGES, cp_exchange, heads_to_sequence, sequence_to_heads
from executor.parallel.groups import Group, build_parallel_state
from executor.parallel.ring_attention import MATH, FLASH, check_flash_blocks, ring_attention
from spec.catalog import get_model
from spec.cp_comm_types import CP_COMM_KINDS, CP_COMM_TYPES, cp_split
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig
from spec.rank_groups import FoldedGroups


def test_the_executor_and_the_cost_model_hold_exactly_the_spec_names():
    assert CP_COMM_TYPES == tuple(k.name for k in CP_COMM_KINDS) == tuple(CP_EXCHANGES) == tuple(CP_PRICING)
    assert all(cp_exchange(name).name == name for name in CP_COMM_TYPES)
    with pytest.raises(InvalidConfigError, match="bogus"):
        cp_exchange("bogus")
    with pytest.raises(InvalidConfigError, match="cp_comm_type"):
        ParallelConfig(world_size=2, cp=2, cp_comm_type="bogus")


def test_cp_split_and_the_hierarchical_sub_groups():
    assert [cp_split(name, 8, (2, 4)) for name in CP_COMM_TYPES] == [(1, 1), (1, 8), (8, 1), (2, 4)]
    assert cp_split("p2p", 1, None) == (1, 1)
    # tp2 cp4: CP groups are ranks 2 apart; the all-to-all pairs the nearest two, the ring joins those 4 apart
    folded = FoldedGroups(ParallelConfig.parse("tp2 cp4 dp1 cp_comm=a2a+p2p:2x2"))
    assert folded.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert folded.cp_sub_groups("cp_a2a") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert folded.cp_sub_groups("cp_p2p") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert FoldedGroups(ParallelConfig.parse("cp2 dp1")).cp_sub_groups("cp_a2a") == [[0], [1]]


@pytest.mark.parametrize("v_dim", [16, 12])  # 12: multi-latent attention's narrower V (the matmul blocks)
def test_flash_blocks_equal_matmul_blocks_on_cpu(v_dim):
    check_flash_blocks(torch.float32, 16, "cpu")  # raises on a mismatch
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen), \
        torch.randn(1, 2, 8, v_dim, generator=gen)
    out, lse, _ = MATH[0](q, k, v, True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if v_dim == 16:
        torch.testing.assert_close(FLASH[0](q, k, v, True)[1], lse, rtol=1e-5, atol=1e-5)


def _full(world: int, v_dim: int):
    gen = torch.Generator().manual_seed(3)
    b, heads, kv_heads, d, s = 2, 4, 2, 16, 2 * world * 4
    q = torch.randn(b, heads, s, d, generator=gen)
    k = torch.randn(b, kv_heads, s, d, generator=gen)
    v = torch.randn(b, kv_heads, s, v_dim, generator=gen)
    return q, k, v, torch.randn(b, heads, s, v_dim, generator=gen)


def _ring_worker(rank: int, world: int) -> list:
    group = Group("cp", tuple(range(world)), rank, dist.group.WORLD)
    out = []
    for v_dim in (16, 12):
        q, k, v, g = _full(world, v_dim)
        pos = cp_positions(q.shape[2], world, rank)
        leaves = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        o = ring_attention(*leaves, group)
        o.backward(g[:, :, pos])
        out.append((pos, o.detach(), *(t.grad for t in leaves)))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_equals_causal_attention_over_the_whole_sequence(world):
    """Each rank's output and q/k/v gradients at its load-balanced positions equal those of causal GQA attention
    over the whole sequence, with V as wide as Q (flash blocks) and narrower (matmul blocks)."""
    launched = launch(_ring_worker, world, (), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    for i, v_dim in enumerate((16, 12)):
        q, k, v, g = _full(world, v_dim)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ref = scores.softmax(-1) @ v.repeat_interleave(2, 1)
        ref.backward(g)
        for rank_results in launched.results:
            pos, out, dq, dk, dv = rank_results[i]
            for got, want in ((out, ref.detach()), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
                torch.testing.assert_close(got, want[:, :, pos], rtol=1e-5, atol=1e-5)


def _a2a_worker(rank: int, world: int) -> tuple:
    group = Group("cp", tuple(range(world)), rank, dist.group.WORLD)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 8, 4 * world, 3, generator=gen)  # 8 heads, 2·world chunks of 2 tokens
    pos = cp_positions(x.shape[2], world, rank)
    local = x[:, :, pos].clone().requires_grad_()
    spread = heads_to_sequence(local, group)
    back = sequence_to_heads(spread * 2, group)
    back.sum().backward()
    return spread.detach(), back.detach(), local.grad, pos, x


def test_the_all_to_all_scatters_heads_gathers_the_sequence_in_order_and_inverts():
    world = 4
    launched = launch(_a2a_worker, world, (), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    for rank, (spread, back, grad, pos, x) in enumerate(launched.results):
        # this rank's 2 of the 8 heads over the whole sequence, in global order
        torch.testing.assert_close(spread, x[:, 2 * rank:2 * rank + 2])
        torch.testing.assert_close(back, 2 * x[:, :, pos])  # the inverse brings every head home
        torch.testing.assert_close(grad, torch.full_like(grad, 2.0))  # d(sum of 2·x)/dx through both exchanges


def test_a_windowed_layer_refuses_the_ring_naming_the_rule():
    windowed = dataclasses.replace(get_model("tiny-moe"), window_size=(4, 0))
    state = build_parallel_state(ParallelConfig(world_size=2, cp=2, cp_comm_type="p2p"), 0, communicators=False)
    with pytest.raises(InvalidConfigError, match="executor_cp_ring_attention"):
        Attention(windowed, ExecutorOptions(), state, 0, get_backend("torch"), torch.device("cpu"), torch.float32)
