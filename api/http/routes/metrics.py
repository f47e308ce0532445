"""Prometheus ``/metrics`` through ``prometheus_client`` (text format 0.0.4), one registry per app.

Series and their labels, every label value from a bounded set:
- ``foldtune_http_requests_total{method,route,status}`` and ``foldtune_http_request_duration_seconds{method,route}``
  (histogram): ``method`` is one of :data:`METHODS` or ``other`` (an invented method never makes a new series),
  ``route`` the matched route *template* (``/v1/jobs/{job_id}``) or ``unmatched`` (an invented path never does);
  ``status`` the answer's status code, which the app chooses.
- ``foldtune_jobs_submitted_total``: jobs stored by this API process.
- read from the database at each scrape (all owners): ``foldtune_queue_depth{kind}`` (queued jobs and trainings),
  ``foldtune_jobs{status}``, ``foldtune_trials{status}``, ``foldtune_trainings{status}`` over the fixed status
  sets, ``foldtune_runner_heartbeat_timestamp_seconds{runner}`` and ``..._age_seconds{runner}`` for each runner
  holding running work, and ``foldtune_training_step_seconds`` (histogram of every stored training step's time).
"""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from db.models import JOB_STATUSES, TRAINING_STATUSES, TRIAL_STATUSES, Job, Training, Trial
from db.stats import count_by_status, runner_heartbeats, step_time_histogram

router = APIRouter(tags=["operations"])

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
# seconds: request latencies from a cached GET (~1 ms) to a large plan (~10 s)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# seconds per optimizer step: a CPU proxy (~10 ms) to a large model on many GPUs (~1 min)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def method_label(method: str) -> str:
    """The request method as a label: one of :data:`METHODS`, else ``other``."""
    upper = method.upper()
    return upper if upper in METHODS else "other"


class _DatabaseCollector:
    """Gauges and the step-time histogram read from the service database when Prometheus scrapes."""

    def __init__(self, sessions) -> None:
        self._sessions = sessions

    def collect(self):
        with self._sessions() as session:
            jobs = count_by_status(session, Job)
            trials = count_by_status(session, Trial)
            trainings = count_by_status(session, Training)
            beats = runner_heartbeats(session)
            buckets, count, total = step_time_histogram(session, STEP_BUCKETS)
            session.commit()
        queue = GaugeMetricFamily("foldtune_queue_depth", "Queued work waiting for a runner (all owners).",
                                  labels=["kind"])
        queue.add_metric(["job"], jobs.get("queued", 0))
        queue.add_metric(["training"], trainings.get("queued", 0))
        yield queue
        for name, what, counts, statuses in (("foldtune_jobs", "Tuning jobs", jobs, JOB_STATUSES),
                                             ("foldtune_trials", "Trials", trials, TRIAL_STATUSES),
                                             ("foldtune_trainings", "Trainings", trainings, TRAINING_STATUSES)):
            family = GaugeMetricFamily(name, f"{what} in the database by status (all owners).", labels=["status"])
            for status in statuses:
                family.add_metric([status], counts.get(status, 0))
            yield family
        now = datetime.now(timezone.utc)
        stamp = GaugeMetricFamily("foldtune_runner_heartbeat_timestamp_seconds",
                                  "Unix time of the latest heartbeat of each runner holding running work.",
                                  labels=["runner"])
        age = GaugeMetricFamily("foldtune_runner_heartbeat_age_seconds",
                                "Seconds since that heartbeat (a stalled runner grows it).", labels=["runner"])
        for runner, at in sorted(beats.items()):
            at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
            stamp.add_metric([runner], at.timestamp())
            age.add_metric([runner], max(0.0, (now - at).total_seconds()))
        yield stamp
        yield age
        yield HistogramMetricFamily(
            "foldtune_training_step_seconds", "Measured seconds per optimizer step of every stored training step.",
            buckets=[(repr(b), n) for b, n in zip(STEP_BUCKETS, buckets)] + [("+Inf", count)], sum_value=total)


class Metrics:
    """The request series of one app instance and its registry (also holding the database collector)."""

    def __init__(self, sessions=None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("foldtune_http_requests", "HTTP requests served, by method, route template and "
                                "status.", ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("foldtune_http_request_duration_seconds", "Seconds from request to response, by "
                                 "method and route template.", ["method", "route"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.jobs_submitted = Counter("foldtune_jobs_submitted", "Jobs stored by this API process.",
                                      registry=self.registry)
        if sessions is not None:
            self.registry.register(_DatabaseCollector(sessions))

    def count_request(self, method: str, route: str, status: int, seconds: float | None = None) -> None:
        method = method_label(method)
        self.requests.labels(method, route, str(status)).inc()
        if seconds is not None:
            self.latency.labels(method, route).observe(seconds)

    def count_job_submitted(self) -> None:
        self.jobs_submitted.inc()


@router.get("/metrics", operation_id="get_metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def get_metrics(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)
