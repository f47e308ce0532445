"""The kernel tests that need Triton's CPU interpreter, run in one child pytest per session.

Triton picks its interpreter when it is first imported (TRITON_INTERPRET=1), which the parent pytest process
has done already. A test file marks its interpreter-only tests with :func:`inner_only`; the parent does not
collect them (tests/conftest.py deselects them), and the file's parent test asks the session fixture
``triton_interpreter`` (tests/conftest.py) for a :class:`ChildRun` and calls :meth:`ChildRun.check`
on its own file. The fixture starts a single child for every file whose parent test the session runs: each
child pays for importing torch and Triton and for collecting its files, once instead of once a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INNER = os.environ.get("TRITON_INTERPRET") == "1"
MARK = "triton_interpreter"  # the pytest marker of the tests the child runs (registered in pyproject.toml)
TIMEOUT_S = 1800  # the child's whole run, every file's kernels together, on a loaded 2-core machine


def inner_only(test):
    """Mark ``test`` as one the interpreter child runs; in any other process it is not collected, and it
    skips if run there anyway (the kernels would compile for a GPU that is not there)."""
    import pytest

    skip = pytest.mark.skipif(not INNER, reason="runs in the Triton interpreter child (tests/executor/triton_child.py)")
    return getattr(pytest.mark, MARK)(skip(test))


def module_name(test_file: str | Path, rootdir: Path) -> str:
    """The dotted name pytest's JUnit report gives ``test_file``'s tests as their class name."""
    return Path(test_file).resolve().relative_to(rootdir.resolve()).with_suffix("").as_posix().replace("/", ".")


@dataclass
class ChildRun:
    """What the child did: its exit status, the tail of its output, and per test module (dotted name) each
    test's (name, outcome), outcome 'passed' or the JUnit element that says otherwise ('failure', 'error',
    'skipped')."""

    returncode: int
    output: str = field(repr=False)
    rootdir: Path
    files: list[str]
    outcomes: dict[str, list[tuple[str, str]]] = field(default_factory=dict, repr=False)

    def check(self, test_file: str, expected: int | None = None) -> None:
        """Fail unless the child ran ``test_file``'s interpreter tests (``expected`` of them, when given) and
        every one passed."""
        assert str(Path(test_file).resolve()) in self.files, f"{test_file} was not given to the child"
        mine = self.outcomes.get(module_name(test_file, self.rootdir), [])
        assert mine, f"the interpreter child ran none of {test_file}'s tests:\n{self.output}"
        bad = [f"{name}: {outcome}" for name, outcome in mine if outcome != "passed"]
        assert not bad, "\n".join(bad) + "\n" + self.output
        if expected is not None:
            assert len(mine) == expected, (len(mine), expected, self.output)


def run_child(files: list[str], rootdir: Path, workdir: Path) -> ChildRun:
    """Run the ``inner_only`` tests of ``files`` in one child pytest with TRITON_INTERPRET=1."""
    report = workdir / "interpreter.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARK,
                           f"--junitxml={report}", *files], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=rootdir)
    run = ChildRun(done.returncode, done.stdout[-6000:] + done.stderr[-2000:], rootdir, files)
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            run.outcomes.setdefault(case.get("classname", ""), []).append((case.get("name", ""), outcome))
    return run
