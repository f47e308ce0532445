"""``foldtune trainings [ID]``: list your trainings, or show one with its latest metrics (``--cancel``
cancels it, ``--wait`` follows its steps until it ends); ``foldtune trainings submit`` sends a new one to the
API (POST /v1/trainings): a tuning job's best layout (``--job ID``) or an explicit ``--layout``."""

from __future__ import annotations

import argparse
import json
import time

from api.cli._units import column_width, seconds as fmt_seconds
from api.cli._http import ApiClient, add_connection_arguments
from api.cli._model_args import add_model_arguments, model_body
from api.cli.arguments import add, add_all, retire
from api.cli._shape_args import CPU_GBS, CPU_SEQ, add_gpu_argument, require_gpu, resolve_shape
from spec.errors import SpecError

HELP = "list trainings, or show, follow or cancel one"
FINISHED = ("succeeded", "failed", "cancelled")


SUBMIT_FLAGS = ("job", "layout", "model", "model_file", "layers", "proxy", "gpu", "gpus", "seq", "gbs", "data",
                "steps", "checkpoint_dir", "checkpoint_every", "keep_last", "lr", "lr_warmup", "eval_every", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", metavar="ID|submit",
                        help="a training id: show it; 'submit': send a new training (the options below)")
    add_all(parser, "--status", "--limit", "--offset", "--cancel")
    add(parser, "--wait", "training ID, or the one submitted")
    add_all(parser, "--poll", "--json")
    sub = parser.add_argument_group("trainings submit", "a new training: --job ID, or --layout with --model, --gpu "
                                    "and --gpus; paths are on the server")
    source = sub.add_mutually_exclusive_group()
    add(source, "--job")
    add(source, "--layout", "with --model, --gpu and --gpus")
    add_model_arguments(sub, required=False, note="with --layout")
    add_gpu_argument(sub, local=False)
    add(sub, "--gpus", "with --layout")
    shape_note = f"with --job: the job's; else {CPU_SEQ} tokens and {CPU_GBS} sequences with --gpu cpu, on GPUs give it"
    add(sub, "--seq", shape_note)
    add(sub, "--gbs", shape_note)
    add(sub, "--data", "on the server")
    add(sub, "--steps")
    add(sub, "--checkpoint-dir", "on the server")
    add(sub, "--checkpoint-every", "default: 0")
    add(sub, "--keep-last", "default: 0")
    for flag in ("--lr", "--lr-warmup", "--eval-every", "--seed"):
        add(sub, flag, "default: the recipe's")
    retire(parser, "--warmup", "--lr-warmup", "the learning-rate warm-up; --untimed-steps are a measured run's")
    add_connection_arguments(parser)


def submit_body(args: argparse.Namespace) -> dict:
    """The POST /v1/trainings body of ``trainings submit``'s flags (the shared --gpu/--seq/--gbs rule)."""
    missing = [f"--{name.replace('_', '-')}" for name in ("data", "steps", "checkpoint_dir")
               if getattr(args, name) is None]
    if args.job is None and args.layout is None:
        missing.insert(0, "--job ID or --layout LABEL")
    if missing:
        raise SpecError("foldtune trainings submit needs " + ", ".join(missing))
    body: dict = {"data_path": args.data, "steps": args.steps, "checkpoint_dir": args.checkpoint_dir}
    if args.job is not None:
        extra = [f"--{n.replace('_', '-')}" for n in ("model", "model_file", "layers", "proxy", "gpu", "gpus")
                 if getattr(args, n) is not None]
        if extra:
            raise SpecError(f"--job trains the job's model on its GPUs: leave out {', '.join(extra)}")
        body["job_id"] = args.job
        body.update({k: v for k, v in (("seq_length", args.seq), ("global_batch_size", args.gbs)) if v is not None})
    else:
        if not (args.model or args.model_file) or args.gpus is None:
            raise SpecError("--layout needs --model (or --model-file) and --gpus")
        gpu = require_gpu(args, "trainings submit")
        shape = resolve_shape(args, gpu, "trainings submit")
        body.update(model_body(args), layout=args.layout, cluster={"gpu": gpu, "num_gpus": args.gpus},
                    seq_length=shape.seq, global_batch_size=shape.gbs)
    for flag, field in (("checkpoint_every", "checkpoint_every"), ("keep_last", "keep_last"), ("lr", "lr"),
                        ("lr_warmup", "warmup_steps"), ("eval_every", "eval_every"), ("seed", "data_seed")):
        if getattr(args, flag) is not None:
            body[field] = getattr(args, flag)
    return body


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


def _target(args: argparse.Namespace) -> None:
    """``args.id`` (an int or None) and ``args.submit`` from the positional ``ID|submit``; submit options
    without ``submit`` are refused rather than ignored."""
    args.submit = args.target == "submit"
    args.id = None
    if args.target is not None and not args.submit:
        if not args.target.isdigit():
            raise SpecError(f"trainings takes a training ID or 'submit', got {args.target!r}")
        args.id = int(args.target)
    given = [f"--{n.replace('_', '-')}" for n in SUBMIT_FLAGS if getattr(args, n, None) is not None]
    if given and not args.submit:
        raise SpecError(f"{', '.join(given)} belong to `foldtune trainings submit`")


def run(args: argparse.Namespace) -> int:
    _target(args)
    if args.cancel and args.id is None:
        raise SpecError("--cancel needs a training ID")
    if args.wait and args.id is None and not args.submit:
        raise SpecError("--wait needs a training ID (or `trainings submit`)")
    with ApiClient.from_args(args) as client:
        if args.submit:
            t = client.post("/v1/trainings", submit_body(args))
            if args.json:
                print(json.dumps(t, indent=2))
            else:
                print(f"training {t['id']} {t['status']}: {t['model']} with {t['label']} on "
                      f"{t['cluster']['num_gpus']}x{t['cluster']['gpu']}, {t['steps']} steps; follow it with "
                      f"`foldtune trainings {t['id']} --wait`", flush=True)
            return follow(client, t["id"], args.poll) if args.wait else 0
        if args.id is None:
            page = client.get("/v1/trainings", limit=args.limit, offset=args.offset, status=args.status)
            if args.json:
                print(json.dumps(page, indent=2))
                return 0
            items = page["items"]
            mw = column_width([t["model"] for t in items], "MODEL", 16)
            lw = column_width([t["label"] for t in items], "LAYOUT", 28)
            print(f"{'ID':>6}  {'STATUS':<10} {'MODEL':<{mw}} {'LAYOUT':<{lw}} {'STEP':>13}  {'LOSS':>8}  CREATED")
            for t in items:
                latest = t.get("latest_metrics") or {}
                print(f"{t['id']:>6}  {t['status']:<10} {t['model']:<{mw}} {t['label']:<{lw}} "
                      f"{latest.get('step', 0):>6}/{t['steps']:<6}  {_num(latest.get('loss'), '.4f'):>8}  "
                      f"{t['created_at'][:19]}")
            print(f"{len(page['items'])} shown of {page['total']}")
            return 0
        if args.cancel:
            t = client.post(f"/v1/trainings/{args.id}/cancel", safe=True)  # cancelling twice cancels once
            print(f"training {t['id']}: {t['status']}")
            return 0
        if args.wait:
            return follow(client, args.id, args.poll)
        t = client.get(f"/v1/trainings/{args.id}")
        if args.json:
            print(json.dumps(t, indent=2))
            return 0
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
