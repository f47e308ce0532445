"""The GPU benchmark scripts (bench/*.sh) fail on the device machine only, where a mistake costs device time:
each must parse, and a script that sends its output through ``exec > >(tee ...)`` must not call a bare
``wait`` (bash also waits for that process substitution, which only ends with the script: the call hangs
until its time limit, as one did on 2026-11-27 and lost ten minutes of a two-GPU call)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.sh"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 5, SCRIPTS


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


BARE_WAIT = re.compile(r"(^\s*|[;&|]\s*|\bthen\s+|\bdo\s+)wait\s*($|[;#)])", re.M)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_bare_wait_beside_a_teed_log(script):
    text = script.read_text()
    if "exec > >(tee" not in text:
        return
    bare = [line.strip() for line in text.splitlines() if BARE_WAIT.search(line) and not line.lstrip().startswith("#")]
    assert bare == [], f"{script.name}: wait for named PIDs instead of a bare wait: {bare}"


def test_the_bare_wait_rule_catches_the_mistake(tmp_path):
    """The check above on the line that hung (and on its fix)."""
    assert BARE_WAIT.search("  wait; grep -h x log")
    assert BARE_WAIT.search("wait")
    assert not BARE_WAIT.search('  wait "${pids[@]}"; grep -h x log')
    assert not BARE_WAIT.search("wait $spid; tail -60 log")
