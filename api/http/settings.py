"""Settings of the HTTP service, read from the environment (``FOLDTUNE_*``, :class:`ServiceEnv`, with
pydantic-settings) or given explicitly.

Every limit of the multi-user service is here, with its environment variable and default (the table in
docs/service.md, "Limits"; every variable in docs/settings.md). Limits counted in memory (the request rate)
hold per API process.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import field_validator
from pydantic_settings import NoDecode

from api.service.paths import default_data_root
from api.service.quotas import Quotas
from api.env_settings import FoldtuneEnv
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


class ServiceEnv(FoldtuneEnv):
    """The service's own variables (the database, data root and quotas have their groups): ``FOLDTUNE_HOST``,
    ``FOLDTUNE_PORT``, ``FOLDTUNE_PUBLIC_URL``, ``FOLDTUNE_MAX_BODY_BYTES``, ``FOLDTUNE_RATE_LIMIT_PER_S``,
    ``FOLDTUNE_RATE_LIMIT_BURST``, ``FOLDTUNE_PLAN_SECONDS``, ``FOLDTUNE_PLAN_CONCURRENCY``,
    ``FOLDTUNE_TRUSTED_PROXIES`` (comma-separated) and ``FOLDTUNE_SHUTDOWN_SECONDS``; their meaning and bounds
    are :class:`ApiSettings`'s."""

    what = "service"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    public_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    rate_limit_per_s: float = DEFAULT_RATE_PER_S
    rate_limit_burst: int = DEFAULT_RATE_BURST
    plan_seconds: float = DEFAULT_PLAN_SECONDS
    plan_concurrency: int = DEFAULT_PLAN_CONCURRENCY
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = ()  # "a, b/24": comma-separated, not JSON
    shutdown_seconds: float = DEFAULT_SHUTDOWN_SECONDS

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return tuple(p.strip() for p in value.split(",") if p.strip()) if isinstance(value, str) else value


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
    def from_env(cls, database_url: str | None = None, environ: Mapping[str, str] | None = None) -> ApiSettings:
        """The settings of ``environ`` (default: the process environment); ``database_url`` wins over
        ``FOLDTUNE_DATABASE_URL``. SpecError, one line naming the variable, for a bad value."""
        env, quotas = ServiceEnv.read(environ), Quotas.from_env(environ)  # each names its own bad variable
        try:
            return cls(database_url=database_settings(database_url, environ).url, host=env.host, port=env.port,
                       public_url=env.public_url, data_root=default_data_root(environ),
                       max_body_bytes=env.max_body_bytes, rate_per_s=env.rate_limit_per_s,
                       rate_burst=env.rate_limit_burst, quotas=quotas,
                       plan_seconds=env.plan_seconds, plan_concurrency=env.plan_concurrency,
                       trusted_proxies=env.trusted_proxies, shutdown_seconds=env.shutdown_seconds)
        except SpecError as exc:  # the bounds checked by __post_init__
            raise SpecError(f"bad service setting in the environment: {exc}") from None
