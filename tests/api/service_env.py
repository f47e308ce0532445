"""Helpers the API tests share by import (test modules import this, never conftest, whose module name
another test directory's conftest also takes when pytest is given several directories)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from api.service.quotas import Quotas

# the rate limit and the quotas are tested on their own (test_limits.py); fuzzing and concurrency tests
# (50 jobs of one owner at once) must not meet them
UNLIMITED_RATE = {"rate_per_s": 1e9, "rate_burst": 10**9}
ROOMY = {**UNLIMITED_RATE, "quotas": Quotas(active_jobs=10**6, active_trainings=10**6, trials_per_job=10**6,
                                            profiles=10**6)}


def auth(token):
    return {"Authorization": f"Bearer {token}"}


@contextmanager
def live_server(app):
    """Serve ``app`` with a real uvicorn server on a free port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", limit_concurrency=500,
                                           backlog=512))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
