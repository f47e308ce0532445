"""Opening the local service database from the CLI: migrate it, and report a database that cannot be
reached or migrated as one FoldtuneError line instead of a driver traceback."""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from spec.errors import FoldtuneError
from db.migrate import upgrade


class DatabaseUnavailableError(FoldtuneError):
    """The database URL cannot be opened or migrated."""


def migrate_or_explain(url: str) -> None:
    """``db.migrate.upgrade(url)``; database failures become a DatabaseUnavailableError naming the URL."""
    try:
        safe = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise DatabaseUnavailableError(f"not a database URL: {url!r}") from None
    try:
        upgrade(url)
    except (SQLAlchemyError, OSError) as exc:
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DatabaseUnavailableError(f"cannot open the database {safe}: {first}") from None
