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
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, detected_gpu, is_cpu, resolve_shape

HELP = "run and measure one layout of the real MoE training step locally"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, model_help="catalog model name, e.g. tiny-moe")
    parser.add_argument("--layout", metavar="LABEL",
                        help='the layout as foldtune prints it, e.g. "tp2 cp1 pp1 vpp1 ep2 etp1 dp2 edp2 mbs1" (any '
                             "subset; without dp the smallest world that fits); instead of --tp ... --dispatcher")
    for name in ("tp", "ep", "etp"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"{name} size (default: 1)")
    parser.add_argument("--dp", type=int, help="data-parallel size (default: the smallest that fits tp and ep·etp)")
    parser.add_argument("--mbs", type=int, default=None, help="micro-batch size (default: 1)")
    parser.add_argument("--dispatcher", choices=DISPATCHERS, default=None,
                        help="; ".join(f"{k.name}: {k.summary}" for k in DISPATCHER_KINDS)
                        + f" (default: {DEFAULT_DISPATCHER})")
    add_shape_arguments(parser)
    parser.add_argument("--routing", choices=("dropless", "capacity"), default="dropless")
    parser.add_argument("--capacity-factor", type=float, help="expert capacity factor (with --routing capacity)")
    add_router_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add_gpu_argument(parser, local=True)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped")
    parser.add_argument("--json", action="store_true", help="print the Measurement as JSON")


def _config(args: argparse.Namespace) -> ParallelConfig:
    """The layout of ``--layout LABEL`` or of the size flags (which then must not be given)."""
    flags = {"tp": args.tp, "ep": args.ep, "etp": args.etp, "dp": args.dp, "mbs": args.mbs,
             "dispatcher": args.dispatcher}
    for name in ("tp", "ep", "etp", "dp", "mbs"):
        if flags[name] is not None and flags[name] < 1:
            raise SpecError(f"--{name} must be positive, got {flags[name]}")
    if args.layout is not None:
        given = [f"--{name}" for name, value in flags.items() if value is not None]
        if given:
            raise SpecError(f"--layout names the whole layout; drop {', '.join(given)} (or put it in the label)")
        sizes = ParallelConfig.read_label(args.layout).sizes  # a bad token lists the valid ones
        world = None
        if "dp" not in sizes:  # the smallest world both layouts fit, as with the size flags
            pp = sizes.get("pp", 1)
            dense = sizes.get("tp", 1) * sizes.get("cp", 1) * pp
            expert = sizes.get("ep", 1) * sizes.get("etp", 1) * pp
            world = dense * expert // math.gcd(dense, expert)
        return ParallelConfig.parse(args.layout, world_size=world)
    tp, ep, etp = args.tp or 1, args.ep or 1, args.etp or 1
    dense, expert = tp, ep * etp
    world = args.dp * dense if args.dp else dense * expert // math.gcd(dense, expert)
    return ParallelConfig(world_size=world, tp=tp, ep=ep, etp=etp, micro_batch_size=args.mbs or 1,
                          moe_token_dispatcher_type=args.dispatcher or DEFAULT_DISPATCHER)


def run(args: argparse.Namespace) -> int:
    config = _config(args)  # a bad layout is reported before torch is imported
    # torch and the executor: only the command that profiles pays for them, not `foldtune --help`
    import torch

    from executor.options import ExecutorOptions
    from executor.profile import profile_layout

    for name in ("seq", "gbs", "warmup", "steps"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            raise SpecError(f"--{name} must be positive, got {value}")
    model = model_from_args(args)
    world = config.world_size
    if args.gpu:  # the hardware named decides the device: cpu runs CPU ranks, a GPU name runs on CUDA
        on_gpu = args.device == "cuda" or (args.device == "auto" and not is_cpu(args.gpu))
    else:
        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                           and torch.cuda.device_count() >= world)
    gpu = args.gpu or (detected_gpu() if on_gpu else "cpu")
    shape = resolve_shape(args, gpu, "profile")
    training = TrainingSpec(seq_length=shape.seq, global_batch_size=shape.gbs,
                            precision=shape.precision, routing_mode=args.routing,
                            moe_expert_capacity_factor=args.capacity_factor)
    check_local_run(model, training, config)
    options = ExecutorOptions.for_training(training, router_options_from(args), model)
    measurement = profile_layout(model, training, config, options, args.warmup, args.steps, args.timeout,
                                 "cuda" if on_gpu else "cpu", args.gpu or (gpu if on_gpu else None))
    print(measurement.to_json() if args.json else measurement.summary())
    return 0 if measurement.ok else 1
