"""Alembic environment: the URL comes from the Config (see db.migrate), never from an ini file."""

from __future__ import annotations

from alembic import context

from db.engine import make_engine
from db.migrate import VERSION_TABLE
from db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite can only ALTER by copying tables
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(config.attributes["database_url"])
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; pass a database URL")
run_migrations_online()
