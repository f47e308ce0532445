"""Where the service database lives: one URL, SQLite in a data directory unless told otherwise.

``FOLDTUNE_DATABASE_URL`` (any SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host/db``) wins. Without
it the database is ``<data dir>/foldtune.sqlite3`` where the data directory is ``FOLDTUNE_DATA_DIR`` or
``~/.foldtune``. The home directory (not the working directory) is the default so that ``foldtune keys
create`` and ``foldtune serve`` started from different directories find the same database.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = "~/.foldtune"
SQLITE_FILENAME = "foldtune.sqlite3"
DATA_DIR_VARIABLE = "FOLDTUNE_DATA_DIR"
DATABASE_URL_VARIABLE = "FOLDTUNE_DATABASE_URL"
# the variables this module reads and their defaults (None: derived, see database_settings); docs/settings.md
# lists them with the pydantic-settings groups of api/ (tests/api/test_settings.py checks both)
VARIABLES: dict[str, str | None] = {DATA_DIR_VARIABLE: DEFAULT_DATA_DIR, DATABASE_URL_VARIABLE: None}


@dataclass(frozen=True)
class DatabaseSettings:
    """The main database URL and the data directory SQLite files (main and Optuna's) are kept in."""

    url: str
    data_dir: Path

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


def _variable(name: str, environ: Mapping[str, str] | None) -> str | None:
    """``name`` from ``environ`` (default: the process environment); empty counts as unset, as in api/'s groups."""
    value = (os.environ if environ is None else environ).get(name, "")
    return value or None


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``FOLDTUNE_DATA_DIR``, else ``~/.foldtune``, from ``environ`` (default: the process environment)."""
    return Path(_variable(DATA_DIR_VARIABLE, environ) or DEFAULT_DATA_DIR).expanduser()


def database_settings(url: str | None = None, environ: Mapping[str, str] | None = None) -> DatabaseSettings:
    """Settings from an explicit URL, else ``FOLDTUNE_DATABASE_URL``, else the SQLite file in the data dir."""
    data_dir = default_data_dir(environ)
    chosen = url or _variable(DATABASE_URL_VARIABLE, environ) or f"sqlite:///{data_dir / SQLITE_FILENAME}"
    return DatabaseSettings(url=chosen, data_dir=data_dir)
