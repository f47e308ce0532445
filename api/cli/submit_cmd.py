"""``foldtune submit``: send a tuning job to the API; ``--wait`` follows it trial by trial until it ends."""

from __future__ import annotations

import argparse
import time
import uuid

from api.cli._units import seconds as fmt_seconds
from api.cli._http import ApiClient, add_connection_arguments
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, require_gpu, resolve_shape
from api.cli.arguments import add, add_all, budget_defaults
from api.cli._router_args import add_router_arguments, router_body_from
from api.cli._model_args import add_model_arguments, model_body

HELP = "submit a tuning job to the foldtune API (a runner executes it)"
FINISHED = ("succeeded", "failed", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_gpu_argument(parser, local=False)
    add(parser, "--gpus", "give it", required=True)
    add_shape_arguments(parser)
    add_all(parser, "--max-trials", "--max-seconds")
    parser.add_argument("--idempotency-key", help="retrying with the same key never stores a second job (default: a fresh key, so the "
                             "client's own retries never do either)")
    add_all(parser, "--wait", "--poll")
    add(parser, "--search-precision", "each trial at its own; the best layout names its precision")
    add_router_arguments(parser)
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    gpu = require_gpu(args, "submit")
    shape = resolve_shape(args, gpu, "submit")
    max_trials, max_seconds = budget_defaults(args, gpu)
    body = {**model_body(args),
            "training": {"seq_length": shape.seq, "global_batch_size": shape.gbs, "precision": shape.precision},
            "cluster": {"gpu": gpu, "num_gpus": args.gpus},
            "budget": {"max_trials": max_trials, "max_seconds": max_seconds},
            **({"search_precision": True} if args.search_precision else {}), **router_body_from(args)}
    # always a key (a fresh one unless given): the client may then resend the POST after a 502/503/504 or a
    # lost connection without ever storing the job twice
    headers = {"Idempotency-Key": args.idempotency_key or f"cli-{uuid.uuid4().hex}"}
    with ApiClient.from_args(args) as client:
        job = client.post("/v1/jobs", body, headers=headers)
        print(f"job {job['id']} {job['status']}: {job['model']} on {job['cluster']['num_gpus']}x "
              f"{job['cluster']['gpu']}, up to {job['budget']['max_trials']} trials", flush=True)
        if not args.wait:
            return 0
        return follow_job(client, job["id"], args.poll)


def follow_job(client: ApiClient, job_id: int, poll_s: float) -> int:
    """Print status changes and each finished trial until the job ends; 0 if it succeeded, else 1."""
    status, shown = None, set()
    while True:
        job = client.get(f"/v1/jobs/{job_id}")
        if job["status"] != status:
            status = job["status"]
            print(f"job {job_id}: {status}" + (f" ({job['error']})" if job.get("error") else ""), flush=True)
        if job["trials"]["total"] > len(shown):
            for trial in _all_trials(client, job_id):
                if trial["status"] != "running" and trial["id"] not in shown:
                    shown.add(trial["id"])
                    print(trial_line(trial), flush=True)
        if status in FINISHED:
            note = (job.get("calibration") or {}).get("precision_note")
            if note:  # a precision search that left fp8 out says so
                print(f"job {job_id}: {note}", flush=True)
            best = job.get("best_trial")
            if best:
                print(f"best: trial {best['number']} {best.get('label') or best['config']} "
                      f"{fmt_seconds(best['step_time_s'])}/step", flush=True)
            return 0 if status == "succeeded" else 1
        time.sleep(poll_s)


def _all_trials(client: ApiClient, job_id: int) -> list[dict]:
    items, offset = [], 0
    while offset is not None:
        page = client.get(f"/v1/jobs/{job_id}/trials", limit=200, offset=offset)
        items += page["items"]
        offset = page["next_offset"]
    return items


def trial_line(trial: dict) -> str:
    what = trial.get("label") or trial["config"]
    if trial["status"] == "succeeded":
        return (f"trial {trial['number']:>3} succeeded {what}: {fmt_seconds(trial['step_time_s'])}/step "
                f"(predicted {fmt_seconds(trial.get('predicted_step_time_s'))})")
    reason = trial.get("failure_reason") or ""
    return f"trial {trial['number']:>3} {trial['status']} {what}" + (f": {reason}" if reason else "")
