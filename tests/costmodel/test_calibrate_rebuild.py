"""``foldtune calibrate rebuild``: a stored calibration's raw timings give the profile this checkout's builder derives."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from spec.catalog import get_hardware
from spec.profile_io import load_profile, save_profile


def _rebuild(argv: list[str]) -> int:
    return main(["calibrate", "rebuild", *argv])


RAW = {"precision": "bf16", "measured_at": "2026-11-26T10:20:17+00:00", "ranks": 4, "device_name": "NVIDIA H200",
       "backend": "nccl", "gemm": [{"m": 4096, "n": 4096, "k": 4096, "flops": 2 * 4096**3, "seconds": 2e-4}],
       "grouped_gemm": [], "copy": [],
       "collectives": [{"collective": "all_gather", "group_size": n, "bytes": 16 << 20, "seconds": s}
                       for n, s in ((2, 54.4e-6), (4, 66.0e-6))]}


def test_rebuild_adds_per_group_size_curves_and_keeps_component_factors(tmp_path, capsys):
    h200 = get_hardware("h200")
    old = h200.__class__.from_dict({**h200.to_dict(), "name": "h200-x4-components",
                                    "component_factors": {"m@seq4096@mbs1": {"gemm": 1.2}},
                                    "collective_efficiency": {"all_gather:intra": [[1.0, 0.5]]}})
    save_profile(old, tmp_path / "old.json", RAW)
    assert _rebuild(["--profile", str(tmp_path / "old.json"), "--out", str(tmp_path / "new.json")]) == 0
    new = load_profile(tmp_path / "new.json")
    curves = dict(new.collective_efficiency)
    # 16 MiB over 2 ranks in 54.4 us and over 4 in 66.0 us, in wire bytes over 450 GB/s NVLink
    two, four = 0.5 * (16 << 20) / 54.4e-6 / 450e9, 0.75 * (16 << 20) / 66.0e-6 / 450e9
    assert curves["all_gather:intra:2"](16 << 20) == pytest.approx(two)
    assert curves["all_gather:intra:4"](16 << 20) == pytest.approx(four)
    assert curves["all_gather:intra"](16 << 20) == pytest.approx((two + four) / 2)
    assert new.name == "h200-x4-components" and new.component_factors == old.component_factors
    assert "all_gather:intra:2" in capsys.readouterr().out
    assert json.loads((tmp_path / "new.json").read_text())["raw"] == RAW


def test_a_file_without_raw_timings_is_refused_in_one_line(tmp_path, capsys):
    save_profile(get_hardware("h200"), tmp_path / "bare.json")
    assert _rebuild(["--profile", str(tmp_path / "bare.json"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no raw calibration timings" in err
    assert not (tmp_path / "x.json").exists()
