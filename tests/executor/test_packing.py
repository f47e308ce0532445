"""Packed sequences on the data side (executor/dataset/packing.py, ``data prepare --pack``): rows of
seq_length + 1 holding every document whole or in pieces, boundary flags, labels ignored across documents and on
padding, positions restarting per document, and format 1 datasets still opening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from api.cli.main import main
from executor.dataset.packing import IGNORE, PAD, PADDING, START, document_lengths, pack_documents, segment_positions, \
    split_rows
from executor.dataset.prepare import DatasetError, prepare_dataset
from executor.dataset.sampler import BatchSampler, TokenDataset


def _docs(*lengths: int) -> list[torch.Tensor]:
    return [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate(lengths)]


def test_greedy_packing_pads_rows_and_cuts_documents_longer_than_a_row():
    # rows of 8: [3 3 pad2] [5 pad3] [8 of 19] [8 of 19] [3 of 19, 2, pad3]
    tokens, flags = pack_documents(_docs(3, 3, 5, 19, 2), 8, pad_id=0)
    assert tokens.numel() == flags.numel() == 40
    rows, marks = tokens.view(5, 8).tolist(), flags.view(5, 8).tolist()
    assert rows[0] == [1, 1, 1, 2, 2, 2, 0, 0] and marks[0] == [START, 0, 0, START, 0, 0, START | PAD, PAD]
    assert rows[1] == [3] * 5 + [0] * 3
    assert rows[2] == rows[3] == [4] * 8 and marks[2][0] == marks[3][0] == START
    assert rows[4] == [4, 4, 4, 5, 5, 0, 0, 0] and marks[4][:4] == [START, 0, 0, START]
    # every token of every document is kept, in order
    assert (tokens[(flags & PAD) == 0] == torch.cat(_docs(3, 3, 5, 19, 2))).all()
    assert document_lengths(flags) == [3, 3, 5, 8, 8, 3, 2]


def test_rows_split_into_inputs_labels_segments_and_positions():
    tokens, flags = pack_documents([torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22, 23])], 9, pad_id=0)
    ids, labels, segments = split_rows(tokens.view(1, 9).long(), flags.view(1, 9).long())
    assert ids.tolist() == [[10, 11, 12, 20, 21, 22, 23, 0]]
    # 12 -> 20 crosses documents, 23 -> pad and pad -> pad are padding: no loss there
    assert labels.tolist() == [[11, 12, IGNORE, 21, 22, 23, IGNORE, IGNORE]]
    assert segments.tolist() == [[1, 1, 1, 2, 2, 2, 2, PADDING]]
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]  # padding: a segment too


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"doc{i}.md").write_text(f"# Document {i}\n\n" + "Packed rows keep documents apart. " * (2 + 7 * i))
    return src


def test_prepare_pack_writes_format_2_rows_the_sampler_serves_with_their_flags(corpus, tmp_path, capsys):
    out = tmp_path / "packed"
    assert main(["data", "prepare", str(corpus), "--out", str(out), "--pack", "--seq", "63"]) == 0
    assert "packed into rows of 63 + 1 tokens" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == 2 and index["packed"]["seq_length"] == 63
    ds = TokenDataset(out)
    assert ds.packed_seq_length == 63
    train = ds.splits["train"]
    assert train.tokens % 64 == 0 and train.flags.tokens == train.tokens
    real = train.read(0, train.tokens)[(train.flags.read(0, train.tokens) & PAD) == 0]
    unpacked = tmp_path / "plain"
    prepare_dataset([str(corpus)], str(unpacked))
    plain = TokenDataset(unpacked).splits["train"]
    assert torch.equal(real, plain.read(0, plain.tokens))  # the same documents, padding aside
    sampler = BatchSampler(train, 63, 2, seed=0)
    assert sampler.num_windows == train.tokens // 64
    rows, flags = sampler.packed_batch(1)
    assert rows.shape == flags.shape == (2, 64)
    assert torch.equal(rows, sampler.batch(1)) and (flags[:, 0] & START).all()  # a row starts a segment
    with pytest.raises(DatasetError, match="packed for seq_length 63, not 31"):
        BatchSampler(train, 31, 2)


def test_packing_needs_its_sequence_length_and_plain_datasets_keep_format_1(corpus, tmp_path, capsys):
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "x"), "--pack"]) != 0
    assert "--pack and --seq go together" in capsys.readouterr().err
    prepare_dataset([str(corpus)], str(tmp_path / "plain"))
    assert json.loads((tmp_path / "plain" / "index.json").read_text())["format"] == 1
    stream = TokenDataset(tmp_path / "plain").splits["train"]
    assert stream.flags is None
    with pytest.raises(DatasetError, match="not packed"):
        BatchSampler(stream, 16, 2).packed_batch(0)
