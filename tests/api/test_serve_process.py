"""A real ``foldtune serve`` process: SIGTERM with a request stuck in flight (its handler blocked on a
database lock held by the test) ends the process within the shutdown timeout, and ``X-Forwarded-For``
names the client only when the connection comes from a configured trusted proxy (else a loopback client
could pick any address and dodge the per-address rate limit)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import text

from db.engine import make_engine, make_sessionmaker
from db.keys import create_api_key

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each test starts a server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(db_url: str, data_root: Path, **env: str):
    """``foldtune serve`` on a free port with ``env`` added; yields (process, base URL); killed after."""
    port = _free_port()
    environ = {**os.environ, "FOLDTUNE_DATABASE_URL": db_url, "FOLDTUNE_DATA_ROOT": str(data_root),
               "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "serve", "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"foldtune serve did not start: {proc.communicate()[0]}") from None
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _key(db_url: str, owner: str) -> str:
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            return create_api_key(session, owner)[1]
    finally:
        engine.dispose()


@contextmanager
def _api_keys_locked(db_url: str):
    """Hold a lock that blocks every authenticated request (the API-key lookup): SQLite's write lock (every
    foldtune transaction begins IMMEDIATE), or an exclusive lock on PostgreSQL's api_keys table."""
    engine = make_engine(db_url)
    conn = engine.connect()
    try:
        conn.begin()
        if engine.dialect.name == "postgresql":
            conn.execute(text("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE"))
        yield
    finally:
        conn.rollback()
        conn.close()
        engine.dispose()


def _status(url: str, headers: dict[str, str]) -> int:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_sigterm_with_a_stuck_request_exits_within_the_shutdown_timeout(db_url, data_root):
    key = _key(db_url, "alice")
    with serve(db_url, data_root, FOLDTUNE_SHUTDOWN_SECONDS="2") as (proc, url):
        assert _status(f"{url}/v1/jobs", {"Authorization": f"Bearer {key}"}) == 200
        with _api_keys_locked(db_url):
            answered: list[object] = []

            def stuck() -> None:
                try:
                    answered.append(_status(f"{url}/v1/jobs", {"Authorization": f"Bearer {key}"}))
                except OSError as exc:  # the server closed the connection at its shutdown timeout
                    answered.append(exc)

            client = threading.Thread(target=stuck, daemon=True)
            client.start()
            time.sleep(1.5)
            assert not answered, "the request was meant to be stuck behind the lock"
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("foldtune serve still running 10 s after SIGTERM with a request in flight")
            elapsed = time.monotonic() - start
    assert elapsed < 10


def test_forwarded_for_from_loopback_does_not_dodge_the_address_rate_limit(db_url, data_root):
    limits = {"FOLDTUNE_RATE_LIMIT_PER_S": "0.001", "FOLDTUNE_RATE_LIMIT_BURST": "2"}
    with serve(db_url, data_root, **limits) as (_proc, url):
        # no key: the request counts against the client address's bucket (2 at once)
        answers = [_status(f"{url}/v1/jobs", {"X-Forwarded-For": f"10.0.0.{i}"}) for i in range(4)]
    assert answers == [401, 401, 429, 429]


def test_forwarded_for_from_a_trusted_proxy_names_the_client(db_url, data_root):
    limits = {"FOLDTUNE_RATE_LIMIT_PER_S": "0.001", "FOLDTUNE_RATE_LIMIT_BURST": "2",
              "FOLDTUNE_TRUSTED_PROXIES": "127.0.0.1"}
    with serve(db_url, data_root, **limits) as (_proc, url):
        answers = [_status(f"{url}/v1/jobs", {"X-Forwarded-For": f"10.0.0.{i}"}) for i in range(4)]
        same = [_status(f"{url}/v1/jobs", {"X-Forwarded-For": "10.0.0.9"}) for _ in range(3)]
    assert answers == [401] * 4  # four clients behind the proxy, each with its own bucket
    assert same == [401, 401, 429]
