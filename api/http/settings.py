"""Settings of the HTTP service, read from the environment (``FOLDTUNE_*``) or given explicitly."""

from __future__ import annotations

import os
from dataclasses import dataclass

from db.settings import database_settings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8321


@dataclass(frozen=True)
class ApiSettings:
    """``database_url``: SQLAlchemy URL of the service database (see db.settings for the default);
    ``host``/``port``: where ``foldtune serve`` listens."""

    database_url: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT

    @classmethod
    def from_env(cls, database_url: str | None = None, environ: dict[str, str] | None = None) -> ApiSettings:
        env = os.environ if environ is None else environ
        return cls(database_url=database_settings(database_url, env).url,
                   host=env.get("FOLDTUNE_HOST", DEFAULT_HOST),
                   port=int(env.get("FOLDTUNE_PORT", DEFAULT_PORT)))
