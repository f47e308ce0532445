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
from spec.documents import MAX_DOCUMENT_SAMPLE, attention_share, chunk_pair_share
from spec.errors import SpecError
from spec.flops import flops_per_step
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


def test_model_flops_count_the_attention_pairs_the_kernels_are_priced_at():
    """MFU divides model FLOPs of Σ len²/2 attention pairs a sequence (spec.flops) where the kernels are priced
    at that share: packed documents lower both."""
    model, training, cluster = build_specs("mixtral-8x7b", 16, gpu="h100-sxm", seq_length=8192, global_batch_size=32)
    config = ParallelConfig.parse("tp2 cp2 ep8 dp4 cp_comm=p2p", world_size=16)
    packed_training = dataclasses.replace(training, document_lengths=(2048, 6144))
    whole, packed = (step_time(model, t, cluster, config) for t in (training, packed_training))
    # mfu = flops / step_time / gpus / peak: the FLOPs each estimate divided, in ratio
    ratio = (packed.mfu * packed.step_time) / (whole.mfu * whole.step_time)
    assert ratio == pytest.approx(flops_per_step(model, 8192, 32, 10 / 16) / flops_per_step(model, 8192, 32))
    assert ratio < 1


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


def test_hand_worked_chunk_pair_shares():
    # cp2: 4 chunks of 2048 at seq 8192, 10 causal chunk pairs of work 4·1/2 + 6 = 8.
    # documents on chunk boundaries, (2048, 6144): the 3 pairs of chunk 0 with later chunks skipped, 5 of 8 left,
    # which is the documents' own share (1 + 9) / 16
    assert chunk_pair_share([2048, 6144], 8192, 4) == attention_share([2048, 6144], 8192) == 10 / 16
    # (1024, 7168): the second document touches every chunk, chunk 0 included: nothing skipped
    assert chunk_pair_share([1024, 7168], 8192, 4) == 1.0 > attention_share([1024, 7168], 8192)
    # four documents of 2048 (one a chunk): only the diagonal, 4 · 1/2 of 8
    assert chunk_pair_share([2048] * 4, 8192, 4) == pytest.approx(0.25)
    # 3000 + 3000 + 2192: chunks {0, 1}, {1, 2}, {2, 3} -> diagonals 2 + pairs (1,0), (2,1), (3,2): 5 of 8;
    # the next document (5000) does not fit the 0 tokens left: a second sequence, chunks 0..2: 1.5 + 3 = 4.5
    assert chunk_pair_share([3000, 3000, 2192, 5000], 8192, 4) == pytest.approx((5 + 4.5) / 16)
    assert chunk_pair_share([], 8192, 4) == 1.0


@pytest.mark.parametrize("layout, chunks", [("tp2 cp2 ep8 dp4 cp_comm=p2p", 4), ("tp2 cp2 ep8 dp4 cp_comm=allgather", 4),
                                            ("tp2 cp4 ep8 dp2 cp_comm=a2a+p2p:2x2", 4),
                                            ("tp2 cp2 ep8 dp4 cp_comm=a2a", None)])
def test_cp_cores_are_priced_at_the_chunk_pairs_their_executor_skips(layout, chunks):
    """Documents off chunk boundaries: the ring and all-gather types skip only whole chunk pairs (a larger share
    than the documents' own), a2a attends whole sequences (the documents' share)."""
    model, training, cluster = build_specs("mixtral-8x7b", 16, gpu="h100-sxm", seq_length=8192, global_batch_size=32)
    config = ParallelConfig.parse(layout, world_size=16)
    lengths = (3000, 3000, 2192)
    whole = step_time(model, training, cluster, config)
    packed = step_time(model, dataclasses.replace(training, document_lengths=lengths), cluster, config)
    share = attention_share(lengths, 8192) if chunks is None else chunk_pair_share(lengths, 8192, chunks)
    assert share == pytest.approx(5 / 8 if chunks else (2 * 3000 ** 2 + 2192 ** 2) / 8192 ** 2)
    assert packed.term("attention_core") == pytest.approx(whole.term("attention_core") * share)
