"""The upper bound of a graceful shutdown (api.cli._shutdown), which ``foldtune runner`` arms on SIGTERM and
``foldtune serve`` applies after its own timeout: a process whose thread is blocked for good still exits, in
time and with the code given, where Python alone would wait for the thread forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = """
import threading
threading.Thread(target=threading.Event().wait).start()  # non-daemon, blocked for good
from api.cli._shutdown import exit_leaving_busy_threads, exit_timer
{call}
"""


def _run(call: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", BLOCKED.format(call=call)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.returncode, done.stderr


def test_the_exit_timer_ends_a_process_that_a_blocked_thread_keeps_alive():
    code, stderr = _run("exit_timer(0.5, 'runner r1', 143)")
    assert code == 143 and "runner r1: not shut down after 0.5 s; exiting" in stderr


def test_busy_threads_do_not_keep_the_process_alive_past_the_shutdown():
    code, stderr = _run("exit_leaving_busy_threads('foldtune serve', 0)")
    assert code == 0 and "1 thread(s) still busy" in stderr
