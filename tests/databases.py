"""The tests' migrated databases, migrated once per session and handed to each test empty.

A SQLite test gets a copy of a file migrated once (copying is faster than migrating). A PostgreSQL test gets
the session's one migrated schema, emptied after each test: every table but the version table truncated
(identities restarted, so ids start at 1 as in a fresh schema) and the Optuna schema beside it dropped.
Tests that migrate themselves or need a schema of their own ask for an empty database instead
(``db.testing.temporary_database``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from db.migrate import VERSION_TABLE, current_revision, head_revision, upgrade
from db.optuna_storage import optuna_schema
from db.testing import postgres_required

# how long emptying the schema waits for a lock: a test that left a transaction open holds one, and the
# teardown then fails naming it instead of hanging the session
LOCK_TIMEOUT = "20s"


def database_kind(request, postgres_reason: str | None) -> str:
    """The parameter of a ``db_kind`` fixture, PostgreSQL skipped where unreachable, and failed instead where
    FOLDTUNE_REQUIRE_POSTGRES says it is part of the environment, as in CI."""
    if request.param == "postgres" and postgres_reason:
        if postgres_required():  # CI: the PostgreSQL half of the suite must run, not vanish as skips
            pytest.fail(f"{postgres_reason} (FOLDTUNE_REQUIRE_POSTGRES is set)")
        pytest.skip(postgres_reason)
    return request.param


def copy_sqlite(template: Path, directory: Path) -> str:
    """A migrated SQLite database of its own in ``directory``, copied from ``template``; its URL."""
    path = directory / "foldtune.sqlite3"
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


@dataclass(frozen=True)
class MigratedSchema:
    """A PostgreSQL schema at head: its URL (which selects it), its name, its tables and the head revision."""

    url: str
    name: str
    tables: frozenset[str]
    revision: str


def migrate_schema(url: str) -> MigratedSchema:
    """Migrate the empty schema ``url`` selects to head and note what a fresh migration leaves there."""
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            name = conn.scalar(text("SELECT current_schema()"))
        return MigratedSchema(url, name, frozenset(inspect(engine).get_table_names()), head_revision())
    finally:
        engine.dispose()


def empty_postgres_schema(schema: MigratedSchema) -> None:
    """Delete every row of ``schema`` (the version row kept) and drop its Optuna schema, so that the next test
    finds it as a fresh migration leaves it. A schema a test changed otherwise (a table gone or added, the
    version row deleted) is dropped and migrated again."""
    engine = create_engine(schema.url)
    try:
        intact = (frozenset(inspect(engine).get_table_names()) == schema.tables
                  and current_revision(engine) == schema.revision)
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            if intact:
                names = ", ".join(f'"{t}"' for t in sorted(schema.tables - {VERSION_TABLE}))
                conn.execute(text(f"TRUNCATE TABLE {names} RESTART IDENTITY CASCADE"))
            else:
                conn.execute(text(f'DROP SCHEMA "{schema.name}" CASCADE'))
                conn.execute(text(f'CREATE SCHEMA "{schema.name}"'))
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{optuna_schema(schema.url)}" CASCADE'))
    finally:
        engine.dispose()
    if not intact:
        upgrade(schema.url)
