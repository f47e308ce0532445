"""Request rate limits of the HTTP service: a token bucket per API key, and one per client address for
requests whose key is missing or unknown (so guessing keys is as slow as the limit, whoever sends them).

A bucket holds at most ``burst`` tokens and gains ``rate_per_s`` per second; a request takes one, and a
request that finds none is answered 429 with ``Retry-After`` (whole seconds until the next token). The
buckets live in the API process's memory: with several API processes each one applies the limit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

MAX_BUCKETS = 100_000  # full buckets are forgotten beyond this many, so that many addresses cannot fill memory


class RateLimiter:
    """Token buckets keyed by any string (``key:<hash>``, ``addr:<ip>``); thread-safe."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float | None:
        """Take one token from ``key``'s bucket: None when there was one, else the seconds until there is."""
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                if len(self._buckets) > MAX_BUCKETS:
                    self._forget_full(now)
                return None
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate_per_s

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled: forgetting them changes no answer."""
        full = [k for k, (tokens, at) in self._buckets.items()
                if tokens + (now - at) * self.rate_per_s >= self.burst]
        for k in full:
            del self._buckets[k]


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
