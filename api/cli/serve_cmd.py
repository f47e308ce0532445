"""``foldtune serve``: migrate the database to head, then serve the API with uvicorn."""

from __future__ import annotations

import argparse
from dataclasses import replace

import uvicorn
from sqlalchemy.engine import make_url

from api.cli._db import migrate_or_explain
from api.http.app import create_app
from api.http.settings import ApiSettings
from db.migrate import head_revision

HELP = "migrate the database and serve the HTTP API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="interface to listen on (also: FOLDTUNE_HOST; default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (also: FOLDTUNE_PORT; default 8321)")
    parser.add_argument("--database-url", default=None,
                        help="SQLAlchemy URL (also: FOLDTUNE_DATABASE_URL; default SQLite in FOLDTUNE_DATA_DIR "
                             "or ~/.foldtune)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    settings = ApiSettings.from_env(args.database_url)
    settings = replace(settings, host=args.host or settings.host, port=args.port or settings.port)
    migrate_or_explain(settings.database_url)
    print(f"foldtune: database {_safe(settings.database_url)} at revision {head_revision()}", flush=True)
    print(f"foldtune: training paths confined to {settings.data_root}/<owner>/ (FOLDTUNE_DATA_ROOT); public URL "
          f"{settings.base_url} (FOLDTUNE_PUBLIC_URL)", flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _safe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
