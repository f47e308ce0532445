"""Settings of the HTTP service, read from the environment (``FOLDTUNE_*``) or given explicitly.

Every limit of the multi-user service is here, with its environment variable and default (the table in
docs/service.md, "Limits"). Limits counted in memory (the request rate) hold per API process.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from api.service.paths import default_data_root
from api.service.quotas import Quotas
from db.settings import database_settings
from spec.errors import SpecError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8321
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: the largest legitimate body is a measured hardware profile (~100 KB)
DEFAULT_RATE_PER_S = 20.0
DEFAULT_RATE_BURST = 200
DEFAULT_PLAN_SECONDS = 30.0  # the largest bounded plans take seconds; the rest of the limit is for a loaded host
DEFAULT_PLAN_CONCURRENCY = 2  # planning runs at once (each up to about 0.5 GB and one CPU core)
DEFAULT_SHUTDOWN_SECONDS = 5.0  # how long `foldtune serve` lets requests in flight finish after SIGTERM


@dataclass(frozen=True)
class ApiSettings:
    """``database_url``: SQLAlchemy URL of the service database (see db.settings for the default);
    ``host``/``port``: where ``foldtune serve`` listens; ``public_url``: the base URL clients reach the
    service at, from which ``Location`` headers are built (default ``http://<host>:<port>``; never the
    client's ``Host`` header); ``data_root``: the directory whose ``<owner>/`` subdirectories hold the
    only server paths an owner may name (api.service.paths); ``max_body_bytes``: the largest request body
    (413 beyond); ``rate_per_s``/``rate_burst``: requests per second each API key may send on average and
    at once (and each client address with a missing or unknown key), 429 beyond; ``quotas``: what each
    owner may store (api.service.quotas); ``plan_seconds``/``plan_concurrency``: the wall-clock limit of one
    request's planning and how many plan at once (api.service.planning), 503 beyond; ``trusted_proxies``:
    the addresses (or networks) whose ``X-Forwarded-For``/``X-Forwarded-Proto`` name the client (none by
    default: the connection's address is the client's, whatever headers it sends); ``shutdown_seconds``:
    after SIGTERM, how long requests in flight may finish before ``foldtune serve`` closes them and exits."""

    database_url: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    public_url: str | None = None
    data_root: Path = field(default_factory=default_data_root)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    rate_per_s: float = DEFAULT_RATE_PER_S
    rate_burst: int = DEFAULT_RATE_BURST
    quotas: Quotas = field(default_factory=Quotas)
    plan_seconds: float = DEFAULT_PLAN_SECONDS
    plan_concurrency: int = DEFAULT_PLAN_CONCURRENCY
    trusted_proxies: tuple[str, ...] = ()
    shutdown_seconds: float = DEFAULT_SHUTDOWN_SECONDS

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.rate_per_s <= 0 or self.rate_burst < 1:
            raise SpecError("FOLDTUNE_MAX_BODY_BYTES, FOLDTUNE_RATE_LIMIT_PER_S and FOLDTUNE_RATE_LIMIT_BURST "
                            "must be positive")
        if not (self.plan_seconds > 0 and self.plan_concurrency >= 1 and self.shutdown_seconds >= 0):
            raise SpecError("FOLDTUNE_PLAN_SECONDS and FOLDTUNE_PLAN_CONCURRENCY must be positive, "
                            "FOLDTUNE_SHUTDOWN_SECONDS not negative")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise SpecError(f"FOLDTUNE_TRUSTED_PROXIES: {proxy!r} is not an IP address or network") from None
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise SpecError(f"FOLDTUNE_PUBLIC_URL must start with http:// or https://, got {self.public_url!r}")

    @property
    def base_url(self) -> str:
        """The public base URL without a trailing slash."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @classmethod
    def from_env(cls, database_url: str | None = None, environ: dict[str, str] | None = None) -> ApiSettings:
        env = os.environ if environ is None else environ
        try:
            return cls(database_url=database_settings(database_url, env).url,
                       host=env.get("FOLDTUNE_HOST", DEFAULT_HOST),
                       port=int(env.get("FOLDTUNE_PORT", DEFAULT_PORT)),
                       public_url=env.get("FOLDTUNE_PUBLIC_URL") or None,
                       data_root=default_data_root(env),
                       max_body_bytes=int(env.get("FOLDTUNE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)),
                       rate_per_s=float(env.get("FOLDTUNE_RATE_LIMIT_PER_S", DEFAULT_RATE_PER_S)),
                       rate_burst=int(env.get("FOLDTUNE_RATE_LIMIT_BURST", DEFAULT_RATE_BURST)),
                       quotas=Quotas.from_env(env),
                       plan_seconds=float(env.get("FOLDTUNE_PLAN_SECONDS", DEFAULT_PLAN_SECONDS)),
                       plan_concurrency=int(env.get("FOLDTUNE_PLAN_CONCURRENCY", DEFAULT_PLAN_CONCURRENCY)),
                       trusted_proxies=tuple(p.strip() for p in env.get("FOLDTUNE_TRUSTED_PROXIES", "").split(",")
                                             if p.strip()),
                       shutdown_seconds=float(env.get("FOLDTUNE_SHUTDOWN_SECONDS", DEFAULT_SHUTDOWN_SECONDS)))
        except ValueError as exc:
            raise SpecError(f"bad service setting in the environment: {exc}") from None
