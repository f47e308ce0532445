"""The CLI's HTTP client for the foldtune API: base URL and key from flags or FOLDTUNE_URL /
FOLDTUNE_API_KEY, retries with backoff where repeating a request is safe (api/cli/_retry.py), and every
failure (no server, a problem response) as one FoldtuneError line."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import httpx

from api.cli.arguments import add
from api.cli._local_key import given_key, key_file
from api.cli._retry import RETRY_STATUSES, RetryPolicy, repeatable, retry_after_seconds
from api.cli.settings import ClientEnv
from spec.errors import FoldtuneError


class ApiClientError(FoldtuneError):
    """The API could not be reached or answered with a problem."""


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    add(parser, "--url")
    add(parser, "--api-key")


class ApiClient:
    """Calls ``/v1`` endpoints and returns their JSON bodies. ``retry`` says how often and how long to wait
    (``sleep(seconds)`` waits; tests pass a recorder); ``transport`` replaces the network (tests)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 30.0, *,
                 retry: RetryPolicy = RetryPolicy(), sleep: Callable[[float], None] = time.sleep,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.retry, self._sleep = retry, sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ApiClient:
        """The client of ``--url``/``--api-key``, else of the environment (:class:`ClientEnv`)."""
        env = ClientEnv.read()
        key = given_key(args.api_key)
        if not key:
            raise ApiClientError(f"no API key: pass --api-key or set FOLDTUNE_API_KEY (create one with "
                                 f"`foldtune keys create NAME`; `foldtune tune` writes one to {key_file()})")
        return cls(args.url or env.url, key, retry=RetryPolicy(attempts=env.http_attempts))

    def request(self, method: str, path: str, *, safe: bool | None = None, **kwargs: Any) -> Any:
        """The JSON body of ``method path``, tried up to ``retry.attempts`` times (api/cli/_retry.py says when);
        ``safe``: whether the request may be repeated after the server may have acted on it (default: GET and
        friends, or an ``Idempotency-Key`` header)."""
        again = repeatable(method, kwargs.get("headers"), safe)
        for tried in range(1, self.retry.attempts + 1):
            last = tried == self.retry.attempts
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                may_retry, message = self._failure(exc, path, again)
                if last or not may_retry:
                    raise ApiClientError(message(_tries(tried))) from None
                self._sleep(self.retry.backoff(tried))
                continue
            status = response.status_code
            if status in RETRY_STATUSES and not last and (status == 429 or again):
                wait = retry_after_seconds(response.headers.get("Retry-After"))
                if wait is None:
                    wait = self.retry.backoff(tried)
                elif wait > self.retry.max_wait_s:  # not worth blocking on: say when instead
                    raise ApiClientError(f"{_problem_line(response)} (the API asks to retry in {wait:.0f} s)")
                self._sleep(wait)
                continue
            if status >= 400:
                tries = _tries(tried).strip()
                raise ApiClientError(_problem_line(response) + (f" ({tries})" if tries else ""))
            return response.json()
        raise AssertionError("unreachable: the last try returns or raises")

    def _failure(self, exc: httpx.HTTPError, path: str, again: bool) -> tuple[bool, Callable[[str], str]]:
        """Whether a request that failed with ``exc`` may be tried again, and its error message given the
        tries text (``" after 4 tries"``)."""
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):  # nothing was sent: any request may
            return True, lambda tries: (f"cannot reach the foldtune API at {self.url}{tries} "
                                        "(is `foldtune serve` running?)")
        if isinstance(exc, httpx.TimeoutException):  # sent, maybe acted on: only what is safe to repeat
            return again, lambda tries: f"the foldtune API at {self.url} did not answer in time{tries}"
        # a broken connection (sent, maybe acted on) or an HTTP error of httpx's own
        return again and isinstance(exc, httpx.TransportError), \
            lambda tries: f"request to {self.url}{path} failed{tries}: {exc}"

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None,
             safe: bool | None = None) -> Any:
        """``safe=True`` for a POST that may be sent twice (a cancel, a plan); one with an ``Idempotency-Key``
        header is safe already."""
        return self.request("POST", path, json=body, headers=headers, safe=safe)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tries(tried: int) -> str:
    """``" after 4 tries"`` once a request was retried, else nothing."""
    return f" after {tried} tries" if tried > 1 else ""


def _problem_line(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code} from the API: {response.text[:200]}"
    title = body.get("title") or f"HTTP {response.status_code}"
    rules = body.get("errors") or []
    if rules:
        return f"{title}: " + "; ".join(f"{r.get('loc')}: {r.get('message')} [{r.get('rule')}]" for r in rules)
    return f"{title}: {body['detail']}" if body.get("detail") else title

