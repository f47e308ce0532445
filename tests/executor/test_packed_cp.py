"""Context parallelism with packed sequences: the ring's document-masked blocks and the all-gather type's chunked
core against attention within documents over the whole sequence (with the chunk pairs no document spans skipped,
counted on documents aligned to the chunks), and whole layouts of every CP communication type (EP and TP folded in) on
packed batches against the single-process run (gloo, fp32; executor/verify.py's comparison)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from executor.data import packed_global_batch, packed_micro_batches
from executor.dataset.packing import IGNORE, split_rows
from executor.dataset.sampler import BatchSampler, TokenDataset
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.documents import Documents
from executor.parallel.context_parallel import CHUNK_PAIRS, all_positions, cp_positions
from executor.parallel.cp_exchange import document_chunk_attention
from executor.parallel.groups import Group, build_parallel_state, single_process_state
from executor.parallel.ring_attention import ring_attention
from executor.verify import Scenario, compare, layout_worker, reference
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from tests.executor.test_packed_model import packed_corpus

TINY = get_model("tiny-moe")
KV4 = dataclasses.replace(TINY, name="tiny-moe-kv4", num_query_groups=4)  # a2a under tp2·cp2 splits KV heads by 4
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _segments(s: int) -> torch.Tensor:
    rows, flags = packed_global_batch(256, s, 2, seed=1, step=0, max_document=s // 3)
    return split_rows(rows, flags)[2]


def _full(world: int):
    gen = torch.Generator().manual_seed(3)
    b, heads, kv_heads, d, s = 2, 4, 2, 16, 2 * world * 4
    return (torch.randn(b, heads, s, d, generator=gen), torch.randn(b, kv_heads, s, d, generator=gen),
            torch.randn(b, kv_heads, s, d, generator=gen), torch.randn(b, heads, s, d, generator=gen), _segments(s))


def _ring_worker(rank: int, world: int) -> tuple:
    group = Group("cp", tuple(range(world)), rank, dist.group.WORLD)
    q, k, v, g, segments = _full(world)
    pos = cp_positions(q.shape[2], world, rank)
    leaves = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    o = ring_attention(*leaves, group, segments)
    o.backward(g[:, :, pos])
    return pos, o.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_on_packed_segments_equals_attention_within_documents(world):
    launched = launch(_ring_worker, world, (), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    q, k, v, g, segments = _full(world)
    assert all(len(set(row.tolist())) > 2 for row in segments)  # several documents a row
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
    ref = scores.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    ref.backward(g)
    for pos, out, dq, dk, dv in launched.results:
        for got, want in ((out, ref.detach()), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, want[:, :, pos], rtol=1e-5, atol=1e-5)


# documents on the chunks of cp2's split (4 chunks of 4 at s = 16): chunk 0, chunks 1-2, chunk 3. Of the 10 causal
# chunk pairs (4 diagonal, 6 below), 5 have a document spanning them: (0,0), (1,1), (2,1), (2,2), (3,3)
ALIGNED = torch.tensor([[1] * 4 + [2] * 8 + [3] * 4, [4] * 4 + [5] * 8 + [6] * 4])


def _aligned_inputs():
    gen = torch.Generator().manual_seed(4)
    b, heads, kv_heads, d, s = 2, 4, 2, 16, 16
    return (torch.randn(b, heads, s, d, generator=gen), torch.randn(b, kv_heads, s, d, generator=gen),
            torch.randn(b, kv_heads, s, d, generator=gen), torch.randn(b, heads, s, d, generator=gen), ALIGNED)


def _within_documents(q, k, v, g, segments):
    """Reference: attention within documents over the whole sequence; (output, dq, dk, dv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & torch.ones(s, s, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    ref = scores.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1) @ v.repeat_interleave(groups, 1)
    ref.backward(g)
    return ref.detach(), q.grad, k.grad, v.grad


def _aligned_ring_worker(rank: int, world: int) -> tuple:
    group = Group("cp", tuple(range(world)), rank, dist.group.WORLD)
    q, k, v, g, segments = _aligned_inputs()
    pos = cp_positions(q.shape[2], world, rank)
    leaves = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    CHUNK_PAIRS.update(computed=0, skipped=0)
    o = ring_attention(*leaves, group, segments)
    counted = dict(CHUNK_PAIRS)
    o.backward(g[:, :, pos])
    return pos, counted, o.detach(), *(t.grad for t in leaves)


def test_the_ring_skips_the_chunk_pairs_no_document_spans():
    launched = launch(_aligned_ring_worker, 2, (), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    want = _within_documents(*_aligned_inputs())
    total = {"computed": 0, "skipped": 0}
    for pos, counted, *got in launched.results:
        for name in total:
            total[name] += counted[name]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b[:, :, pos], rtol=1e-5, atol=1e-5)
    assert total == {"computed": 5, "skipped": 5}


@pytest.mark.parametrize("cp", [2, 4])
def test_the_gathered_path_attends_only_the_key_chunks_a_document_spans(cp):
    """The all-gather type's packed core for each CP rank, the gather done in place: output and gradients equal
    attention within documents, and the causal chunk pairs no document spans are skipped: cp2 (chunks of 4) 5
    of 10; cp4 (chunks of 2: documents on chunks 0-1, 2-5, 6-7) 3 + 10 + 3 = 16 of 36 computed."""
    q, k, v, g, segments = _aligned_inputs()
    want = _within_documents(q, k, v, g, segments)
    s = q.shape[2]
    gathered = all_positions(s, cp)
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()  # every rank's gradients add up here
    CHUNK_PAIRS.update(computed=0, skipped=0)
    for rank in range(cp):
        pos = cp_positions(s, cp, rank)
        mine = q[:, :, pos].clone().requires_grad_()
        mask = Documents(segments).mask(pos, gathered, None)
        out = document_chunk_attention(mine, k[:, :, gathered], v[:, :, gathered], mask, cp, rank, None)
        out.backward(g[:, :, pos])
        torch.testing.assert_close(out.detach(), want[0][:, :, pos], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.grad, want[1][:, :, pos], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, want[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.grad, want[3], rtol=1e-5, atol=1e-5)
    assert CHUNK_PAIRS == ({"computed": 5, "skipped": 5} if cp == 2 else {"computed": 16, "skipped": 20})


# Adam's eps as test_equivalence's scenarios take it: a weight whose gradient is ~1e-7 (cancellations) moves by
# fp32 reduction-order noise that eps = 1e-6 amplifies past the parameters' tolerance within a few steps.
# Two steps, as test_equivalence's layout runs: the second trains on the state the first left.
PACKED = Scenario("packed", TINY, LOSSES, packed=True, adam_eps=1e-5, steps=2)
PACKED_KV4 = Scenario("packed-kv4", KV4, LOSSES, packed=True, adam_eps=1e-5, steps=2)


_REFERENCES: dict[str, dict] = {}


def _reference(scenario: Scenario) -> dict:
    """The single-process run of ``scenario``, once per session: the layouts here share the dispatcher and the
    optimizer's dtypes that :func:`executor.verify.reference` takes from a layout."""
    if scenario.name not in _REFERENCES:
        _REFERENCES[scenario.name] = reference(ParallelConfig(world_size=1), scenario)
    return _REFERENCES[scenario.name]


def _layouts_match(world: int, labels: list[tuple[str, Scenario]]):
    configs = [ParallelConfig.parse(label, world_size=world) for label, _ in labels]
    references = [_reference(scenario) for _, scenario in labels]
    launched = launch(layout_worker, world, ([(c, s) for c, (_, s) in zip(configs, labels)],), backend="gloo",
                      timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    failures = {label: compare(ref, got)[:6] for (label, _), ref, got in
                zip(labels, references, launched.results[0]["results"]) if compare(ref, got)}
    assert not failures, failures


def test_the_packed_reference_sees_documents():
    """The scenario's batches hold several documents a row (else the layouts below would test nothing new)."""
    rows, flags = packed_global_batch(256, PACKED.seq_length, PACKED.global_batch_size, 0, 0)
    segments = split_rows(rows, flags)[2]
    assert all(len(set(row.tolist())) >= 3 for row in segments)


def test_cp2_of_every_comm_type_on_packed_sequences_matches_single_process():
    _layouts_match(2, [("cp2 dp1 cp_comm=allgather", PACKED), ("cp2 dp1 cp_comm=p2p", PACKED),
                       ("cp2 dp1 cp_comm=a2a", PACKED)])


@pytest.mark.slow
def test_cp2_with_tp_and_ep_folded_and_cp4_of_every_comm_type_on_packed_sequences_match_single_process():
    _layouts_match(4, [("tp2 cp2 ep4 etp1 cp_comm=p2p", PACKED), ("tp2 cp2 ep2 cp_comm=allgather", PACKED),
                       ("tp2 cp2 ep2 cp_comm=a2a", PACKED_KV4), ("cp4 ep2 cp_comm=a2a+p2p:2x2", PACKED),
                       ("cp4 cp_comm=p2p", PACKED), ("cp4 ep4 cp_comm=allgather", PACKED),
                       ("cp4 cp_comm=a2a", PACKED_KV4)])


REAL_LAYOUTS = ["cp2 dp1 cp_comm=p2p", "cp2 dp1 cp_comm=allgather", "tp2 ep2 dp1"]


def _document_losses(model, micro) -> list[float]:
    """Each labelled document's mean loss in the packed rows (every other document's labels ignored): the mean
    over the world's ranks of their ``ce``, as a step averages it (dp = 1: CP ranks' shares, TP ranks' copies)."""
    ids, labels, segments = micro
    losses = []
    with torch.no_grad():
        for r in range(ids.shape[0]):
            for seg in sorted(set(segments[r].tolist())):
                only = torch.full_like(labels, IGNORE)
                where = (segments[r] == seg) & (labels[r] != IGNORE)
                if where.any():
                    only[r, where] = labels[r, where]
                    ce = model(ids, only, segments).ce.clone()
                    dist.all_reduce(ce)
                    losses.append(float(ce) / dist.get_world_size())
    return losses


def _real_text_worker(rank: int, world: int, micro) -> list:
    out = []
    for label in REAL_LAYOUTS:
        config = ParallelConfig.parse(label, world_size=world)
        torch.manual_seed(0)
        model = MoEGPT(TINY, build_parallel_state(config, rank), LOSSES, SEQ_REAL)
        out.append(_document_losses(model, micro))
    return out


SEQ_REAL = 256


def test_packed_real_text_on_cpu_ranks_equals_each_document_run_alone(tmp_path):
    """The README's sentences packed into rows (tests/executor/test_packed_model.py's corpus) on two gloo ranks
    (cp2 with the ring and with the all-gather; tp2 with ep2): every document's loss in the packed rows equals
    the loss of that document run alone on one process."""
    ds = TokenDataset(packed_corpus(tmp_path, SEQ_REAL))
    sampler = BatchSampler(ds.splits["train"], SEQ_REAL, 2, shuffle=False)
    for position in range(sampler.batches_per_epoch()):  # rows holding several documents each
        micro = packed_micro_batches(*sampler.packed_batch(position), 2)[0]
        if all(len(set(row.tolist())) >= 3 for row in micro[2]):
            break
    ids, labels, segments = micro
    alone = []
    for r in range(ids.shape[0]):
        for seg in sorted(set(segments[r].tolist())):
            where = (segments[r] == seg) & (labels[r] != IGNORE)
            if where.any():
                cols = torch.nonzero(where).flatten()
                single = MoEGPT(TINY, single_process_state(), LOSSES, int(cols.numel()))
                with torch.no_grad():
                    alone.append(float(single(ids[r:r + 1, cols], labels[r:r + 1, cols]).ce))
    assert len(alone) >= 3
    launched = launch(_real_text_worker, 2, (micro,), backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for label, losses in zip(REAL_LAYOUTS, launched.results[0]):
        assert losses == pytest.approx(alone, rel=1e-5), label
