"""Engines and sessions for the service database (SQLite or PostgreSQL).

SQLite is tuned for several threads and processes sharing one file: WAL journal, foreign keys on, a
busy timeout, and every transaction opened with ``BEGIN IMMEDIATE``. The last one matters for
correctness: a deferred SQLite transaction that reads and then writes fails at once with "database is
locked" when another connection wrote in between (the busy timeout cannot help there), whereas an
immediate one waits its turn. The price is that SQLite transactions are serialised, so keep them short.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _is_memory(url) -> bool:
    return url.database in (None, "", ":memory:") or "mode=memory" in str(url)


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An Engine for ``url``; for a SQLite file its directory is created on the way."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs: dict = {"connect_args": {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}}
        if _is_memory(parsed):
            kwargs["poolclass"] = StaticPool  # one shared connection, else every connection sees a new DB
        else:
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, echo=echo, **kwargs)
        _tune_sqlite(engine)
        return engine
    return create_engine(parsed, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Take transaction control away from the sqlite3 module so that "begin" below decides.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (responses are built after the commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def is_postgres(engine_or_session) -> bool:
    bind = engine_or_session.get_bind() if isinstance(engine_or_session, Session) else engine_or_session
    return bind.dialect.name == "postgresql"


def ping(engine: Engine) -> None:
    """One round trip to the database; raises whatever the driver raises when it does not answer."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
