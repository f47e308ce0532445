"""The router options' flags, shared by ``foldtune profile``, ``train``, ``tune`` and ``submit``.

Flag names are Megatron's arguments (``--moe-aux-loss-coeff``, ``--moe-router-enable-expert-bias``, ...);
the fields, defaults and bounds are :class:`spec.router_options.RouterOptions`'. Every flag defaults to "not
given", so a command can tell the user's choice from the defaults (``router_body_from`` sends only those).
"""

from __future__ import annotations

import argparse
from typing import Any

from api.cli.arguments import retire
from spec.router_options import BOUNDS, DROP_POLICIES, FIELDS, LOAD_BALANCING_TYPES, RouterOptions


def add_router_arguments(parser: argparse.ArgumentParser, defaults: RouterOptions | None = None) -> None:
    """Add the router flags to ``parser``; ``defaults`` (RouterOptions() if None) only words the help."""
    d = defaults or RouterOptions()
    group = parser.add_argument_group("MoE router (Megatron-Core's arguments)")
    group.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                       help="aux_loss: switch loss per micro-batch; seq_aux_loss: per sequence, averaged "
                            "(DeepSeek-V2/V3); global_aux_loss: tokens per expert over the global batch (DP·CP·TP, "
                            "averaged over the step's micro-batches); none: no balancing loss "
                            f"(default: {d.moe_router_load_balancing_type})")

    def bounded(name: str, text: str) -> None:
        low, high = BOUNDS[name]
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float, metavar="X",
                           help=f"{text}, in [{low:g}, {high:g}] (default: {getattr(d, name):g})")

    bounded("moe_aux_loss_coeff", "load-balancing loss coefficient")
    bounded("moe_z_loss_coeff", "router z-loss coefficient")
    # one spelling per flag: Megatron's
    retire(parser, "--aux-loss-coeff", "--moe-aux-loss-coeff")
    retire(parser, "--z-loss-coeff", "--moe-z-loss-coeff")
    group.add_argument("--moe-router-enable-expert-bias", action=argparse.BooleanOptionalAction, default=None,
                       help="aux-loss-free balancing: a per-expert bias on the sigmoid scores, updated each step "
                            "(default: on for sigmoid-scored models such as DeepSeek-V3, else off)")
    bounded("moe_router_bias_update_rate", "expert bias step per optimizer step")
    group.add_argument("--moe-token-drop-policy", choices=DROP_POLICIES,
                       help="which tokens a full expert drops under capacity routing "
                            f"(default: {d.moe_token_drop_policy})")
    group.add_argument("--moe-router-force-load-balancing", action="store_true", default=None,
                       help="benchmarks only: route round-robin (perfect balance) instead of by score")


def router_body_from(args: argparse.Namespace) -> dict[str, Any]:
    """The router options the user gave on the command line (for an API body)."""
    return {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}


def router_options_from(args: argparse.Namespace, defaults: RouterOptions | None = None) -> RouterOptions:
    """RouterOptions from the flags given, over ``defaults``; SpecError naming the bound a value breaks."""
    return RouterOptions.pick(router_body_from(args), defaults)
