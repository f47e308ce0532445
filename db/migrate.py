"""Apply the Alembic migrations programmatically (``foldtune serve`` does it before serving).

Alembic's version table is ``foldtune_alembic_version`` rather than the default ``alembic_version``,
so that Optuna (which also uses Alembic) can never read or overwrite our schema version, wherever its
tables end up. Run by hand with ``python -m db.migrate [URL]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from db.settings import database_settings

VERSION_TABLE = "foldtune_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic Config for ``url`` without an alembic.ini."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` up to ``revision`` (creating it when it is an empty SQLite file)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
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
