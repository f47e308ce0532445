"""``--search-precision`` on ``foldtune submit`` and ``foldtune tune``: the flag reaches the job, and a tune on CPU
ranks says fp8 was left out and names the best layout's precision."""

from __future__ import annotations

import re

import pytest
from runner_env import session_ray
from test_tune_cli import _tune

from api.cli.main import main
from db.models import Job


@pytest.fixture
def conn(server_url, keys):
    return ["--url", server_url, "--api-key", keys["alice"]]


def test_submit_sends_search_precision(capsys, conn, app):
    argv = ["submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--seq", "64", "--gbs", "8",
            "--max-trials", "3", *conn]
    assert main(argv) == 0 and main([*argv, "--search-precision"]) == 0
    capsys.readouterr()
    with app.state.sessions() as s:
        plain, searched = s.get(Job, 1), s.get(Job, 2)
        assert "search_precision" not in plain.training_spec and searched.training_spec["search_precision"] is True


@pytest.mark.slow
def test_tune_on_cpu_searches_fp32_and_bf16_and_says_fp8_was_dropped(tmp_path):
    # no calibration first: tests/api/test_tune_cli.py runs tune's, and the precisions searched come from the
    # hardware profile's peaks, the datasheet's as much as a calibrated one's
    done = _tune(tmp_path, "--gpus", "2", "--max-trials", "2", "--timed-steps", "1", "--search-precision",
                 "--auto-calibrate", "off", ray_address=session_ray())
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"precisions searched: fp32, bf16 \(fp8 not searched: GPU cpu has no fp8 peak", out), out
    assert re.search(r"^best layout: .+ precision=(fp32|bf16)  ", out, re.M), out
    assert len(re.findall(r"^  trial +\d+  .+ precision=(?:fp32|bf16) +predicted", out, re.M)) == 4, out  # start+end
