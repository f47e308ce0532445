"""``foldtune serve``: migrate the database to head, then serve the API with uvicorn.

Two of uvicorn's defaults are replaced: it would trust ``X-Forwarded-For`` from 127.0.0.1 (so any local
client could pick the address the per-address rate limit counts); here only FOLDTUNE_TRUSTED_PROXIES are
trusted, none by default. And after SIGTERM it would wait for every request in flight however long it
hangs; here requests get FOLDTUNE_SHUTDOWN_SECONDS to finish, then their connections are closed and the
process exits.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import make_url

from api.cli._db import migrate_or_explain
from api.cli.arguments import add
from api.cli._shutdown import exit_leaving_busy_threads
from api.http.app import create_app
from api.http.settings import ApiSettings
from db.migrate import head_revision

HELP = "migrate the database and serve the HTTP API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="interface to listen on (also: FOLDTUNE_HOST; default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (also: FOLDTUNE_PORT; default 8321)")
    add(parser, "--database-url")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    settings = ApiSettings.from_env(args.database_url)
    settings = replace(settings, host=args.host or settings.host, port=args.port or settings.port)
    migrate_or_explain(settings.database_url)
    print(f"foldtune: database {_safe(settings.database_url)} at revision {head_revision()}", flush=True)
    print(f"foldtune: training paths confined to {settings.data_root}/<owner>/ (FOLDTUNE_DATA_ROOT); public URL "
          f"{settings.base_url} (FOLDTUNE_PUBLIC_URL)", flush=True)
    server = uvicorn.Server(server_config(create_app(settings), settings, args.log_level))
    try:
        server.run()  # after SIGTERM uvicorn re-raises it with its default action (the process ends at once)
    except KeyboardInterrupt:
        # SIGINT comes back as KeyboardInterrupt, and Python's exit would wait for a handler still blocked in
        # a worker thread (a database lock), which uvicorn's shutdown timeout cannot cancel
        exit_leaving_busy_threads("foldtune serve", 130)
        raise
    return 0


def server_config(app: FastAPI, settings: ApiSettings, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration of the service: where it listens, which proxies' forwarded headers it
    believes (``settings.trusted_proxies``; none: the connection's address is the client's) and how long
    requests in flight may finish after SIGTERM (``settings.shutdown_seconds``)."""
    trusted = list(settings.trusted_proxies)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                          proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None,
                          timeout_graceful_shutdown=settings.shutdown_seconds)


def _safe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
