"""Apply the Alembic migrations programmatically (``foldtune serve`` does it before serving).

Alembic's version table is ``foldtune_alembic_version`` rather than the default ``alembic_version``,
so that Optuna (which also uses Alembic) can never read or overwrite our schema version, wherever its
tables end up. Run by hand with ``python -m db.migrate [URL]``.

Migrations run under a lock, because every process of a deployment migrates on start (docker compose
starts the API and the runner at once on an empty database): on PostgreSQL a session-level advisory lock
keyed by the schema, on a SQLite file an exclusive ``flock`` on ``<database file>.migrate.lock``. The second
migrator waits, then finds the database at head and has nothing to do (without the lock both created the
version table and one crashed with a unique violation).
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from sqlalchemy import text
from sqlalchemy.engine import make_url

from db.engine import make_engine
from db.settings import database_settings

VERSION_TABLE = "foldtune_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# First key of the two-key PostgreSQL advisory lock (any constant of our own); the second is the schema's hash.
ADVISORY_LOCK_CLASS = 0x0F01D7


@contextlib.contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold the database's migration lock (see the module docstring) for the duration of the block; an
    in-memory SQLite database has no other process to fear and is not locked."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or "mode=memory" in url:
            yield
            return
        lock_path = Path(database).expanduser().with_name(Path(database).name + ".migrate.lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            # The schema the URL selects (search_path), so that databases in other schemas migrate in parallel.
            key = text("SELECT pg_advisory_lock(:cls, hashtext(current_schema()))")
            conn.execute(key, {"cls": ADVISORY_LOCK_CLASS})
            conn.commit()  # a session-level lock outlives the transaction; the migration runs on its own connection
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:cls, hashtext(current_schema()))"),
                             {"cls": ADVISORY_LOCK_CLASS})
                conn.commit()
    finally:
        engine.dispose()


def alembic_config(url: str) -> Config:
    """An Alembic Config for ``url`` without an alembic.ini."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` up to ``revision`` (creating it when it is an empty SQLite file), under
    the migration lock."""
    with migration_lock(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    with migration_lock(url):
        command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine) -> str | None:
    """The revision the database behind ``engine`` is at, or None when it was never migrated."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    url = database_settings(args[0] if args else None).url
    upgrade(url)
    print(f"database at head {head_revision()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
