"""Run a test file's interpreter-only tests in a child pytest with TRITON_INTERPRET=1: Triton picks its CPU
interpreter when it is first imported, which the parent pytest process has done already."""

from __future__ import annotations

import os
import subprocess
import sys


def run_inner_tests(test_file: str, select: str = "inner", timeout_s: int = 600) -> None:
    """Fail (with the child's output tail) unless the child ran ``select``-matching tests and all passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", select,
                           test_file], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout and "skipped" not in done.stdout
