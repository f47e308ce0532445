"""``foldtune best``: the fastest measured layout for a model/training/cluster, across your jobs.

``--gpu``, ``--seq``, ``--gbs`` and ``--precision`` follow the rule every command shares (api/cli/_shape_args.py):
with ``--gpu cpu`` the defaults are what ``foldtune tune`` measures by default, so ``foldtune best --model
tiny-moe --gpu cpu --gpus 4`` after ``foldtune tune`` finds its layout. ``--format`` exports that layout.
"""

from __future__ import annotations

import argparse
import json

from api.cli._export import add_format_argument, render
from api.cli._units import seconds as fmt_seconds
from api.cli._http import ApiClient, add_connection_arguments
from api.cli.arguments import add
from api.cli._model_args import add_proxy_arguments
from api.cli._run_cost_args import add_run_cost_arguments, run_heading, run_line, run_question
from costmodel.training_run import TrainingRun
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, require_gpu, resolve_shape
from spec.errors import SpecError

HELP = "show the best measured layout for a model on a cluster (from your finished trials)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--signature", help="a job's signature (instead of the flags below)")
    add(parser, "--model", "a proxy as the job names it, e.g. mixtral-8x7b@2L, or with --layers/--proxy")
    add_proxy_arguments(parser)
    add_gpu_argument(parser, local=False)
    add(parser, "--gpus", "give it")
    add_shape_arguments(parser)
    add_run_cost_arguments(parser)
    add(parser, "--json")
    add_format_argument(parser)
    add_connection_arguments(parser)


def query(args: argparse.Namespace) -> dict:
    """The GET /v1/best parameters of the flags (the shared defaults applied), or of ``--signature``, with
    ``--tokens``/``--price-per-gpu-hour`` as ``tokens``/``price_per_gpu_hour``."""
    question = run_question(args)
    asked = {} if question is None else {"tokens": question.tokens, "price_per_gpu_hour": question.price_per_gpu_hour}
    return {**_shape_query(args), **{k: v for k, v in asked.items() if v is not None}}


def _shape_query(args: argparse.Namespace) -> dict:
    if args.signature:
        return {"signature": args.signature}
    missing = [flag for flag, value in (("--model", args.model), ("--gpus", args.gpus)) if value is None]
    if missing:
        raise SpecError(f"foldtune best needs {' and '.join(missing)} (or --signature)")
    gpu = require_gpu(args, "best", " (or --signature)")
    shape = resolve_shape(args, gpu, "best")
    params = {"model": args.model, "gpu": gpu, "num_gpus": args.gpus, "seq_length": shape.seq,
              "global_batch_size": shape.gbs, "precision": shape.precision}
    for flag, field in (("layers", "num_layers_override"), ("proxy", "proxy")):
        if getattr(args, flag) is not None:
            params[field] = getattr(args, flag)
    return params


def run(args: argparse.Namespace) -> int:
    params = query(args)
    with ApiClient.from_args(args) as client:
        best = client.get("/v1/best", **params)
        job = client.get(f"/v1/jobs/{best['job_id']}") if args.format else None
    if args.format:
        print(render({**job, "best_trial": best["trial"]}, args.format))
        return 0
    if args.json:
        print(json.dumps(best, indent=2))
        return 0
    trial = best["trial"]
    print(f"best for {best['model']} on {best['cluster']['num_gpus']}x{best['cluster']['gpu']} "
          f"(over {best['jobs_considered']} job(s)): job {best['job_id']} trial {trial['number']}")
    print(f"  layout:    {trial.get('label') or json.dumps(trial['config'])}")
    print(f"  step time: {fmt_seconds(trial['step_time_s'])} measured, "
          f"{fmt_seconds(trial.get('predicted_step_time_s'))} predicted")
    if best.get("training_run"):  # the API's answer to --tokens, at the measured step time
        run = TrainingRun(**{k: v for k, v in best["training_run"].items() if k != "layout"})
        print("  " + run_heading(run))
        print("  " + run_line(run))
    return 0
