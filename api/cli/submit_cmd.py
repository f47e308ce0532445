"""``foldtune submit``: send a tuning job to the API; ``--wait`` follows it trial by trial until it ends."""

from __future__ import annotations

import argparse
import time
import uuid

from api.cli._http import ApiClient, add_connection_arguments, fmt_seconds
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, require_gpu, resolve_shape
from api.cli._router_args import add_router_arguments, router_body_from
from api.cli._model_args import add_model_arguments, model_body

HELP = "submit a tuning job to the foldtune API (a runner executes it)"
FINISHED = ("succeeded", "failed", "cancelled")
SEARCH_PRECISION_HELP = ("measure precision as a knob: trials at the training's --precision, bf16 and fp8 (fp8 only on "
                         "GPUs with an fp8 peak; the job's result says when it is dropped), ranked together by "
                         "predicted step time; the best layout names its precision")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_gpu_argument(parser, local=False)
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (ranks)")
    add_shape_arguments(parser)
    parser.add_argument("--max-trials", type=int, default=20, help="measured trials at most (default 20)")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="search wall-clock budget (default 3600)")
    parser.add_argument("--idempotency-key",
                        help="retrying with the same key never stores a second job (default: a fresh key, so the "
                             "client's own retries never do either)")
    parser.add_argument("--wait", action="store_true", help="follow the job and print each trial until it ends")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between polls with --wait (default 2)")
    parser.add_argument("--search-precision", action="store_true", help=SEARCH_PRECISION_HELP)
    add_router_arguments(parser)
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    gpu = require_gpu(args, "submit")
    shape = resolve_shape(args, gpu, "submit")
    body = {**model_body(args),
            "training": {"seq_length": shape.seq, "global_batch_size": shape.gbs, "precision": shape.precision},
            "cluster": {"gpu": gpu, "num_gpus": args.gpus},
            "budget": {"max_trials": args.max_trials, "max_seconds": args.max_seconds},
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
