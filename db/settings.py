"""Where the service database lives: one URL, SQLite in a data directory unless told otherwise.

``FOLDTUNE_DATABASE_URL`` (any SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host/db``) wins. Without
it the database is ``<data dir>/foldtune.sqlite3`` where the data directory is ``FOLDTUNE_DATA_DIR`` or
``~/.foldtune``. The home directory (not the working directory) is the default so that ``foldtune keys
create`` and ``foldtune serve`` started from different directories find the same database.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = "~/.foldtune"
SQLITE_FILENAME = "foldtune.sqlite3"


@dataclass(frozen=True)
class DatabaseSettings:
    """The main database URL and the data directory SQLite files (main and Optuna's) are kept in."""

    url: str
    data_dir: Path

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


def default_data_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("FOLDTUNE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()


def database_settings(url: str | None = None, environ: dict[str, str] | None = None) -> DatabaseSettings:
    """Settings from an explicit URL, else ``FOLDTUNE_DATABASE_URL``, else the SQLite file in the data dir."""
    env = os.environ if environ is None else environ
    data_dir = default_data_dir(env)
    chosen = url or env.get("FOLDTUNE_DATABASE_URL")
    if not chosen:
        chosen = f"sqlite:///{data_dir / SQLITE_FILENAME}"
    return DatabaseSettings(url=chosen, data_dir=data_dir)
