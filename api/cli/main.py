"""Entry point of the ``foldtune`` command.

Each subcommand lives in its own module under ``api.cli`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their command runs,
so ``foldtune plan`` never pays for torch, Ray or FastAPI. Every :class:`FoldtuneError` becomes one
``foldtune: error: ...`` line on stderr and exit code 2; no traceback reaches the user.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from api.cli.arguments import Parser, RetiredFlag
from spec.catalog import load_catalog_file, load_env_catalog
from spec.errors import FoldtuneError

# command name -> (module, one-line help). Help is duplicated here so `foldtune --help` stays instant.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("api.cli.plan_cmd", "rank every valid folded layout for a model on a cluster (cost model only)"),
    "profile": ("api.cli.profile_cmd", "run and measure one layout of the real MoE training step locally"),
    "serve": ("api.cli.serve_cmd", "migrate the database and serve the HTTP API"),
    "keys": ("api.cli.keys_cmd", "create API keys in the local database (printed once)"),
    "submit": ("api.cli.submit_cmd", "submit a tuning job to the foldtune API (a runner executes it)"),
    "jobs": ("api.cli.jobs_cmd", "list tuning jobs, or show one job and its trials"),
    "best": ("api.cli.best_cmd", "show the best measured layout for a model on a cluster (from your trials)"),
    "runner": ("api.cli.runner_cmd", "claim queued tuning jobs from the database and run their trials through Ray"),
    "data": ("api.cli.data_cmd", "prepare a tokenized training dataset from local text files"),
    "trainings": ("api.cli.trainings_cmd", "list trainings, show, follow (--wait) or cancel one, or submit one"),
    "train": ("api.cli.train_cmd", "train a model with one folded layout on local data, with checkpoints and resume"),
    "tune": ("api.cli.tune_cmd", "set up the embedded service and run one real tuning job here (SQLite, local Ray)"),
    "export-hf": ("api.cli.export_cmd", "write a training checkpoint as a Hugging Face model directory"),
    "calibrate": ("api.cli.calibrate_cmd", "measure the local GPUs (or CPU ranks) and save a calibrated hardware profile"),
    "verify": ("api.cli.verify_cmd", "check a plan's top layouts by timing one rank of each on this machine "
                                     "(measured vs predicted, re-ranked)"),
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None  # the command is not part of this build yet
        raise


def version() -> str:
    """The installed distribution's version (``pyproject.toml``), or the source tree's when not installed."""
    try:
        return metadata.version("foldtune")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand an argument list names: its first word that is no option (nor ``--catalog``'s value)."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token == "--catalog":
            skip = True
        elif not token.startswith("-"):
            return token
    return None


def build_parser(only: str | None = None, *, lazy: bool = False) -> Parser:
    """The ``foldtune`` parser with every command's arguments, or (``lazy``) with only those of the command
    ``only`` (None: of no command): the other commands' modules are not imported, so ``foldtune plan`` does
    not load FastAPI, uvicorn or torch to build the parsers of ``serve`` or ``calibrate``."""
    parser = Parser(prog="foldtune", description="Tune and run folded MoE training layouts.")
    parser.add_argument("--version", action="version", version=f"foldtune {version()}")
    parser.add_argument("--catalog", metavar="FILE",
                        help="YAML/JSON file of extra models and hardware (also: FOLDTUNE_CATALOG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if lazy and name != only:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        module = _load(module_name)
        if module is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_of(argv), lazy=True)
    try:
        args = parser.parse_args(argv)
    except RetiredFlag as exc:  # a renamed flag: one line naming the new one, as argparse's own errors exit 2
        print(f"foldtune: error: {exc}", file=sys.stderr)
        return 2
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        load_env_catalog()
        if args.catalog:
            load_catalog_file(args.catalog)
        return int(args._module.run(args) or 0)
    except FoldtuneError as exc:
        print(f"foldtune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("foldtune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
