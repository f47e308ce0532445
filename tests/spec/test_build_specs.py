"""spec.inputs.build_specs: the (model, training, cluster) of command-line names and numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spec.catalog import get_hardware, get_model
from spec.errors import CatalogError
from spec.inputs import build_specs
from spec.profile_io import save_profile


def test_catalog_names_layers_and_training_fields():
    model, training, cluster = build_specs("mixtral-8x7b", 8, gpu="h100-sxm", layers=2, seq_length=2048,
                                           global_batch_size=16, precision="bf16")
    assert model == get_model("mixtral-8x7b").with_layers(2)
    assert (training.seq_length, training.global_batch_size, training.precision) == (2048, 16, "bf16")
    assert cluster.hardware == get_hardware("h100-sxm") and cluster.num_gpus == 8


def test_a_profile_file_replaces_the_catalog_gpu(tmp_path):
    path = save_profile(replace(get_hardware("h200"), name="h200-mine"), tmp_path / "mine.json")
    _, _, cluster = build_specs("tiny-moe", 4, gpu="h100-sxm", profile=str(path), seq_length=64, global_batch_size=8)
    assert cluster.hardware.name == "h200-mine"
    with pytest.raises(CatalogError):
        build_specs("no-such-model", 4, gpu="h100-sxm", seq_length=64, global_batch_size=8)
