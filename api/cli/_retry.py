"""When and how long the CLI's HTTP client waits before trying a request again.

Retried, at most ``attempts`` tries in all:
- 429 Too Many Requests, any method: the service refuses it before doing anything (api/http/ratelimit.py);
- 502, 503, 504 and a connection lost after the request was sent (a read timeout, a dropped connection):
  only a request that is safe to repeat: GET/HEAD/OPTIONS, or one the caller marks safe (a POST carrying an
  ``Idempotency-Key``, a cancel, a plan that stores nothing);
- a connection that could not be made (refused, or a connect timeout): any method, nothing was sent.

The wait is the answer's ``Retry-After`` (seconds, or an HTTP date) when it has one, else exponential backoff
``backoff_s × 2^(try - 1)`` capped at ``max_backoff_s``. A ``Retry-After`` longer than ``max_wait_s`` is not
waited for: the error is reported at once, saying when to try again.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from datetime import timezone

RETRY_STATUSES = frozenset({429, 502, 503, 504})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: tries in all (1: never retry); ``backoff_s``/``max_backoff_s``: the first wait without a
    ``Retry-After`` and its cap (seconds); ``max_wait_s``: the longest ``Retry-After`` honoured (seconds)."""

    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0 or self.max_wait_s < 0:
            raise ValueError("a retry policy needs attempts >= 1 and waits >= 0")

    def backoff(self, tried: int) -> float:
        """Seconds to wait after the ``tried``-th failed try (1-based) when the answer names no wait."""
        return min(self.backoff_s * 2 ** (tried - 1), self.max_backoff_s)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (never negative), None when absent or unreadable.
    ``now`` (Unix seconds, default the clock) is what an HTTP date is counted from."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is read as such
        when = when.replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def repeatable(method: str, headers: dict[str, str] | None, safe: bool | None) -> bool:
    """Whether a request may be sent again after the server may have acted on it: ``safe`` when the caller
    says, else a safe method or a request carrying an ``Idempotency-Key``."""
    if safe is not None:
        return safe
    return method.upper() in SAFE_METHODS or any(k.lower() == "idempotency-key" for k in (headers or {}))
