"""``foldtune calibrate merge``: component factors recomputed against the profile they are stored in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.cli.main import main
from costmodel.calibrate.component_factors import build_report, predicted_parts
from costmodel.calibrate.merge import merged_profile
from spec.catalog import get_hardware, get_model
from spec.profile_io import load_profile, save_profile


def _merge(argv: list[str]) -> int:
    return main(["calibrate", "merge", *argv])


def _run_file(tmp_path, run_profile, seq, mbs, scale):
    """A component run's file: measured = scale x the prediction on the run's own profile."""
    spec = get_model("mixtral-8x7b").with_layers(2)
    parts, per_param = predicted_parts(spec, seq, mbs, "bf16", run_profile)
    measured = {name: scale * sum(terms.values()) for name, terms in parts.items() if name != "dense_mlp"}
    measured["optimizer"] = 2 * per_param
    report = build_report(spec, seq, mbs, "bf16", "NVIDIA H200", measured, run_profile)
    path = tmp_path / f"comp-{seq}-{mbs}.json"
    save_profile(replace(run_profile, component_factors={report.key: report.factors}), path,
                 {"components": report.to_dict()})
    return path, measured


def test_factors_are_recomputed_against_the_target_profile(tmp_path):
    run = get_hardware("h200")
    target = replace(run, name="h200-machine", hbm_efficiency=0.5)  # a slower memory: other predictions
    a, measured_a = _run_file(tmp_path, run, 4096, 1, 1.4)
    b, _ = _run_file(tmp_path, run, 2048, 1, 1.1)
    target_path = save_profile(target, tmp_path / "machine.json")
    out = tmp_path / "merged.json"
    assert _merge(["--profile", str(target_path), "--component-runs", f"{a},{b}", "--out", str(out)]) == 0
    merged = load_profile(out)
    factors = {k: dict(v) for k, v in merged.component_factors}
    assert set(factors) == {"mixtral-8x7b@2L@seq4096@mbs1", "mixtral-8x7b@2L@seq2048@mbs1"}
    spec = get_model("mixtral-8x7b").with_layers(2)
    expected = build_report(spec, 4096, 1, "bf16", "x", measured_a, target).factors
    assert factors["mixtral-8x7b@2L@seq4096@mbs1"] == pytest.approx(expected)
    # against the run's own profile every factor was 1.4 exactly; the slower target predicts more memory time
    assert factors["mixtral-8x7b@2L@seq4096@mbs1"]["memory_bound"] < 1.4
    assert merged.name == "h200-machine" and merged.hbm_efficiency == 0.5


def test_a_merged_report_keeps_how_its_components_were_timed():
    run = get_hardware("h200")
    spec = get_model("mixtral-8x7b").with_layers(2)
    parts, per_param = predicted_parts(spec, 4096, 1, "bf16", run)
    measured = {name: sum(terms.values()) for name, terms in parts.items() if name != "dense_mlp"}
    measured["optimizer"] = per_param
    timing = {name: "device time, host ahead" for name in measured}
    stored = build_report(spec, 4096, 1, "bf16", "NVIDIA H200", measured, run, timing).to_dict()
    _, (rebuilt,) = merged_profile(replace(run, name="target"), [stored])
    assert rebuilt.timing == timing


def test_a_file_without_components_is_refused(tmp_path, capsys):
    plain = save_profile(get_hardware("h200"), tmp_path / "plain.json")
    assert _merge(["--profile", str(plain), "--component-runs", str(plain),
                                  "--out", str(tmp_path / "o.json")]) == 2
    assert "no component measurements" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    json.loads(plain.read_text())


def test_a_host_probe_is_repriced_against_the_target_host_floor():
    """The record's host seconds, not its factors, travel: a target whose layer host time is twice the run's
    gets half the host factor."""
    from costmodel.calibrate.host_factors import HostProbe, host_factors
    from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR

    run = get_hardware("h200")
    target = replace(run, name="h200-machine", moe_layer_host_s=2 * (run.moe_layer_host_s or 3e-3))
    run = replace(run, moe_layer_host_s=target.moe_layer_host_s / 2)
    spec = get_model("mixtral-8x7b").with_layers(2)
    parts, per_param = predicted_parts(spec, 4096, 1, "bf16", run)
    measured = {name: sum(terms.values()) for name, terms in parts.items() if name != "dense_mlp"}
    measured["optimizer"] = per_param
    record = build_report(spec, 4096, 1, "bf16", "NVIDIA H200", measured, run).to_dict()
    record["host_probe"] = {"seq_length": 256, "micro_batch_size": 1, "base_s": 0.02, "full_s": 0.03}
    on_run = host_factors(spec, HostProbe(**record["host_probe"]), "bf16", run)
    merged, reports = merged_profile(target, [record])
    factors = dict(dict(merged.component_factors)["mixtral-8x7b@2L@seq4096@mbs1"])
    assert factors[HOST_FACTOR] == pytest.approx(on_run[HOST_FACTOR] / 2)
    assert factors[HOST_RECOMPUTE_FACTOR] == pytest.approx(on_run[HOST_RECOMPUTE_FACTOR] / 2)
    assert reports[0].factors[HOST_FACTOR] == factors[HOST_FACTOR]
