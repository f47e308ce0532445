"""Packed sequences' attention priced by their documents' lengths (spec/documents.py, TrainingSpec.document_lengths,
costmodel/step_time.py's flash core; ``foldtune plan --doc-lengths``): hand-worked shares, the attention term
scaled by exactly that share, and the plan CLI reading lengths from a file and from a packed dataset."""

from __future__ import annotations

import dataclasses
import json

import pytest

from api.cli.main import main
from costmodel.estimate import step_time
from executor.dataset.prepare import prepare_dataset
from spec.documents import MAX_DOCUMENT_SAMPLE, attention_share
from spec.errors import SpecError
from spec.inputs import build_specs
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def test_hand_worked_shares():
    # a document filling the sequence: seq^2/2 of seq^2/2
    assert attention_share([4096, 4096], 4096) == 1.0
    # two halves: 2 * (2048^2 / 2) over 4096^2 / 2
    assert attention_share([2048, 2048], 4096) == 0.5
    # a quarter and three quarters: (1 + 9) / 16
    assert attention_share([1024, 3072], 4096) == pytest.approx(10 / 16)
    # 10 000 tokens are cut into 4096 + 4096 + 1808: (2 * 4096^2 + 1808^2) / (10 000 * 4096)
    assert attention_share([10_000], 4096) == pytest.approx((2 * 4096 ** 2 + 1808 ** 2) / (10_000 * 4096))
    # a sample need not sum to whole sequences: 64 documents of 64 tokens at seq 1024 -> 64/1024
    assert attention_share([64] * 64, 1024) == pytest.approx(1 / 16)


def test_the_training_spec_carries_and_checks_lengths():
    t = TrainingSpec(seq_length=4096, global_batch_size=8, document_lengths=[1024, 3072])  # JSON gives lists
    assert t.document_lengths == (1024, 3072) and t.document_attention_share() == pytest.approx(10 / 16)
    assert TrainingSpec.from_dict(t.to_dict()) == t
    assert TrainingSpec(seq_length=4096, global_batch_size=8).document_attention_share() == 1.0
    with pytest.raises(SpecError, match="positive integers"):
        TrainingSpec(seq_length=4096, global_batch_size=8, document_lengths=(10, 0))
    with pytest.raises(SpecError, match="at most"):
        TrainingSpec(seq_length=4096, global_batch_size=8, document_lengths=(5,) * (MAX_DOCUMENT_SAMPLE + 1))


@pytest.mark.parametrize("layout", ["tp2 ep8 pp2 dp4", "tp2 cp2 ep8 dp4 cp_comm=p2p", "tp2 cp2 ep8 dp4 cp_comm=a2a"])
def test_the_attention_core_term_scales_by_the_documents_share(layout):
    model, training, cluster = build_specs("mixtral-8x7b", 16, gpu="h100-sxm", seq_length=8192, global_batch_size=32)
    config = ParallelConfig.parse(layout, world_size=16)
    whole = step_time(model, training, cluster, config)
    packed = step_time(model, dataclasses.replace(training, document_lengths=(2048, 6144)), cluster, config)
    assert packed.term("attention_core") == pytest.approx(whole.term("attention_core") * 10 / 16)
    assert packed.step_time < whole.step_time
    for name in ("gemm", "grouped_gemm", "ep_a2a"):  # nothing else changes
        assert packed.term(name) == pytest.approx(whole.term(name))


def _plan(capsys, *extra: str) -> dict:
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "8192",
                 "--gbs", "32", "--top", "1", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_takes_doc_lengths_from_a_file_and_from_a_packed_dataset(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("2048\n6144, 1024\n")
    plain, packed = _plan(capsys), _plan(capsys, "--doc-lengths", str(lengths))
    assert packed["training"]["document_lengths"] == [2048, 6144, 1024]
    assert packed["ranked"][0]["time_terms_s"]["attention_core"] < plain["ranked"][0]["time_terms_s"]["attention_core"]
    src = tmp_path / "docs"
    src.mkdir()
    for i, n in enumerate((30, 200, 90)):
        (src / f"d{i}.txt").write_text("x" * n)
    prepare_dataset([str(src)], str(tmp_path / "packed"), seq_length=127)
    out = _plan(capsys, "--doc-lengths", str(tmp_path / "packed"))
    # the byte tokenizer's documents end with a blank line (+2 tokens), 90% of each is training text: 29, 182
    # and 83 tokens; the 182 fill one row of 128 and leave a piece of 54
    assert sorted(out["training"]["document_lengths"]) == [29, 54, 83, 128]
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "8192",
                 "--gbs", "32", "--doc-lengths", str(tmp_path / "nope")]) != 0
    assert "no such file or directory" in capsys.readouterr().err
