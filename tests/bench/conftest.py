"""The bench scripts are run, never imported, by these tests: each smoke test starts ``python3 -m bench.<name>``
in a child process from the repository root, with this checkout first on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python3 -m bench.<name> args...`` from the repository root; its exit status and output."""
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT, env=child_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def script():
    """:func:`run_script`, for tests of the bench scripts."""
    return run_script
