"""``foldtune runner``: claim queued tuning jobs from the database and run them through Ray.

Runs until SIGTERM/SIGINT, or with ``--once`` until the queue is empty. Ray is started (or attached to)
first, and the signal handlers are installed after it: ``ray.init`` replaces the SIGTERM handler with one
that exits the process on the spot, which left the job ``running`` until the stale-claim requeue and Ray's
processes orphaned. With ours, a signal stops claiming, abandons the running trial (its ranks killed, the
trial failed as lost with the reason 'runner shut down'), puts the job back in the queue at once and shuts
Ray down (the local Ray this process started goes with it). A second signal exits at once, and so does
the process when that shutdown has not finished after FOLDTUNE_RUNNER_SHUTDOWN_SECONDS (default 30, within
docker-compose's stop_grace_period), so a teardown stuck on an unreachable Ray node or database cannot
hold the runner until it is killed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from api.cli._shutdown import exit_timer
from api.cli.arguments import add
from api.cli.tune_cmd import TrialPrinter
from api.worker.settings import RunnerEnv

HELP = "claim queued tuning jobs from the database and run their trials through Ray"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add(parser, "--database-url")
    add(parser, "--ray-address", "where the trials run")
    parser.add_argument("--runner-id", help="stable id of this runner (also: FOLDTUNE_RUNNER_ID; default host-pid); "
                                            "restarted under the same id it resumes its job at once")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve GET /healthz on this port (also: FOLDTUNE_RUNNER_HEALTH_PORT; default: none): 200 "
                             "while the runner runs and its database and Ray answer, else 503")
    parser.add_argument("--health-host", default=None,
                        help="address of /healthz (also: FOLDTUNE_RUNNER_HEALTH_HOST; default 127.0.0.1)")
    add(parser, "--gpus-per-node", "the planner's; also: FOLDTUNE_GPUS_PER_NODE; default: read from the Ray "
                                   "cluster")
    parser.add_argument("--once", action="store_true", help="exit when no job is queued")
    parser.add_argument("--verbose", action="store_true", help="log every trial")


def run(args: argparse.Namespace) -> int:
    # the worker imports torch, Optuna and the executor: only `foldtune runner` itself pays for them
    from executor import launch_ray  # first: it sets up Ray's token auth before Ray is imported

    import ray  # noqa: I001

    from api.worker.health import HealthServer
    from api.worker.runner import Runner, RunnerSettings

    if args.ray_address:
        os.environ["FOLDTUNE_RAY_ADDRESS"] = args.ray_address
    if args.gpus_per_node is not None:
        os.environ["FOLDTUNE_GPUS_PER_NODE"] = str(args.gpus_per_node)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = RunnerSettings.from_env(args.database_url, args.runner_id)
    env = RunnerEnv.read()
    health_port = args.health_port if args.health_port is not None else env.runner_health_port
    health_host = args.health_host or env.runner_health_host
    shutdown_s = env.runner_shutdown_seconds
    printer = TrialPrinter()
    runner = Runner(settings, on_event=printer)
    health = None
    try:
        launch_ray.attach_ray()  # before our handlers: ray.init installs its own SIGTERM handler (exit at once)
        if health_port is not None:
            health = HealthServer(health_host, health_port, {**runner.health_checks(), "ray": launch_ray.ping_ray},
                                  {"runner_id": settings.runner_id}).start()
        stopping = []

        def on_signal(signum: int, _frame) -> None:
            if stopping:  # a second signal: the operator insists
                os._exit(128 + signum)
            stopping.append(signum)
            print(f"runner {settings.runner_id}: {signal.Signals(signum).name}, shutting down", file=sys.stderr,
                  flush=True)
            exit_timer(shutdown_s, f"runner {settings.runner_id}", 128 + signum)
            runner.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        print(f"runner {settings.runner_id} on {settings.database_url.split('@')[-1]}", flush=True)
        ran = runner.run(once=args.once)
    finally:
        if health is not None:
            health.close()
        runner.close()
        ray.shutdown()  # a local Ray started here stops with its processes; a cluster is only disconnected
    print(f"runner {settings.runner_id}: ran {ran} job(s)", flush=True)
    return 0
