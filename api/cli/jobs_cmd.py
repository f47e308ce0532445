"""``foldtune jobs [ID]``: list your jobs, or show one with its trials (``--cancel`` cancels it)."""

from __future__ import annotations

import argparse
import json

from api.cli.arguments import add, add_all
from api.cli._export import add_format_argument, render
from api.cli._units import column_width, seconds_cell
from api.cli._http import ApiClient, add_connection_arguments
from api.cli.submit_cmd import _all_trials, follow_job, trial_line
from spec.errors import SpecError

HELP = "list tuning jobs, or show one job and its trials"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", nargs="?", type=int, help="a job id: show it and its trials")
    add(parser, "--status")
    add(parser, "--model", "only jobs of this model")
    add_all(parser, "--limit", "--offset", "--cancel", "--wait", "--poll")
    add(parser, "--json", "job ID: with its trials")
    add_format_argument(parser, "of job ID")
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if (args.cancel or args.wait or args.format) and args.id is None:
        raise SpecError("--cancel, --wait and --format need a job ID")
    with ApiClient.from_args(args) as client:
        if args.id is None:
            page = client.get("/v1/jobs", limit=args.limit, offset=args.offset, status=args.status, model=args.model)
            if args.json:
                print(json.dumps(page, indent=2))
                return 0
            items = page["items"]
            clusters = [f"{job['cluster']['num_gpus']}x{job['cluster']['gpu']}" for job in items]
            mw = column_width([job["model"] for job in items], "MODEL", 20)
            cw = column_width(clusters, "CLUSTER", 14)
            print(f"{'ID':>6}  {'STATUS':<10} {'MODEL':<{mw}} {'CLUSTER':<{cw}} {'TRIALS':>7}  {'BEST STEP (s)':>13}  "
                  f"CREATED")
            for job, cluster in zip(items, clusters):
                best = job.get("best_trial") or {}
                print(f"{job['id']:>6}  {job['status']:<10} {job['model']:<{mw}} {cluster:<{cw}} "
                      f"{job['trials']['total']:>3}/{job['budget']['max_trials']:<3}  "
                      f"{seconds_cell(best.get('step_time_s')):>13}  {job['created_at'][:19]}")
            shown_to = args.offset + len(page["items"])
            print(f"{shown_to - len(page['items']) + (1 if page['items'] else 0)}-{shown_to} of {page['total']}")
            return 0
        if args.cancel:
            job = client.post(f"/v1/jobs/{args.id}/cancel", safe=True)  # cancelling twice cancels once
            print(f"job {job['id']}: {job['status']}")
            return 0
        if args.wait:
            return follow_job(client, args.id, args.poll)
        job = client.get(f"/v1/jobs/{args.id}")
        if args.format:
            print(render(job, args.format))
            return 0
        if args.json:
            print(json.dumps({**job, "trial_list": _all_trials(client, args.id)}, indent=2))
            return 0
        cluster = f"{job['cluster']['num_gpus']}x{job['cluster']['gpu']}"
        print(f"job {job['id']} {job['status']}: {job['model']} on {cluster}, "
              f"seq {job['training']['seq_length']}, gbs {job['training']['global_batch_size']}, "
              f"{job['trials']['total']}/{job['budget']['max_trials']} trials")
        if job.get("error"):
            print(f"error: {job['error']}")
        if job.get("kind") == "verify":
            _print_verify(job)
            return 0
        for trial in _all_trials(client, args.id):
            print(trial_line(trial) if trial["status"] != "running" else f"trial {trial['number']:>3} running "
                  f"{trial.get('label') or trial['config']}")
        return 0


def _print_verify(job: dict) -> None:
    """A verify job's answer: per routing scenario its layouts by checked step (docs/verify.md)."""
    report = job.get("report")
    if not report:
        print(f"verify job: the plan's top {job['budget']['max_trials']} layouts, not checked yet")
        return
    layouts = {layout["layout"]: layout for layout in report["layouts"]}
    for name, labels in report["order"].items():
        print(f"ranked by checked step, {name} routing (slices on {report['device']}):")
        for position, label in enumerate(labels, 1):
            layout = layouts[label]
            check = layout["scenarios"].get(name)
            step = f"{seconds_cell(check['checked_step_s'])} s" if check else f"not measured: {layout['error']}"
            print(f"  {position}. {step:>14}  (plan #{layout['plan_rank']}, estimate "
                  f"{seconds_cell(layout['predicted_step_s'])} s)  {label}")
