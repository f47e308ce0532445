"""`foldtune plan --model-dir DIR` / `--hf-config FILE` on a published config.json of each family prints the plan
of the model's catalog entry (bar 3 of issue 22)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.cli.main import main

CONFIGS = Path(__file__).parents[1] / "spec" / "hf_configs"
# deepseek-v3's 61 layers take the longest to plan (~6 s): the whole suite plans it, the fast tier the others
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "deepseek-v3" else n
         for n in sorted(p.name for p in CONFIGS.iterdir())]
ARGS = ["--gpus", "16", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "64", "--top", "3", "--workers", "1"]


def _plan(capsys, model_args, *extra):
    code = main(["plan", *model_args, *ARGS, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _without_timing(text: str) -> list[str]:
    """The plan's lines but the one that reports how long ranking took."""
    return [line for line in text.splitlines() if not line.startswith("ranked ")]


@pytest.mark.parametrize("name", NAMES)
def test_model_dir_plans_as_the_catalog_entry(capsys, name):
    code, ours, err = _plan(capsys, ["--model-dir", str(CONFIGS / name)])
    assert err == ""
    code_catalog, theirs, _ = _plan(capsys, ["--model", name])
    assert code == code_catalog
    assert _without_timing(ours) == _without_timing(theirs)
    assert ours.startswith(f"model    {name}:")


def test_hf_config_file_json_equals_catalog(capsys):
    name = "deepseek-v2-lite"
    code, out, _ = _plan(capsys, ["--hf-config", str(CONFIGS / name / "config.json")], "--json")
    ours = json.loads(out)
    _, out, _ = _plan(capsys, ["--model", name], "--json")
    theirs = json.loads(out)
    ours.pop("timing"), theirs.pop("timing")
    assert ours == theirs


def test_bad_hf_config_is_one_line_exit_2(capsys, tmp_path):
    config = json.loads((CONFIGS / "mixtral-8x7b" / "config.json").read_text())
    config["brand_new_field"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _plan(capsys, ["--model-dir", str(tmp_path)])
    assert code == 2 and "brand_new_field" in err and "Traceback" not in err
