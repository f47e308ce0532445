"""``foldtune plan --profile FILE`` prices with a saved (calibrated) profile; a bad file is one error line."""

from __future__ import annotations

import json
from dataclasses import replace

from api.cli.main import main
from spec.catalog import get_hardware
from spec.hardware import MeasuredCurve
from spec.profile_io import save_profile

PLAN = ["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "64", "--gbs", "8", "--precision", "fp32", "--json"]


def _best_step(capsys, argv) -> float:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]


def test_plan_prices_with_a_profile_file(tmp_path, capsys):
    slow = replace(get_hardware("cpu"), name="cpu-slow", gemm_efficiency=MeasuredCurve(((1.0, 0.01),)))
    path = save_profile(slow, tmp_path / "slow.json", raw={"note": "test"})
    datasheet = _best_step(capsys, [*PLAN, "--gpu", "cpu"])
    calibrated = _best_step(capsys, [*PLAN, "--profile", str(path)])
    assert calibrated > 2 * datasheet  # every GEMM at 1 % of peak instead of ~79 %


def test_plan_with_a_bad_profile_file_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"profile": {"name": "x"}}')
    assert main([*PLAN, "--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0] and "not a hardware profile" in err[0]
    assert main([*PLAN, "--profile", str(tmp_path / "missing.json")]) == 2
    assert "cannot read hardware profile" in capsys.readouterr().err


def test_calibrate_rejects_bad_input_in_one_line(capsys):
    assert main(["calibrate", "--gpu", "nope"]) == 2
    assert "unknown GPU 'nope'" in capsys.readouterr().err
    assert main(["calibrate", "--gpu", "cpu", "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "foldtune: error: --gpus must be >= 1, got 0"
    assert main(["calibrate", "--gpu", "cpu", "--precision", "fp8"]) == 2
    assert "fp8 needs CUDA GPUs" in capsys.readouterr().err
    for bad in ("-1", "nan", "inf"):  # refused before anything runs (no "calibrating" line)
        assert main(["calibrate", "--gpu", "cpu", "--sustained-seconds", bad]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.strip().startswith("foldtune: error: --sustained-seconds must be a finite")
