"""``foldtune profile``: run one layout of the real MoE training step on this machine and print its Measurement.

Launches one process per rank (NCCL on GPUs when there are enough, gloo on CPU), runs warm-up then
timed steps and prints step time, phases, throughput, MFU, memory and routing balance (``--json`` for
the Measurement as JSON). Exit code 0 when the run succeeded, 1 when it failed (the reason is printed).
"""

from __future__ import annotations

import argparse
import math

from api.cli._router_args import add_router_arguments, router_options_from
from spec.dispatchers import DEFAULT_DISPATCHER, DISPATCHER_KINDS, DISPATCHERS
from api.cli._model_args import add_model_arguments, check_local_run, model_from_args
from spec.errors import SpecError
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

HELP = "run and measure one layout of the real MoE training step locally"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, model_help="catalog model name, e.g. tiny-moe")
    for name in ("tp", "ep", "etp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name} size (default: 1)")
    parser.add_argument("--dp", type=int, help="data-parallel size (default: the smallest that fits tp and ep·etp)")
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size (default: 1)")
    parser.add_argument("--dispatcher", choices=DISPATCHERS, default=DEFAULT_DISPATCHER,
                        help="; ".join(f"{k.name}: {k.summary}" for k in DISPATCHER_KINDS)
                        + f" (default: {DEFAULT_DISPATCHER})")
    parser.add_argument("--seq", type=int, default=128, help="sequence length in tokens (default: 128)")
    parser.add_argument("--gbs", type=int, help="global batch size in sequences (default: mbs·dp)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                        help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--routing", choices=("dropless", "capacity"), default="dropless")
    parser.add_argument("--capacity-factor", type=float, help="expert capacity factor (with --routing capacity)")
    add_router_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--gpu", help="catalog hardware whose peak MFU is measured against (default: detected)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped")
    parser.add_argument("--json", action="store_true", help="print the Measurement as JSON")


def run(args: argparse.Namespace) -> int:
    # torch and the executor: only the command that profiles pays for them, not `foldtune --help`
    import torch

    from executor.options import ExecutorOptions
    from executor.profile import profile_layout

    for name in ("tp", "ep", "etp", "mbs", "seq", "warmup", "steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise SpecError(f"--{name} must be positive, got {getattr(args, name)}")
    model = model_from_args(args)
    dense, expert = args.tp, args.ep * args.etp
    world = args.dp * dense if args.dp else dense * expert // math.gcd(dense, expert)
    config = ParallelConfig(world_size=world, tp=args.tp, ep=args.ep, etp=args.etp, micro_batch_size=args.mbs,
                            moe_token_dispatcher_type=args.dispatcher)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                       and torch.cuda.device_count() >= world)
    precision = args.precision or ("bf16" if on_gpu else "fp32")
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs or args.mbs * config.dp,
                            precision=precision, routing_mode=args.routing,
                            moe_expert_capacity_factor=args.capacity_factor)
    check_local_run(model, training, config)
    options = ExecutorOptions.for_training(training, router_options_from(args), model)
    measurement = profile_layout(model, training, config, options, args.warmup, args.steps, args.timeout,
                                 "cuda" if on_gpu else "cpu", args.gpu)
    print(measurement.to_json() if args.json else measurement.summary())
    return 0 if measurement.ok else 1
