"""``foldtune keys create NAME``: create an owner (if new) and an API key in the local database."""

from __future__ import annotations

import argparse

from api.cli._db import migrate_or_explain
from api.cli.arguments import add
from api.schemas.common import text_problem
from spec.errors import SpecError
from db.engine import make_engine, make_sessionmaker
from db.keys import create_api_key, revoke_keys
from db.settings import database_settings

HELP = "create API keys in the local database (printed once)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = sub.add_parser("create", help="create an owner (if new) and a new API key for it")
    create.add_argument("name", help="owner name (1 to 100 characters)")
    add(create, "--database-url")
    revoke = sub.add_parser("revoke", help="revoke every key of an owner")
    revoke.add_argument("name")
    add(revoke, "--database-url")


def run(args: argparse.Namespace) -> int:

    name = args.name.strip()
    problem = text_problem(name, single_line=True)
    if not 1 <= len(name) <= 100 or problem:
        raise SpecError(f"owner name must be 1 to 100 characters without control characters, got {args.name!r}"
                        + (f" ({problem})" if problem else ""))
    url = database_settings(args.database_url).url
    migrate_or_explain(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            if args.keys_command == "revoke":
                print(f"revoked {revoke_keys(session, name)} key(s) of {name}")
                return 0
            owner, token = create_api_key(session, name)
    finally:
        engine.dispose()
    print(f"API key for {owner.name} (shown once; store it, e.g. export FOLDTUNE_API_KEY=...):")
    print(token)
    return 0
