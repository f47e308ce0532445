"""``foldtune trainings [ID]``: list your trainings, or show one with its latest metrics (``--cancel``
cancels it, ``--wait`` follows its steps until it ends)."""

from __future__ import annotations

import argparse
import time

from api.cli._http import ApiClient, add_connection_arguments, fmt_seconds

HELP = "list trainings, or show, follow or cancel one"
FINISHED = ("succeeded", "failed", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", nargs="?", type=int, help="a training id: show it")
    parser.add_argument("--status", choices=["queued", "running", *FINISHED])
    parser.add_argument("--limit", type=int, default=20, help="trainings per page (default 20)")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--cancel", action="store_true", help="cancel training ID")
    parser.add_argument("--wait", action="store_true", help="print training ID's steps until it ends")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between polls with --wait (default 2)")
    add_connection_arguments(parser)


def metric_line(m: dict) -> str:
    """One step as ``foldtune train`` prints it (loss, lr, grad norm, tokens/s, step time, eval loss), and the
    training's predicted step time with its error when the row carries them."""
    line = f"step {m['step']:>6}  loss {_num(m['loss'], '.4f')}  lr {_num(m['lr'], '.2e')}  " \
           f"grad_norm {_num(m['grad_norm'], '.3f')}  {_num(m['tokens_per_s'], ',.0f')} tok/s  " \
           f"{fmt_seconds(m['step_time_s'])}"
    if m.get("eval_loss") is not None:
        line += f"  eval_loss {m['eval_loss']:.4f}"
    if m.get("predicted_step_time_s") is not None:
        line += f"  predicted {fmt_seconds(m['predicted_step_time_s'])}"
        if m.get("step_time_error") is not None:
            line += f" ({m['step_time_error']:+.0%})"
    return line


def step_time_line(t: dict) -> str | None:
    """Predicted vs measured seconds per step of a shown training; None when there is neither."""
    predicted, measured = t.get("predicted_step_time_s"), t.get("measured_step_time_s")
    if predicted is None and measured is None:
        return None
    line = f"step time: predicted {fmt_seconds(predicted)}, measured {fmt_seconds(measured)} (median of stored steps)"
    if t.get("step_time_error") is not None:
        line += f", error {t['step_time_error']:+.0%} (predicted - measured) / measured"
    return line


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def follow(client: ApiClient, training_id: int, poll_s: float) -> int:
    """Print every new step of the training until it ends; 0 if it succeeded, else 1."""
    after = -1
    while True:
        training = client.get(f"/v1/trainings/{training_id}")  # before the metrics: none is missed at the end
        while True:
            page = client.get(f"/v1/trainings/{training_id}/metrics", after_step=after, limit=200)
            for m in page["items"]:
                print(metric_line(m), flush=True)
                after = m["step"]
            if page["next_after_step"] is None:
                break
        if training["status"] in FINISHED:
            print(f"training {training_id}: {training['status']}" + (f": {training['error']}"
                                                                    if training.get("error") else ""))
            return 0 if training["status"] == "succeeded" else 1
        time.sleep(poll_s)


def run(args: argparse.Namespace) -> int:
    if (args.cancel or args.wait) and args.id is None:
        raise SpecError("--cancel and --wait need a training ID")
    with ApiClient.from_args(args) as client:
        if args.id is None:
            page = client.get("/v1/trainings", limit=args.limit, offset=args.offset, status=args.status)
            print(f"{'ID':>6}  {'STATUS':<10} {'MODEL':<16} {'LAYOUT':<28} {'STEP':>13}  {'LOSS':>8}  CREATED")
            for t in page["items"]:
                latest = t.get("latest_metrics") or {}
                print(f"{t['id']:>6}  {t['status']:<10} {t['model'][:16]:<16} {t['label'][:28]:<28} "
                      f"{latest.get('step', 0):>6}/{t['steps']:<6}  {_num(latest.get('loss'), '.4f'):>8}  "
                      f"{t['created_at'][:19]}")
            print(f"{len(page['items'])} shown of {page['total']}")
            return 0
        if args.cancel:
            t = client.post(f"/v1/trainings/{args.id}/cancel")
            print(f"training {t['id']}: {t['status']}")
            return 0
        if args.wait:
            return follow(client, args.id, args.poll)
        t = client.get(f"/v1/trainings/{args.id}")
        print(f"training {t['id']} {t['status']}: {t['model']} with {t['label']} on "
              f"{t['cluster']['num_gpus']}x{t['cluster']['gpu']}, {t['steps']} steps of "
              f"{t['training']['global_batch_size']}x{t['training']['seq_length']} tokens, data {t['data_path']}")
        if t.get("job_id") is not None:
            print(f"best layout of tuning job {t['job_id']}")
        if (line := step_time_line(t)) is not None:
            print(line)
        if t.get("latest_metrics"):
            print(metric_line(t["latest_metrics"]))
        if t.get("error"):
            print(f"error: {t['error']}")
        return 0
