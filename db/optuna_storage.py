"""Optuna's storage, kept apart from the service tables.

Optuna creates its own tables (and its own ``alembic_version``). They go into a separate SQLite file
beside the main one (``foldtune.sqlite3`` -> ``foldtune-optuna.sqlite3``), or on PostgreSQL into their own
schema of the same database, selected with the libpq option ``-csearch_path=<schema>`` in the URL. The
schema is ``optuna``, or ``<main schema>_optuna`` when the main URL itself pins a search_path (tests run
each in a private schema).
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

_SEARCH_PATH = re.compile(r"-c\s*search_path\s*=\s*([A-Za-z_][A-Za-z0-9_]*)")


def _schema_of(url: URL) -> str | None:
    match = _SEARCH_PATH.search(str(url.query.get("options", "")))
    return match.group(1) if match else None


def optuna_schema(database_url: str) -> str | None:
    """The PostgreSQL schema Optuna's tables live in for this main URL (None for SQLite)."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        return None
    main = _schema_of(url)
    return f"{main}_optuna" if main else "optuna"


def optuna_storage_url(database_url: str) -> str:
    """The SQLAlchemy URL to give ``optuna.storages.RDBStorage`` for the service database ``database_url``."""
    url = make_url(database_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if url.database in (None, "", ":memory:"):
            return "sqlite://"  # an in-memory main database gets an in-memory study store
        path = Path(url.database)
        return url.set(database=str(path.with_name(f"{path.stem}-optuna{path.suffix or '.sqlite3'}"))) \
            .render_as_string(hide_password=False)
    if backend == "postgresql":
        schema = optuna_schema(database_url)
        options = _SEARCH_PATH.sub("", str(url.query.get("options", ""))).strip()
        options = f"{options} -csearch_path={schema}".strip()
        return url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    raise ValueError(f"no Optuna storage layout for database backend {backend!r}")


def ensure_optuna_storage(database_url: str) -> str:
    """Create what Optuna's storage needs that Optuna does not create itself (the PostgreSQL schema);
    returns :func:`optuna_storage_url`."""
    schema = optuna_schema(database_url)
    if schema is not None:
        engine = create_engine(database_url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        finally:
            engine.dispose()
    return optuna_storage_url(database_url)
