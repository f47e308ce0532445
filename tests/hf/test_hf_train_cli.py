"""`foldtune train --model-dir DIR --export-hf OUT`: the real training loop starts from a Hugging Face
checkpoint under a folded layout (ep2, 2 CPU ranks) and exports what it trained, which transformers loads;
`foldtune export-hf CHECKPOINT` writes the same directory from the run's checkpoint, offline.

With a learning rate of 1e-12 the trained weights are the loaded ones to fp32 precision: the exported model's
logits equal the source model's, which only holds if loading (each rank its expert slice) and exporting are
both right (foldtune's own initialisation would give other logits).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_tiny import batch, tiny_hf_model
from api.cli.main import main
from executor.dataset.prepare import prepare_dataset

transformers = pytest.importorskip("transformers")


def _train(capsys, data, model_args, out, checkpoints):
    argv = ["train", "--data", data, *model_args, "--layout", "ep2", "--gpus", "2", "--steps", "1", "--seq", "16",
            "--gbs", "2", "--lr", "1e-12", "--min-lr", "0", "--lr-warmup", "0", "--eval-batches", "1",
            "--export-hf", str(out), "--checkpoint-dir", str(checkpoints)]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    return captured.out


def _logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_train_from_hf_weights_and_export(capsys, tmp_path):
    source = tmp_path / "tiny-mixtral"
    tiny_hf_model("mixtral").save_pretrained(source)
    docs = Path(__file__).resolve().parents[2] / "docs"
    data = prepare_dataset([str(docs / "training.md")], str(tmp_path / "corpus")).path
    out = _train(capsys, data, ["--model-dir", str(source)], tmp_path / "out", tmp_path / "ck")
    assert f"from the weights in {source}" in out and "exported the trained model" in out
    ids, _ = batch()
    torch.testing.assert_close(_logits(tmp_path / "out", ids), _logits(source, ids), rtol=1e-4, atol=1e-5)
    # the same model from its (layout-independent) checkpoint, offline
    assert main(["export-hf", str(tmp_path / "ck"), "--model-dir", str(source), "--out", str(tmp_path / "ck-hf")]) == 0
    capsys.readouterr()
    torch.testing.assert_close(_logits(tmp_path / "ck-hf", ids), _logits(tmp_path / "out", ids), rtol=0, atol=0)


def test_export_of_a_model_without_a_hugging_face_form_is_refused_before_training(capsys, tmp_path):
    code = main(["train", "--data", str(tmp_path), "--model", "tiny-moe-shared", "--steps", "1", "--export-hf",
                 str(tmp_path / "x")])
    assert code == 2 and "no exact Hugging Face mixtral form" in capsys.readouterr().err
