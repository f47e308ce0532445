"""bench/ holds scripts only, and each of them starts: every bench/*.py but the shared results writer
(bench/report.py) is a script with a ``__main__`` entry whose ``--help`` prints its usage and exits 0.

The scripts are run in one child process, one after another (one torch import for all of them instead of one
each), never imported by the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# modules of bench/ that are no script: the writer of results (JSON files, sections of docs/benchmarks.md)
HELPERS = {"report"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)

_RUN_ALL = """
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name + ".py", "--help"]
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module("bench." + name, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    results[name] = [code, out.getvalue()[:2000]]
sys.__stdout__.write("\\n" + json.dumps(results) + "\\n")
"""


@pytest.fixture(scope="module")
def help_of() -> dict[str, list]:
    """Script name -> [exit status of ``python3 -m bench.<name> --help``, what it printed]."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", _RUN_ALL, *SCRIPTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_prints_its_usage(help_of, name):
    code, printed = help_of[name]
    assert code == 0 and "usage:" in printed, printed


def test_bench_holds_scripts_only():
    not_scripts = [p.name for p in BENCH.glob("*.py")
                   if p.stem not in HELPERS and 'if __name__ == "__main__":' not in p.read_text()]
    assert len(SCRIPTS) > 20 and not_scripts == []
