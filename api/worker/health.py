"""``GET /healthz`` of a runner process (``foldtune runner --health-port``), for container healthchecks.

A runner serves no API, so a container orchestrator cannot tell a wedged runner from a working one.
This tiny HTTP server (standard library, one daemon thread, nothing but ``/healthz``) answers 200 with
``{"status": "ok", ...}`` while the runner is running, its database answers and its Ray cluster answers,
and 503 naming the failed check otherwise (a runner shutting down answers 503 too, so no rolling deploy
routes work to it). Bind it to loopback unless something outside the container must probe it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Check = Callable[[], None]  # raises when unhealthy; the exception's text is the reason


class HealthServer:
    """Serves ``/healthz`` on ``host:port`` (port 0: any free one, see :attr:`port`) from a daemon thread;
    ``checks`` are run in order on every request."""

    def __init__(self, host: str, port: int, checks: dict[str, Check], identity: dict[str, str]) -> None:
        self.checks, self.identity = checks, identity
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="runner-healthz", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def report(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 when every check passes, else 503 with the first failure."""
        for name, check in self.checks.items():
            try:
                check()
            except Exception as exc:  # any failure of a check is the answer, not an error of the server
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                return 503, {"status": "unavailable", "check": name, "detail": first[:300], **self.identity}
        return 200, {"status": "ok", **self.identity}


def _handler_for(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/healthz":
                self._send(404, {"status": "not found"})
                return
            self._send(*server.report())

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # a probe every few seconds is no news
            pass

    return Handler
