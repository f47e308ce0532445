"""The CLI's HTTP client retries 429 (honouring Retry-After), 502/503/504 and lost connections where repeating
the request is safe, a bounded number of times; an httpx.MockTransport counts the tries and a recorder stands
in for sleep (nothing really waits)."""

from __future__ import annotations

import email.utils

import httpx
import pytest

from api.cli import submit_cmd
from api.cli._http import ApiClient, ApiClientError
from api.cli._retry import RetryPolicy, retry_after_seconds
from api.cli.main import main

PROBLEM = {"type": "urn:foldtune:problem:unavailable", "title": "Service unavailable", "status": 503}


class Server:
    """Answers each request with the next of ``answers`` (a status, a (status, headers) pair, or an exception
    to raise) and the last one from then on; ``requests`` holds what it was sent."""

    def __init__(self, *answers):
        self.answers, self.requests = list(answers), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        status, headers = answer if isinstance(answer, tuple) else (answer, {})
        body = {"ok": True} if status < 400 else {**PROBLEM, "status": status, "title": f"HTTP {status}"}
        return httpx.Response(status, json=body, headers=headers)


def client(server: Server, waits: list, **policy) -> ApiClient:
    return ApiClient("http://api.test", "key", retry=RetryPolicy(**policy), sleep=waits.append,
                     transport=httpx.MockTransport(server))


def test_get_is_retried_on_503_with_exponential_backoff():
    server, waits = Server(503, 502, 200), []
    assert client(server, waits).get("/v1/jobs") == {"ok": True}
    assert len(server.requests) == 3 and waits == [0.5, 1.0]


def test_429_waits_as_long_as_retry_after_says_even_for_a_post():
    # the rate limiter refuses before the service acts: a POST without a key may be sent again
    server, waits = Server((429, {"Retry-After": "7"}), (429, {"Retry-After": "3"}), 201), []
    assert client(server, waits).post("/v1/trainings", {"steps": 1}) == {"ok": True}
    assert len(server.requests) == 3 and waits == [7.0, 3.0]


def test_a_retry_after_on_503_is_honoured_too():
    server, waits = Server((503, {"Retry-After": "2"}), 200), []
    client(server, waits).get("/v1/best")
    assert waits == [2.0]


def test_attempts_are_bounded_and_the_error_says_how_many():
    server, waits = Server(504), []
    with pytest.raises(ApiClientError) as info:
        client(server, waits).get("/v1/jobs")
    assert len(server.requests) == 4 and waits == [0.5, 1.0, 2.0]
    assert str(info.value) == "HTTP 504 (after 4 tries)"
    server, waits = Server(503), []
    with pytest.raises(ApiClientError):
        client(server, waits, attempts=1).get("/v1/jobs")
    assert len(server.requests) == 1 and waits == []


def test_backoff_is_capped():
    server, waits = Server(503), []
    with pytest.raises(ApiClientError):
        client(server, waits, attempts=6, backoff_s=1.0, max_backoff_s=3.0).get("/v1/jobs")
    assert waits == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_a_post_that_may_have_been_acted_on_is_not_repeated():
    server, waits = Server(503, 201), []
    with pytest.raises(ApiClientError, match="HTTP 503"):
        client(server, waits).post("/v1/trainings", {"steps": 1})
    assert len(server.requests) == 1 and waits == []
    server, waits = Server(httpx.ReadTimeout("slow"), 201), []
    with pytest.raises(ApiClientError, match="did not answer in time"):
        client(server, waits).post("/v1/trainings", {"steps": 1})
    assert len(server.requests) == 1


def test_a_post_with_an_idempotency_key_or_marked_safe_is_repeated():
    server, waits = Server(502, httpx.RemoteProtocolError("dropped"), 201), []
    client(server, waits).post("/v1/jobs", {}, headers={"Idempotency-Key": "k1"})
    assert len(server.requests) == 3 and waits == [0.5, 1.0]
    assert {r.headers["Idempotency-Key"] for r in server.requests} == {"k1"}
    server, waits = Server(503, 200), []
    client(server, waits).post("/v1/jobs/1/cancel", safe=True)
    assert len(server.requests) == 2


def test_a_refused_connection_is_retried_for_any_method_and_reported_in_one_line():
    server, waits = Server(httpx.ConnectError("refused")), []
    with pytest.raises(ApiClientError) as info:
        client(server, waits).post("/v1/trainings", {"steps": 1})
    assert len(server.requests) == 4 and waits == [0.5, 1.0, 2.0]
    assert str(info.value) == ("cannot reach the foldtune API at http://api.test after 4 tries "
                               "(is `foldtune serve` running?)")
    server, waits = Server(httpx.ConnectError("refused"), 200), []
    assert client(server, waits).get("/v1/jobs") == {"ok": True} and waits == [0.5]


def test_other_problems_are_not_retried():
    for status in (400, 401, 404, 409, 422, 500):
        server, waits = Server(status), []
        with pytest.raises(ApiClientError):
            client(server, waits).get("/v1/jobs")
        assert len(server.requests) == 1 and waits == [], status


def test_a_retry_after_too_long_to_wait_for_is_reported_at_once():
    server, waits = Server((429, {"Retry-After": "600"}), 200), []
    with pytest.raises(ApiClientError) as info:
        client(server, waits, max_wait_s=60).get("/v1/jobs")
    assert len(server.requests) == 1 and waits == []
    assert str(info.value) == "HTTP 429 (the API asks to retry in 600 s)"


def test_retry_after_as_seconds_or_an_http_date():
    now = 1_700_000_000.0
    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds(email.utils.formatdate(now + 30, usegmt=True), now) == 30.0
    assert retry_after_seconds(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0  # past: at once
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    server, waits = Server((503, {"Retry-After": email.utils.formatdate(usegmt=True)}), 200), []
    client(server, waits).get("/v1/jobs")
    assert len(waits) == 1 and 0.0 <= waits[0] <= 1.0  # an HTTP date of now: (about) no wait


def test_submit_always_sends_an_idempotency_key_so_its_retries_store_one_job(monkeypatch, capsys):
    server, waits = Server(503, 201), []
    answer = {"id": 5, "status": "queued", "model": "tiny-moe", "cluster": {"num_gpus": 4, "gpu": "cpu"},
              "budget": {"max_trials": 3}}

    def fake(request):
        server(request)
        return httpx.Response(503, json=PROBLEM) if len(server.requests) == 1 else httpx.Response(201, json=answer)

    monkeypatch.setattr(submit_cmd.ApiClient, "from_args", classmethod(
        lambda cls, args: cls("http://api.test", "k", sleep=waits.append, transport=httpx.MockTransport(fake))))
    code = main(["submit", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", "--max-trials", "3"])
    assert code == 0 and capsys.readouterr().out.startswith("job 5 queued")
    keys = [r.headers.get("Idempotency-Key") for r in server.requests]
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1] and waits == [0.5]
