"""The kernel tests that need Triton's CPU interpreter, run in one child pytest per session.

Triton picks its interpreter when it is first imported (TRITON_INTERPRET=1), which the parent pytest process
has done already. A test file marks its interpreter-only tests with :func:`inner_only`; the parent does not
collect them (tests/conftest.py deselects them), and the file's parent test asks the session fixture
``triton_interpreter`` (tests/conftest.py) for a :class:`ChildRun` and calls :meth:`ChildRun.check`
on its own file. A single child (:class:`InterpreterChild`) runs every file whose parent test the session
runs, started when collection ends so that it runs beside the parent's first tests: the child pays for
importing torch and Triton and for collecting its files once instead of once a file, and its kernels run
on the core the parent's single-process tests leave idle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INNER = os.environ.get("TRITON_INTERPRET") == "1"
MARK = "triton_interpreter"  # the pytest marker of the tests the child runs (registered in pyproject.toml)
TIMEOUT_S = 1800  # the child's whole run, every file's kernels together, on a loaded 2-core machine
# Runs the child pytest (argv[2:]) and then writes its exit status to the file argv[1], renamed into place: a
# process that did not start the child (another pytest-xdist worker) learns from that file that it is done.
_WRAPPER = ("import os, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1] + '.part', 'w').write(str(code)); os.replace(sys.argv[1] + '.part', sys.argv[1])")


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


class InterpreterChild:
    """The child pytest over ``files``, its report, output and exit status in ``workdir``. ``start``: start it
    now (at the end of collection: it runs beside the parent's first tests, the API's, which leave a core
    idle); otherwise another process (the pytest-xdist worker gw0) starts it in the same ``workdir``, and
    :meth:`result` waits for its exit status there. Its output goes to a file, not a pipe nobody reads while
    it runs."""

    def __init__(self, files: list[str], rootdir: Path, workdir: Path, start: bool = True) -> None:
        self.files, self.rootdir = files, rootdir
        self.report, self.log = workdir / "interpreter.xml", workdir / "output.txt"
        self.status = workdir / "returncode"
        self._run: ChildRun | None = None
        self.proc: subprocess.Popen | None = None
        if start:
            # GPUs hidden: the interpreter runs the kernels on CPU tensors, and on a GPU machine code that
            # places tensors or picks kernels by torch.cuda.is_available() would hand it CUDA ones
            env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, str(self.status), sys.executable, "-m",
                                              "pytest", "-q", "-p", "no:cacheprovider", "-m", MARK,
                                              f"--junitxml={self.report}", *files], env=env, stdout=log,
                                             stderr=subprocess.STDOUT, cwd=rootdir, start_new_session=True)

    def result(self) -> ChildRun:
        """Wait for the child (at most TIMEOUT_S seconds) and read its report."""
        if self._run is None:
            code = self._wait()
            output = self.log.read_text(errors="replace")[-8000:] if self.log.exists() else "(no output)"
            self._run = ChildRun(code, output, self.rootdir, self.files)
            if self.report.exists():
                for case in ET.parse(self.report).getroot().iter("testcase"):
                    outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
                    self._run.outcomes.setdefault(case.get("classname", ""), []).append((case.get("name", ""),
                                                                                         outcome))
        return self._run

    def _wait(self) -> int:
        """The child's exit status, once its status file is there; -9 if it is not within TIMEOUT_S seconds
        (the child is then ended, where this process started it) or the child ended without writing it."""
        deadline = time.monotonic() + TIMEOUT_S
        while not self.status.exists():
            if self.proc is not None and self.proc.poll() is not None and not self.status.exists():
                return self.proc.returncode or -9
            if time.monotonic() > deadline:
                self.stop()
                return -9
            time.sleep(0.5)
        return int(self.status.read_text())

    def stop(self) -> None:
        """End the child if it still runs (the session ended before a test asked for its result)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
