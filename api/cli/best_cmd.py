"""``foldtune best``: the fastest measured layout for a model/training/cluster, across your jobs."""

from __future__ import annotations

import argparse
import json

from api.cli._http import ApiClient, add_connection_arguments, fmt_seconds

HELP = "show the best measured layout for a model on a cluster (from your finished trials)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--signature", help="a job's signature (instead of the flags below)")
    parser.add_argument("--model", help="catalog model name")
    parser.add_argument("--gpu", help="hardware profile name")
    parser.add_argument("--gpus", type=int, help="number of GPUs")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--gbs", type=int, help="global batch size")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp8", "fp32"])
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    add_connection_arguments(parser)


def run(args: argparse.Namespace) -> int:
    params = ({"signature": args.signature} if args.signature else
              {"model": args.model, "gpu": args.gpu, "num_gpus": args.gpus, "seq_length": args.seq,
               "global_batch_size": args.gbs, "precision": args.precision})
    with ApiClient.from_args(args) as client:
        best = client.get("/v1/best", **params)
    if args.json:
        print(json.dumps(best, indent=2))
        return 0
    trial = best["trial"]
    print(f"best for {best['model']} on {best['cluster']['num_gpus']}x{best['cluster']['gpu']} "
          f"(over {best['jobs_considered']} job(s)): job {best['job_id']} trial {trial['number']}")
    print(f"  layout:    {trial.get('label') or json.dumps(trial['config'])}")
    print(f"  step time: {fmt_seconds(trial['step_time_s'])} measured, "
          f"{fmt_seconds(trial.get('predicted_step_time_s'))} predicted")
    return 0
