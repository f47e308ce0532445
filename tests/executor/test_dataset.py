"""Byte-level tokenizer, prepared shards and the resumable DP-aware sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from api.cli.main import main
from spec.errors import FoldtuneError
from executor.data import micro_batches
from executor.dataset import tokenizer
from executor.dataset.prepare import DatasetError, prepare_dataset
from executor.dataset.sampler import BatchSampler, TokenDataset

TEXT = ("Parallel folding decouples the attention layout from the expert layout. "
        "Ünïcödé bytes survive the round trip — even em dashes and 漢字.\n")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"doc{i}.md").write_text(f"# Document {i}\n\n" + TEXT * (20 + 5 * i))
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    return src


def test_round_trip_text_tokens_text():
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == torch.uint8 and ids.numel() == len(TEXT.encode())
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(tokenizer.encode("")) == ""


def test_prepared_shards_hold_every_document_split_into_train_and_heldout(corpus, tmp_path):
    out = tmp_path / "data"
    done = prepare_dataset([str(corpus)], str(out), heldout_fraction=0.1, shard_tokens=1000)
    assert done.documents == 3
    ds = TokenDataset(out)
    assert ds.vocab_size == 256 and ds.tokenizer == "bytes"
    train, held = ds.splits["train"], ds.splits["heldout"]
    assert len(train.shards) > 1  # several shards, read back as one stream
    assert train.tokens == done.train_tokens and held.tokens == done.heldout_tokens
    expected = sum(len((p.read_text().strip() + "\n\n").encode()) for p in corpus.glob("*.md"))
    assert train.tokens + held.tokens == expected
    assert 0.08 < held.tokens / expected < 0.12
    whole = tokenizer.decode(train.read(0, train.tokens))
    assert whole.startswith("# Document 0") and "Document 2" in whole


def test_batches_are_deterministic_and_cover_an_epoch(corpus, tmp_path):
    prepare_dataset([str(corpus)], str(tmp_path / "d"))
    stream = TokenDataset(tmp_path / "d").splits["train"]
    a, b = BatchSampler(stream, 32, 8, seed=3), BatchSampler(stream, 32, 8, seed=3)
    for p in range(5):
        assert torch.equal(a.batch(p), b.batch(p))
    assert not torch.equal(a.batch(0), BatchSampler(stream, 32, 8, seed=4).batch(0))
    batch = a.batch(0)
    assert batch.shape == (8, 33) and batch.dtype == torch.int64
    drawn = [a._window(d) for d in range(a.num_windows)]  # one epoch draws every window exactly once
    assert sorted(drawn) == list(range(a.num_windows)) and drawn != sorted(drawn)
    first = a._window(0) * 32
    assert torch.equal(batch[0], stream.read(first, 33))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_dp_slices_concatenate_to_the_undivided_batch(corpus, tmp_path, dp):
    prepare_dataset([str(corpus)], str(tmp_path / "d"))
    sampler = BatchSampler(TokenDataset(tmp_path / "d").splits["train"], 16, 8, seed=1)
    for p in (0, 7, 40):  # 40 lies in a later epoch
        whole = sampler.batch(p)
        parts = [sampler.batch(p, dp, r) for r in range(dp)]
        assert torch.equal(torch.cat(parts), whole)
        # the same rows executor.data.micro_batches gives that rank from the whole batch
        for r in range(dp):
            ids = torch.cat([m[0] for m in micro_batches(whole, dp, r, 1)])
            assert torch.equal(ids, parts[r][:, :-1])


def test_resume_from_a_position_equals_the_uninterrupted_stream(corpus, tmp_path):
    prepare_dataset([str(corpus)], str(tmp_path / "d"))
    stream = TokenDataset(tmp_path / "d").splits["train"]
    straight = BatchSampler(stream, 16, 4, seed=9)
    reference = [straight.batch(p) for p in range(30)]
    resumed = BatchSampler(stream, 16, 4, seed=9)  # a fresh process knows only the position
    assert all(torch.equal(resumed.batch(p, 2, 1), reference[p][2:]) for p in range(17, 30))


def test_bad_paths_and_sizes_raise_one_clear_error(corpus, tmp_path):
    with pytest.raises(DatasetError, match="do not exist: /no/such"):
        prepare_dataset(["/no/such"], str(tmp_path / "x"))
    with pytest.raises(DatasetError, match="no text"):
        empty = tmp_path / "empty"
        empty.mkdir()
        prepare_dataset([str(empty)], str(tmp_path / "x"))
    with pytest.raises(DatasetError, match="heldout_fraction"):
        prepare_dataset([str(corpus)], str(tmp_path / "x"), heldout_fraction=1.5)
    with pytest.raises(DatasetError, match="not a prepared dataset"):
        TokenDataset(tmp_path / "nothing")
    prepare_dataset([str(corpus)], str(tmp_path / "d"))
    with pytest.raises(DatasetError, match="already holds a dataset"):
        prepare_dataset([str(corpus)], str(tmp_path / "d"))
    stream = TokenDataset(tmp_path / "d").splits["heldout"]
    with pytest.raises(DatasetError, match="no window of seq_length 100000"):
        BatchSampler(stream, 100_000, 1)
    with pytest.raises(DatasetError, match=r"global_batch_size \(6\) is not divisible by micro_batch_size·dp"):
        BatchSampler(stream, 8, 6).batch(0, 4, 0)
    (tmp_path / "d" / "train-00000.bin").write_bytes(b"short")
    with pytest.raises(DatasetError, match="train-00000.bin"):
        TokenDataset(tmp_path / "d")
    assert issubclass(DatasetError, FoldtuneError)


def test_cli_prepares_and_reports_errors_in_one_line(corpus, tmp_path, capsys):
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "d")]) == 0
    assert "3 documents" in capsys.readouterr().out
    assert main(["data", "prepare", "/no/such", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foldtune: error: input path(s) do not exist") and "Traceback" not in err
