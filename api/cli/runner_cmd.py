"""``foldtune runner``: claim queued tuning jobs from the database and run them through Ray.

Runs until SIGTERM/SIGINT (then the running trial stops at its next step and the job goes back to the
queue for this or another runner), or with ``--once`` until the queue is empty.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from api.cli.tune_cmd import TrialPrinter

HELP = "claim queued tuning jobs from the database and run their trials through Ray"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="service database (also: FOLDTUNE_DATABASE_URL; default: SQLite in "
                                               "the data dir)")
    parser.add_argument("--ray-address", help="Ray cluster to run trials on (also: FOLDTUNE_RAY_ADDRESS; default: "
                                              "a local Ray)")
    parser.add_argument("--runner-id", help="stable id of this runner (also: FOLDTUNE_RUNNER_ID; default host-pid); "
                                            "restarted under the same id it resumes its job at once")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node the planner assumes (also: FOLDTUNE_GPUS_PER_NODE; default: read from "
                             "the Ray cluster)")
    parser.add_argument("--once", action="store_true", help="exit when no job is queued")
    parser.add_argument("--verbose", action="store_true", help="log every trial")


def run(args: argparse.Namespace) -> int:
    # the worker imports torch, Optuna and the executor: only `foldtune runner` itself pays for them
    from api.worker.runner import Runner, RunnerSettings

    if args.ray_address:
        os.environ["FOLDTUNE_RAY_ADDRESS"] = args.ray_address
    if args.gpus_per_node is not None:
        os.environ["FOLDTUNE_GPUS_PER_NODE"] = str(args.gpus_per_node)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = RunnerSettings.from_env(args.database_url, args.runner_id)
    printer = TrialPrinter()
    runner = Runner(settings, on_event=printer)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop())
    print(f"runner {settings.runner_id} on {settings.database_url.split('@')[-1]}", flush=True)
    try:
        ran = runner.run(once=args.once)
    finally:
        runner.close()
    print(f"runner {settings.runner_id}: ran {ran} job(s)", flush=True)
    return 0
