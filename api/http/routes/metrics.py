"""Prometheus ``/metrics`` in the text exposition format (version 0.0.4), written here rather than with a
client library: a handful of counters and one gauge need no registry."""

from __future__ import annotations

import threading
from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from db.jobs import count_by_status
from db.models import JOB_STATUSES

router = APIRouter(tags=["operations"])


class Metrics:
    """Counters of one app instance (requests by method/route/status, jobs submitted); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, int]] = Counter()
        self.jobs_submitted = 0

    def count_request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1

    def count_job_submitted(self) -> None:
        with self._lock:
            self.jobs_submitted += 1


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@router.get("/metrics", operation_id="get_metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request) -> PlainTextResponse:
    metrics: Metrics = request.app.state.metrics
    with request.app.state.sessions() as session:
        by_status = count_by_status(session)
        session.commit()
    lines = ["# HELP foldtune_http_requests_total HTTP requests served, by method, route template and status.",
             "# TYPE foldtune_http_requests_total counter"]
    with metrics._lock:
        requests = sorted(metrics.requests.items())
        submitted = metrics.jobs_submitted
    for (method, route, status), n in requests:
        lines.append(f'foldtune_http_requests_total{{method="{_label(method)}",route="{_label(route)}",'
                     f'status="{status}"}} {n}')
    lines += ["# HELP foldtune_jobs_submitted_total Jobs stored by this API process.",
              "# TYPE foldtune_jobs_submitted_total counter", f"foldtune_jobs_submitted_total {submitted}",
              "# HELP foldtune_jobs Jobs in the database, by status (all owners).", "# TYPE foldtune_jobs gauge"]
    lines += [f'foldtune_jobs{{status="{s}"}} {by_status.get(s, 0)}' for s in JOB_STATUSES]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
