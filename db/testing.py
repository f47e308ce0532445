"""Throw-away databases for tests: a SQLite file in a directory, or a private PostgreSQL schema.

The PostgreSQL server is the one CI and the development machines run at 127.0.0.1:5432 (trust auth,
database ``test``), overridable with ``FOLDTUNE_TEST_POSTGRES_URL``. Each test gets its own schema
(``ft_test_<random>``), selected by ``-csearch_path`` in the URL, dropped afterwards together with the
Optuna schema beside it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_TEST_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def postgres_test_url() -> str:
    return os.environ.get("FOLDTUNE_TEST_POSTGRES_URL", DEFAULT_TEST_POSTGRES_URL)


def postgres_unavailable_reason() -> str | None:
    """None when the test PostgreSQL server answers, else why not (one line, for pytest.skip)."""
    url = postgres_test_url()
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # any failure to connect means the same thing to a test: no server
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"PostgreSQL at {make_url(url).render_as_string(hide_password=True)} unreachable: {first}"
    return None


REQUIRE_POSTGRES_ENV = "FOLDTUNE_REQUIRE_POSTGRES"


def postgres_required(environ: dict[str, str] | None = None) -> bool:
    """True where PostgreSQL is part of the test environment (CI sets FOLDTUNE_REQUIRE_POSTGRES=1): there an
    unreachable server fails the PostgreSQL tests instead of skipping them, so that they cannot silently
    stop running."""
    env = os.environ if environ is None else environ
    return env.get(REQUIRE_POSTGRES_ENV, "").strip() not in ("", "0")


@contextmanager
def temporary_postgres_schema() -> Iterator[str]:
    """Yield a database URL whose search_path is a fresh schema; drop it (and its Optuna schema) after."""
    base = postgres_test_url()
    schema = f"ft_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}) \
            .render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}_optuna" CASCADE'))
        admin.dispose()


@contextmanager
def temporary_database(kind: str, directory) -> Iterator[str]:
    """An empty database URL: ``kind`` 'sqlite' (a file in ``directory``) or 'postgres' (a private schema;
    check :func:`postgres_unavailable_reason` first)."""
    if kind == "sqlite":
        yield f"sqlite:///{directory}/foldtune.sqlite3"
    elif kind == "postgres":
        with temporary_postgres_schema() as url:
            yield url
    else:
        raise ValueError(f"unknown database kind {kind!r}; use 'sqlite' or 'postgres'")
