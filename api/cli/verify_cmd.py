"""``foldtune verify``: check a plan's top layouts by one-rank slices measured here (docs/verify.md).

Takes a plan request as ``foldtune plan`` does, plans, and for each of the top ``--top`` layouts builds one of
its ranks (its pipeline stage's decoder layers, its local experts at their width, its micro-batch, its sequence
and TP shards) on this machine's device and times it under even and skewed routing. Prints, per layout, the
measured compute against the cost model's term by term, then the layouts re-ranked by their checked step:
measured compute plus the communication and once-per-step work priced on the target cluster.
"""

from __future__ import annotations

import argparse
import json

from api.cli._units import seconds_cell
from api.cli._shape_args import detected_gpu
from api.cli.arguments import add, top
from api.cli.plan_cmd import add_request_arguments, plan_space, plan_specs
from spec.catalog import get_hardware
from spec.errors import SpecError
from spec.routing_scenarios import DEFAULT_HOT_FACTOR

HELP = "check a plan's top layouts by timing one rank of each on this machine (measured vs predicted, re-ranked)"
DEFAULT_SLICE_LAYERS = 2  # api.worker.verify's, repeated: the CLI does not import the worker to build its parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_arguments(parser)
    add(parser, "--top")
    parser.add_argument("--slice-gpu", metavar="NAME",
                        help="the hardware the slices run on here, which prices their compute for the comparison: "
                             "catalog hardware or cpu (default: this machine's GPU, cpu without CUDA); on cpu they "
                             "run on the CPU, else on the first CUDA device")
    parser.add_argument("--slice-layers", type=int, default=DEFAULT_SLICE_LAYERS, metavar="N",
                        help="decoder layers of each kind a slice builds at most (the time per layer is their mean; "
                             f"default: {DEFAULT_SLICE_LAYERS})")
    parser.add_argument("--hot-expert", type=float, default=DEFAULT_HOT_FACTOR, metavar="X",
                        help="the skewed routing's hottest expert, in multiples of the mean tokens per expert "
                             f"(default: {DEFAULT_HOT_FACTOR:g})")
    parser.add_argument("--isolated", action="store_true",
                        help="time each layout in a child process of its own (a slice out of memory fails that "
                             "layout only; the runner's way)")
    add(parser, "--json")


def _lines(report) -> list[str]:
    """The report as text: per layout and scenario the term table, then the re-ranking."""
    lines = [f"verify   {report.model} on {report.num_gpus} x {report.gpu}: slices on {report.device} "
             f"(priced as {report.slice_gpu})"]
    for layout in report.layouts:
        lines.append("")
        lines.append(f"#{layout.plan_rank} {layout.config.label()}: predicted step "
                     f"{seconds_cell(layout.predicted_step_s)} s")
        if layout.error:
            lines.append(f"  not measured: {layout.error}")
            continue
        for name, check in layout.scenarios.items():
            stage = check.stage
            ends = " and ".join(end for end, held in (("first", stage["first"]), ("last", stage["last"])) if held)
            lines.append(f"  {name} routing: slowest stage {stage['stages'][0]} ({ends + '; ' if ends else ''}"
                         f"{stage['dense_layers']} dense + {stage['moe_layers']} MoE layers), per micro-batch"
                         + (f"; expert rows {check.expert_rows}" if check.expert_rows else ""))
            lines.append(f"    {'term':<16}{'measured (s)':>14}{'predicted (s)':>15}{'ratio':>8}")
            for term, (measured, predicted) in check.terms.items():
                ratio = f"{measured / predicted:>8.2f}" if predicted > 0 else f"{'-':>8}"
                lines.append(f"    {term:<16}{seconds_cell(measured):>14}{seconds_cell(predicted):>15}{ratio}")
            lines.append(f"    step: compute measured {seconds_cell(check.compute_measured['total'])} s, predicted "
                         f"{seconds_cell(check.compute_predicted['total'])} s; priced rest "
                         f"{seconds_cell(sum(check.priced.values()))} s; checked step "
                         f"{seconds_cell(check.checked_step_s)} s (estimate {seconds_cell(check.predicted_step_s)} s)")
    for name, labels in report.order.items():
        lines.append("")
        lines.append(f"ranked by checked step, {name} routing:")
        by_label = {layout.config.label(): layout for layout in report.layouts}
        for position, label in enumerate(labels, 1):
            layout = by_label[label]
            check = layout.scenarios.get(name)
            step = f"{seconds_cell(check.checked_step_s)} s" if check else "not measured"
            lines.append(f"  {position}. {step:>14}  (plan #{layout.plan_rank})  {label}")
    return lines


def run(args: argparse.Namespace) -> int:
    # torch and the executor load only when slices run, never for `foldtune --help`
    from api.worker.verify import run_verify  # noqa: PLC0415

    problems = []
    if top(args, "verify") < 1:
        problems.append(f"--top must be >= 1, got {args.top}")
    if args.slice_layers < 1:
        problems.append(f"--slice-layers must be >= 1, got {args.slice_layers}")
    if problems:
        raise SpecError("; ".join(problems))
    model, training, cluster = plan_specs(args, "verify")
    slice_hardware = get_hardware(args.slice_gpu or detected_gpu())

    def progress(layout) -> None:
        if not args.json:
            state = f"not measured: {layout.error}" if layout.error else "measured"
            print(f"sliced #{layout.plan_rank} {layout.config.label()}: {state}", flush=True)

    report = run_verify(model, training, cluster, slice_hardware, top=top(args, "verify"), space=plan_space(args),
                        hot_factor=args.hot_expert, cap=args.slice_layers, isolated=args.isolated,
                        on_layout=progress)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print("\n".join(_lines(report)))
    return 0 if any(layout.error is None for layout in report.layouts) else 1
