"""Packed micro-batches in the model (executor/documents.py): on real text, every document of a packed row gets
the loss and gradients it gets when run alone (attention stays inside documents, RoPE restarts per document,
padding and document ends carry no loss); plain causal attention over the same row does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor.data import packed_micro_batches
from executor.dataset.packing import IGNORE
from executor.dataset.prepare import prepare_dataset
from executor.dataset.sampler import BatchSampler, TokenDataset
from executor.documents import check_flex, packed_refusal
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train.loop import TrainConfig, train_local, train_worker
from spec.errors import SpecError
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

REPO = Path(__file__).resolve().parents[2]
SEQ = 256
TINY = get_model("tiny-moe")
# GPT-OSS's attention: learned sinks and a 4-token window on every other layer (the masked path)
SINKS = dataclasses.replace(TINY, name="tiny-moe-sinks", softmax_type="learnable", window_size=(4, 0),
                            window_attn_skip_freq=2)
NO_AUX = ExecutorOptions(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)  # batch-wide terms: not per document


def packed_corpus(tmp: Path, seq: int) -> Path:
    """Real text — the README's words — cut into 80 documents of 8 to 35 words, one file each, packed into rows of
    ``seq`` + 1 tokens. The lengths are fixed here, not the README's sentences': how long those run changes with
    every edit of the README, and a row must hold several documents whatever it says."""
    src = tmp / "sentences"
    src.mkdir(exist_ok=True)
    words = (REPO / "README.md").read_text().split()
    start = 0
    for i in range(80):
        n = 8 + (i * 7) % 28
        (src / f"p{i:03d}.txt").write_text(" ".join(words[start:start + n]))
        start += n
    out = tmp / "packed"
    prepare_dataset([str(src)], str(out), seq_length=seq, overwrite=True)
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Two packed rows of real text holding several documents each, and padding."""
    ds = TokenDataset(packed_corpus(tmp_path_factory.mktemp("pack"), SEQ))
    sampler = BatchSampler(ds.splits["train"], SEQ, 2, shuffle=False)
    for position in range(sampler.batches_per_epoch()):
        tokens, flags = sampler.packed_batch(position)
        micro = packed_micro_batches(tokens, flags, 2)
        segments = micro[0][2]
        if all(len(set(row.tolist())) >= 3 for row in segments):
            return micro[0]
    pytest.fail("no batch of rows with several documents")


def _documents(segments_row: torch.Tensor, labels_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) input positions of the segments with at least one label (documents, not padding)."""
    out = []
    for seg in sorted(set(segments_row.tolist())):
        where = torch.nonzero(segments_row == seg).flatten()
        a, b = int(where[0]), int(where[-1]) + 1
        if (labels_row[a:b] != IGNORE).any():
            out.append((a, b))
    return out


@pytest.mark.parametrize("spec", [TINY, SINKS], ids=["plain", "window+sinks"])
def test_each_packed_document_equals_its_run_alone(rows, spec):
    torch.manual_seed(0)
    model = MoEGPT(spec, single_process_state(), NO_AUX, SEQ)
    ids, labels, segments = rows
    out = model(ids, labels, segments)
    out.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = int((labels != IGNORE).sum())
    alone_grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    documents = 0
    for r in range(ids.shape[0]):
        for a, b in _documents(segments[r], labels[r]):
            documents += 1
            n = int((labels[r, a:b] != IGNORE).sum())  # the document's last input has no target in it
            alone_ids, alone_labels = ids[r:r + 1, a:a + n], labels[r:r + 1, a:a + n]
            assert (alone_labels != IGNORE).all()
            single = MoEGPT(spec, single_process_state(), NO_AUX, n)  # its masks are built for n tokens
            single.load_state_dict(model.state_dict())
            alone = single(alone_ids, alone_labels)
            (alone.loss * n / total).backward()
            for name, p in single.named_parameters():
                alone_grads[name] += p.grad
            # the packed row with every other document's labels ignored: this document's mean loss
            only = torch.full_like(labels, IGNORE)
            only[r, a:a + n] = labels[r, a:a + n]
            with torch.no_grad():
                torch.testing.assert_close(model(ids, only, segments).ce, alone.ce, rtol=1e-5, atol=1e-6)
    assert documents >= 4
    for name, grad in packed_grads.items():  # the packed mean's gradient: the documents' token-weighted sum
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the same row as one causal sequence mixes documents: another loss
        unmasked = model(ids, labels).ce
        # (by little with a 4-token window on every other layer and random weights: the mean is ~log(vocab) either
        # way; the same process computes both in fp32, so 1e-5 is far above its noise)
        assert not torch.allclose(unmasked, out.ce, rtol=1e-5, atol=0.0)


def test_padding_and_document_ends_carry_no_loss(rows):
    torch.manual_seed(0)
    model = MoEGPT(TINY, single_process_state(), NO_AUX, SEQ)
    ids, labels, segments = rows
    with torch.no_grad():
        base = model(ids, labels, segments).ce
        scrambled = ids.clone()
        pad = labels == IGNORE  # inputs whose target is padding or another document: their own tokens may change
        # later padding tokens attend only to padding: changing them changes no labelled token's loss
        last = segments == segments[:, -1:]
        is_pad = last & pad
        scrambled[is_pad] = (scrambled[is_pad] + 17) % 256
        torch.testing.assert_close(model(scrambled, labels, segments).ce, base)


def test_layouts_packed_sequences_do_not_run_on_are_refused_by_name():
    assert packed_refusal(TINY, ParallelConfig(world_size=1), ExecutorOptions()) is None
    assert "pp = 1" in packed_refusal(TINY, ParallelConfig.parse("pp2 dp1"), ExecutorOptions())
    mtp = dataclasses.replace(TINY, mtp_num_layers=1)
    assert "multi-token" in packed_refusal(mtp, ParallelConfig(world_size=1), ExecutorOptions())


def test_a_packed_training_run_on_real_text_learns(tmp_path):
    """train_worker on a packed dataset: packed micro-batches all the way, evaluation included."""
    torch.set_num_threads(1)
    data = packed_corpus(tmp_path, SEQ)
    cfg = TrainConfig(data_path=str(data), steps=6, seq_length=SEQ, global_batch_size=4, lr=3e-3, warmup_steps=1,
                      eval_batches=1)
    report = train_worker(0, 1, TINY, ParallelConfig(world_size=1, micro_batch_size=2), ExecutorOptions(), cfg)
    losses = [m.ce for m in report.metrics]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert report.metrics[-1].eval_loss < report.initial_eval_loss


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward runs on CUDA only")
def test_flex_document_attention_equals_the_masked_path_on_cuda():
    """The CUDA path (flex attention's block mask), output and gradients, against the masked SDPA."""
    for dtype in (torch.float32, torch.bfloat16):
        check_flex(dtype, 64, "cuda")


def test_a_packed_dataset_refuses_another_sequence_length_before_any_rank_starts(tmp_path):
    data = packed_corpus(tmp_path, SEQ)
    cfg = TrainConfig(data_path=str(data), steps=1, seq_length=128, global_batch_size=2)
    with pytest.raises(SpecError, match="packed for seq_length 256, not 128"):
        train_local(TINY, ParallelConfig(world_size=1), cfg)
    with pytest.raises(SpecError, match="pp = 1"):
        train_local(TINY, ParallelConfig.parse("pp2 dp1"), dataclasses.replace(cfg, seq_length=SEQ))
