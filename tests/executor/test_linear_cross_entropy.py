"""The fused, vocabulary-blocked output layer + cross-entropy equals the unfused path (values, input and
weight gradients) under tp1 and tp2 with a padded vocabulary, and saves no [tokens × vocab] tensor; with
``keep_bytes`` at or above its logits' bytes it keeps exactly those logits instead, equal again."""

from __future__ import annotations

import pytest
import torch

from spec.parallel_config import ParallelConfig
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state, single_process_state
from executor.parallel.linear_cross_entropy import block_rows, linear_cross_entropy
from executor.parallel.vocab import output_cross_entropy
from spec.errors import SpecError

S, B, H = 8, 2, 64
PADDED = 256  # vocabulary rows incl. padding: a multiple of 128·tp for tp 1 and 2
# 250: rank 1 of tp2 owns 122 real rows; 100: it owns none (only padding)
VOCABS = (250, 100)
# logits per block: everything at once; 37 rows (divides neither 250, 122 nor 128); fewer than one token
# row per block (a single vocabulary row per block)
CHUNKS = (10**9, S * B * 37, 5)
# keep_bytes: never; the whole logits of the largest rank share (250 rows, 4-byte logits) exactly; always
KEEPS = (0, S * B * 250 * 4, 10**12)


def _inputs(vocab: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(S, B, H, generator=gen)
    weight = torch.randn(PADDED, H, generator=gen) * 0.5
    weight[vocab:] = 0  # padded rows, as the executor initialises them
    labels = torch.randint(0, vocab, (S, B), generator=gen)
    return hidden.to(dtype), weight.to(dtype), labels


def _loss_and_grads(hidden, weight, labels, vocab, state, chunk_logits, keep_bytes=0):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    per_token = output_cross_entropy(hidden, weight, labels, vocab, PADDED, state, chunk_logits, keep_bytes)
    # a non-uniform incoming gradient, so the per-token scaling of the softmax gradient is checked
    scale = torch.linspace(0.5, 1.5, per_token.numel(), device=per_token.device).view_as(per_token)
    (per_token * scale).sum().backward()
    return per_token.detach(), hidden.grad, weight.grad


def _differences(state, dtype=torch.float32, rtol=1e-4, atol=1e-5) -> list[str]:
    """Every (vocab, chunk) whose loss or gradients differ from the unfused path on this rank."""
    problems = []
    per_rank = PADDED // state.tp.size
    rows = slice(state.tp.rank * per_rank, (state.tp.rank + 1) * per_rank)
    for vocab in VOCABS:
        hidden, weight, labels = _inputs(vocab, dtype)
        expected = _loss_and_grads(hidden, weight[rows], labels, vocab, state, 0)
        for chunk in CHUNKS:
            for keep in KEEPS:
                got = _loss_and_grads(hidden, weight[rows], labels, vocab, state, chunk, keep)
                where = f"tp rank {state.tp.rank} vocab {vocab} chunk {chunk} keep {keep}"
                for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, expected):
                    if a.dtype != b.dtype or not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
                        err = (a.float() - b.float()).abs().max().item()
                        problems.append(f"{where}: {name} differs by {err:.2e}")
                first_padded = max(0, vocab - rows.start)  # this rank's padded rows start here
                if got[2][first_padded:].count_nonzero():
                    problems.append(f"{where}: padded rows got a gradient")
    return problems


def test_fused_equals_unfused_single_rank():
    assert _differences(single_process_state()) == []


def test_fused_equals_unfused_in_bf16_within_rounding():
    # bf16 logits and gradients round differently per block; the loss stays within bf16 resolution
    assert _differences(single_process_state(), torch.bfloat16, rtol=2e-2, atol=2e-2) == []


def _tp2_worker(rank: int, world: int) -> list[str]:
    return _differences(build_parallel_state(ParallelConfig(world_size=2, tp=2), rank))


@pytest.mark.slow
def test_fused_equals_unfused_vocab_parallel_tp2():
    # fork is quick, but not after this process has started CUDA (a GPU machine's earlier tests): CUDA's
    # threads do not survive a fork
    start = "spawn" if torch.cuda.is_initialized() else "fork"
    launched = launch(_tp2_worker, 2, backend="gloo", timeout_s=120, start_method=start)
    assert launched.ok, launched.failure_reason
    assert launched.results == [[], []]


def _saved_vocab_shaped(chunk_logits: int, keep_bytes: int = 0) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for the output layer + loss that have a vocabulary dimension
    (padded, or the 250 real rows), the output weight itself aside."""
    hidden, weight, labels = _inputs(250)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr() and (PADDED in t.shape or 250 in t.shape):
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = output_cross_entropy(hidden, weight, labels, 250, PADDED, single_process_state(), chunk_logits,
                                    keep_bytes).mean()
    loss.backward()
    return saved


def test_fused_path_saves_no_logits():
    assert _saved_vocab_shaped(S * B * 37) == []
    assert _saved_vocab_shaped(10**9) == []  # one block: still nothing of [tokens, vocab] kept
    # the unfused path keeps [s, b, vocab] tensors (logits and their fp32 copies): what the check catches
    assert (S, B, PADDED) in _saved_vocab_shaped(0)


def test_kept_logits_are_the_real_rows_and_only_within_the_budget():
    logits_bytes = S * B * 250 * 4  # fp32 inputs: the real rows only, padded rows never multiplied
    assert _saved_vocab_shaped(S * B * 37, logits_bytes) == [(S * B, 250)]
    assert _saved_vocab_shaped(S * B * 37, logits_bytes - 1) == []


def test_kept_logits_refuse_a_second_backward():
    # the backward turns the kept logits into their gradient in place: a second backward must fail, not
    # silently reuse gradients as logits
    hidden, weight, labels = _inputs(250)
    hidden.requires_grad_(True)
    loss = output_cross_entropy(hidden, weight, labels, 250, PADDED, single_process_state(), 10**9, 10**12).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_block_rows_bounds_the_logits_held():
    assert block_rows(4096, 151936, 2**26) == 16384  # Qwen3 at tp1, seq 4096, mbs 1: 10 blocks
    assert block_rows(16, 128, 16 * 37) == 37
    assert block_rows(16, 128, 5) == 1  # never zero rows
    assert block_rows(16, 128, 10**9) == 128


def test_chunk_logits_is_checked():
    with pytest.raises(SpecError):
        ExecutorOptions(cross_entropy_chunk_logits=-1)
    with pytest.raises(SpecError):
        ExecutorOptions(cross_entropy_keep_logits=-1)
    hidden, weight, labels = _inputs(250)
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden.view(-1, H), weight, labels.view(-1), 250, PADDED, single_process_state(), 0)
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden.view(-1, H), weight, labels.view(-1), 250, PADDED, single_process_state(), 5, -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton loss kernels need a CUDA GPU")
def test_kept_logits_equal_the_blocked_path_on_the_kernels():
    # CUDA, bf16, the Triton stats and gradient kernels: the whole kept logits in one pass each way against
    # 37-row blocks computed again in backward (input gradient summed in fp32 there, one GEMM here)
    hidden, weight, labels = (t.cuda() for t in _inputs(250, torch.bfloat16))
    state = single_process_state()
    blocked = _loss_and_grads(hidden, weight, labels, 250, state, S * B * 37, 0)
    kept = _loss_and_grads(hidden, weight, labels, 250, state, S * B * 37, 10**12)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), kept, blocked):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
