"""Where the service database lives: one URL, SQLite in a data directory unless told otherwise.

``FOLDTUNE_DATABASE_URL`` (any SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host/db``) wins. Without
it the database is ``<data dir>/foldtune.sqlite3`` where the data directory is ``FOLDTUNE_DATA_DIR`` or
``~/.foldtune``. The home directory (not the working directory) is the default so that ``foldtune keys
create`` and ``foldtune serve`` started from different directories find the same database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from db.env_settings import FoldtuneEnv

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


class DatabaseEnv(FoldtuneEnv):
    """``FOLDTUNE_DATA_DIR`` (``~`` expanded) and ``FOLDTUNE_DATABASE_URL`` (None: the SQLite file)."""

    what = "database"
    data_dir: str = DEFAULT_DATA_DIR
    database_url: str | None = None


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``FOLDTUNE_DATA_DIR``, else ``~/.foldtune``, from ``environ`` (default: the process environment)."""
    return Path(DatabaseEnv.read(environ).data_dir).expanduser()


def database_settings(url: str | None = None, environ: Mapping[str, str] | None = None) -> DatabaseSettings:
    """Settings from an explicit URL, else ``FOLDTUNE_DATABASE_URL``, else the SQLite file in the data dir."""
    env = DatabaseEnv.read(environ)
    data_dir = Path(env.data_dir).expanduser()
    chosen = url or env.database_url or f"sqlite:///{data_dir / SQLITE_FILENAME}"
    return DatabaseSettings(url=chosen, data_dir=data_dir)
