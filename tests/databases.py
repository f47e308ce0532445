"""The tests' migrated databases, migrated once per session and handed to each test empty.

A SQLite test gets a copy of a file migrated once (copying is faster than migrating). A PostgreSQL test gets
the session's one migrated schema, emptied after each test: every table but the version table truncated
(identities restarted, so ids start at 1 as in a fresh schema) and the Optuna schema beside it dropped.
Tests that migrate themselves or need a schema of their own ask for an empty database instead
(``db.testing.temporary_database``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sqlalchemy import create_engine, inspect, text

from db.migrate import VERSION_TABLE
from db.optuna_storage import optuna_schema

# how long emptying the schema waits for a lock: a test that left a transaction open holds one, and the
# teardown then fails naming it instead of hanging the session
LOCK_TIMEOUT = "20s"


def copy_sqlite(template: Path, directory: Path) -> str:
    """A migrated SQLite database of its own in ``directory``, copied from ``template``; its URL."""
    path = directory / "foldtune.sqlite3"
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


def empty_postgres_schema(url: str) -> None:
    """Delete every row of the migrated schema ``url`` selects (the version row kept) and drop its Optuna
    schema, so that the next test finds it as a fresh migration leaves it."""
    engine = create_engine(url)
    try:
        tables = [t for t in inspect(engine).get_table_names() if t != VERSION_TABLE]
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            if tables:
                names = ", ".join(f'"{t}"' for t in tables)
                conn.execute(text(f"TRUNCATE TABLE {names} RESTART IDENTITY CASCADE"))
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{optuna_schema(url)}" CASCADE'))
    finally:
        engine.dispose()
