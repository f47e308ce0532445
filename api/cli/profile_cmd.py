"""``foldtune profile``: run one layout of the real MoE training step on this machine and print its Measurement.

Launches one process per rank (NCCL on GPUs when there are enough, gloo on CPU; ``--gpu`` decides), runs
``--untimed-steps`` then ``--timed-steps`` optimizer steps and prints step time, phases, throughput, MFU, memory and routing balance (``--json`` for
the Measurement as JSON). Exit code 0 when the run succeeded, 1 when it failed (the reason is printed).
"""

from __future__ import annotations

import argparse
import math

from api.cli._router_args import add_router_arguments, router_options_from
from spec.dispatchers import DEFAULT_DISPATCHER, DISPATCHER_KINDS, EXECUTOR_DISPATCHERS
from api.cli._model_args import add_model_arguments, check_local_run, model_from_args
from spec.catalog import get_hardware
from spec.errors import SpecError
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from api.cli._shape_args import LOCAL_GPU_NOTE, add_shape_arguments, is_cpu, local_gpu, resolve_shape
from api.cli.arguments import add, add_all, retire, step_counts, timeout_s

HELP = "run and measure one layout of the real MoE training step locally"


SIZES = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "mbs")
SIZE_HELP = {"tp": "tensor-parallel size", "cp": "context-parallel size", "pp": "pipeline stages",
             "vpp": "virtual stages per pipeline rank (interleaving)", "ep": "expert-parallel size",
             "etp": "expert tensor-parallel size", "mbs": "micro-batch size in sequences"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, note="e.g. tiny-moe")
    add(parser, "--layout", "without dp the smallest world that fits; instead of the size flags below")
    sizes = parser.add_argument_group("the layout by its sizes (each default 1; instead of --layout)")
    for name in SIZES:
        if name == "dp":
            sizes.add_argument("--dp", type=int, metavar="N",
                               help="data-parallel size (default: the smallest that fits tp·cp·pp and ep·etp·pp)")
        elif name == "mbs":
            add(sizes, "--mbs", "default: 1")
        else:
            sizes.add_argument(f"--{name}", type=int, metavar="N", help=f"{SIZE_HELP[name]} (default: 1)")
    sizes.add_argument("--dispatcher", choices=EXECUTOR_DISPATCHERS, default=None,
                       help="; ".join(f"{k.name}: {k.summary}" for k in DISPATCHER_KINDS if k.executor_builds)
                       + f" (default: {DEFAULT_DISPATCHER})")
    add(sizes, "--cuda-graphs")
    add(parser, "--gpu", LOCAL_GPU_NOTE)
    add_shape_arguments(parser)
    add(parser, "--routing")
    add(parser, "--capacity-factor")
    add(parser, "--pad-to-capacity")
    add_router_arguments(parser)
    add_all(parser, "--untimed-steps", "--timed-steps", "--timeout")
    add(parser, "--json", "the Measurement")
    retire(parser, "--warmup", "--untimed-steps", "--warmup is a training's learning-rate warm-up elsewhere")
    retire(parser, "--steps", "--timed-steps", "--steps counts a training's optimizer steps elsewhere")
    retire(parser, "--device", "--gpu", "--gpu cpu runs CPU ranks, a GPU name CUDA ranks")


def _config(args: argparse.Namespace) -> ParallelConfig:
    """The layout of ``--layout LABEL`` or of the size flags (which then must not be given)."""
    flags = {name: getattr(args, name) for name in SIZES}
    for name, value in flags.items():
        if value is not None and value < 1:
            raise SpecError(f"--{name} must be positive, got {value}")
    given = [f"--{name}" for name, value in flags.items() if value is not None]
    given += ["--dispatcher"] if args.dispatcher is not None else []
    given += ["--cuda-graphs"] if args.cuda_graphs else []
    if args.layout is not None and given:
        raise SpecError(f"--layout names the whole layout; drop {', '.join(given)} (or put it in the label)")
    if args.layout is not None:
        sizes = ParallelConfig.read_label(args.layout).sizes  # a bad token lists the valid ones
    else:  # the size flags: read as the label they spell would be, with the label's checks
        sizes = {name: value for name, value in flags.items() if value is not None}
    world = None
    if "dp" not in sizes:  # the smallest world both layouts fit
        pp = sizes.get("pp", 1)
        dense = sizes.get("tp", 1) * sizes.get("cp", 1) * pp
        expert = sizes.get("ep", 1) * sizes.get("etp", 1) * pp
        world = dense * expert // math.gcd(dense, expert)
    if args.layout is not None:
        return ParallelConfig.parse(args.layout, world_size=world)
    return ParallelConfig.from_sizes(sizes, world_size=world,
                                     moe_token_dispatcher_type=args.dispatcher or DEFAULT_DISPATCHER,
                                     **({"cuda_graphs": True} if args.cuda_graphs else {}))


def run(args: argparse.Namespace) -> int:
    config = _config(args)  # a bad layout is reported before torch is imported
    # the executor (torch): only the command that profiles pays for it, not `foldtune --help`
    from executor.options import ExecutorOptions
    from executor.profile import profile_layout

    untimed, timed = step_counts(args)
    for flag, value, least in (("--seq", args.seq, 1), ("--gbs", args.gbs, 1), ("--untimed-steps", untimed, 0),
                               ("--timed-steps", timed, 1)):
        if value is not None and value < least:
            raise SpecError(f"{flag} must be at least {least}, got {value}")
    model = model_from_args(args)
    # the hardware named decides the device: cpu runs CPU ranks, a GPU name runs on CUDA
    if args.gpu:
        get_hardware(args.gpu)  # an unknown name is the first thing to report
    gpu = args.gpu or local_gpu(config.world_size)
    on_gpu = not is_cpu(gpu)
    shape = resolve_shape(args, gpu, "profile")
    training = TrainingSpec(seq_length=shape.seq, global_batch_size=shape.gbs,
                            precision=shape.precision, routing_mode=args.routing,
                            moe_expert_capacity_factor=args.capacity_factor,
                            moe_pad_expert_input_to_capacity=bool(args.pad_to_capacity))
    check_local_run(model, training, config, gpu)
    options = ExecutorOptions.for_training(training, router_options_from(args), model)
    measurement = profile_layout(model, training, config, options, untimed, timed, timeout_s(args, "profile"),
                                 "cuda" if on_gpu else "cpu", args.gpu or (gpu if on_gpu else None))
    print(measurement.to_json() if args.json else measurement.summary())
    return 0 if measurement.ok else 1
