"""``foldtune calibrate``: microbenchmark the local devices and save a calibrated hardware profile.

Runs GEMM, grouped-GEMM, memory-copy, launch-overhead and collective benchmarks on ``--gpus`` local ranks (NCCL on
GPUs, gloo on CPU), or with ``--ray`` on the ranks of a Ray cluster, ``--gpus-per-node`` on each node (ranks on
two or more nodes also time the collectives of one rank per node: the NIC stage of the network model), builds a
HardwareProfile from the ``--gpu`` catalog profile with the measured curves (units: docs/time-model.md,
"Calibration hooks"), writes it to ``--out`` and, with ``--store``, to the service database. ``foldtune
plan/tune --profile FILE`` price layouts with it.

With ``--model NAME --seq S`` it also times the executor's own components (attention, MoE block with real
routing, dense MLP, LM head + loss, embedding, optimizer step) at that model's shapes on one device and stores
measured / predicted per cost-model term in the profile's ``component_factors``, which the estimate applies to
that model shape. ``--components in-step`` (the default) reads them from the phases of a real 1-GPU training
step of the model (executor/microbench/step_components.py, costmodel/calibrate/step_phases.py);
``--components isolated`` times each block alone (executor/microbench/components.py). The isolated blocks ran
with the host further ahead of or behind the GPU than in a step: priced with their factors, the 22 stored
H200 layouts of Qwen3 and DeepSeek-V2-Lite came out 11 % and 6.7 % off (MAPE), with factors read from those
tables' own 1-GPU step phases 4.6 % and 3.8 % (an offline evaluation); run on 2 × H200 they gave
4.2 / 3.8 / 8.5 % for Mixtral, Qwen3 and DeepSeek-V2-Lite (docs/benchmarks.md).
On a GPU the in-step components are followed by a host probe (``--no-host-probe`` skips it): the model's host
seconds per micro-batch, stored as the factors 'host' and 'host_recompute' (costmodel.calibrate.host_factors).

Three steps work on saved files without a device: ``foldtune calibrate merge`` puts the component factors of
several ``--model`` runs into one machine profile (:mod:`costmodel.calibrate.merge`), ``foldtune
calibrate rebuild`` re-derives a profile's curves from its stored raw timings (:mod:`costmodel.calibrate.rebuild`)
and ``foldtune calibrate finegrained`` loads a fine-grained MoE run of ``bench/finegrained_moe.py`` (host seconds
per local expert, router and permutation factors: :mod:`costmodel.calibrate.finegrained`) into a profile.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from api.cli._db import migrate_or_explain
from api.cli._units import seconds
from api.cli.arguments import add, retire, timeout_s
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, default_precision, guess_gpu
from costmodel.calibrate.component_factors import build_report
from costmodel.calibrate.merge import component_record, merged_profile
from costmodel.calibrate.profile_builder import build_profile
from costmodel.calibrate.rebuild import changed_fields, rebuild
from costmodel.calibrate.host_factors import (DEVICE_BOUND_MARGIN, MIN_RECOMPUTE_SHARE, HostProbe, device_seconds,
                                              host_factors)
from costmodel.calibrate.step_phases import report_from_phases
from db.engine import make_engine, make_sessionmaker
from db.hardware_profiles import store_calibrated_profile
from db.settings import database_settings, default_data_dir
from spec.catalog import get_hardware, get_model
from spec.errors import FoldtuneError, SpecError
from spec.profile_io import load_profile, load_raw, save_profile

HELP = "measure the local GPUs (or CPU ranks) and save a calibrated hardware profile"
MERGE_HELP = "recompute the component factors of several `calibrate --model` runs against one machine profile"
REBUILD_HELP = "re-derive a calibrated profile's curves from the raw timings stored with it"
FINEGRAINED_HELP = ("load a fine-grained MoE run (bench/finegrained_moe.py): host seconds per local expert, the "
                    "router's and the permutation's factors, derived against the profile's own prediction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gpu_argument(parser, local=True)
    add(parser, "--gpus", "default: 4 with --gpu cpu, else every local GPU; with --ray give it: all ranks over the "
                          "cluster's nodes")
    retire(parser, "--ranks", "--gpus", "the ranks are GPUs, or CPU ranks with --gpu cpu, as in every command")
    parser.add_argument("--ray", action="store_true",
                        help="run the ranks on a Ray cluster (--ray-address, FOLDTUNE_RAY_ADDRESS, else a local Ray), "
                             "--gpus-per-node on each node; ranks on two or more nodes also time the collectives "
                             "of one rank per node, the NIC stage of the network model")
    add(parser, "--ray-address", "with --ray")
    add(parser, "--gpus-per-node", "with --ray; default: the GPUs of the cluster's smallest node")
    add_shape_arguments(parser, seq=False, gbs=False)  # GEMM precision; fp8: torch._scaled_mm GEMMs, GPUs only
    parser.add_argument("--quick", action="store_true", help="fewer sizes per benchmark (CI, smoke tests)")
    parser.add_argument("--sustained-seconds", type=float, default=None, metavar="S",
                        help="seconds of back-to-back GEMMs that measure the clock under sustained load (GPUs only; "
                             "default 10, 0 skips it; --quick skips it unless given)")
    add(parser, "--name", "default: <gpu>-calibrated")
    add(parser, "--out", "a JSON file; default: <data dir>/hardware/<name>.json")
    parser.add_argument("--store", action="store_true", help="also store the profile in the service database")
    add(parser, "--database-url", "with --store")
    add(parser, "--timeout")
    add(parser, "--model", "also time the executor's components of this model at real shapes, stored as per-term "
                           "factors for MODEL@seqS")
    add(parser, "--layers", "with --model; its own key")
    add(parser, "--seq", "with --model: required")
    add(parser, "--mbs", "with --model; default: 1")
    parser.add_argument("--components", choices=("in-step", "isolated"), default="in-step",
                        help="with --model: read the components from the phases of a real 1-GPU training step "
                             "(in-step, default) or time each block alone (isolated)")
    parser.add_argument("--step-micro-batches", type=int, default=None, metavar="N",
                        help="with --components in-step: micro-batches per step (default 8, as the layout tables)")
    parser.add_argument("--no-host-probe", dest="host_probe", action="store_false",
                        help="with --model on a GPU: skip the host probe (the model's host seconds per micro-batch, "
                             "measured at a short sequence, stored as the factors 'host' and 'host_recompute')")
    actions = parser.add_subparsers(dest="action", metavar="{merge,rebuild,finegrained}",
                                    help="work on saved profiles instead of measuring (no device needed)")
    merge = actions.add_parser("merge", help=MERGE_HELP, description=MERGE_HELP)
    add(merge, "--profile", "the target machine's", required=True)
    merge.add_argument("--component-runs", required=True, metavar="FILES",
                       help="comma list of the profile files of `calibrate --model` runs")
    retire(merge, "--components", "--component-runs", "--components is calibrate's in-step/isolated choice")
    add(merge, "--out", "the merged profile", required=True)
    add(merge, "--name", "default: the target's name")
    rebuild_parser = actions.add_parser("rebuild", help=REBUILD_HELP, description=REBUILD_HELP)
    add(rebuild_parser, "--profile", "the calibrated one to re-derive", required=True)
    rebuild_parser.add_argument("--raw-from", help="take the raw timings from this file (default: --profile's own)")
    add(rebuild_parser, "--out", "the re-derived profile", required=True)
    fine = actions.add_parser("finegrained", help=FINEGRAINED_HELP, description=FINEGRAINED_HELP)
    add(fine, "--profile", "the target machine's", required=True)
    fine.add_argument("--from-file", required=True, metavar="FILE",
                      help="the JSON a bench/finegrained_moe.py run wrote (bench/results/finegrained_*.json)")
    add(fine, "--out", "the profile with the fine-grained fields", required=True)
    add(fine, "--name", "default: the target's name")


def _merge(args: argparse.Namespace) -> int:
    reports = [component_record(json.loads(Path(path).read_text()), path) for path in args.component_runs.split(",")]
    target = load_profile(args.profile)
    profile, rebuilt = merged_profile(replace(target, name=args.name or target.name), reports)
    for report in rebuilt:
        print(f"{report.key}: " + ", ".join(f"{c.name} {c.measured_s:.4g}/{c.predicted_s:.4g} s"
                                            for c in report.components if c.name != "optimizer")
              + " | factors " + ", ".join(f"{t} {f:.3f}" for t, f in report.factors.items()))
    save_profile(profile, args.out)
    print(f"wrote {args.out} ({len(profile.component_factors)} component shapes)")
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    old = load_profile(args.profile)
    raw = load_raw(args.raw_from or args.profile)
    new = rebuild(old, raw)
    save_profile(new, args.out, raw)
    changes = changed_fields(old, new)
    print(f"{args.out}: re-derived from the raw timings of {args.raw_from or args.profile} "
          f"(measured {raw.get('measured_at', '?')}); changed: {'; '.join(changes) or 'nothing'}")
    return 0


def _finegrained(args: argparse.Namespace) -> int:
    from costmodel.calibrate import finegrained

    path = Path(args.from_file)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"--from-file {path}: cannot read a JSON result ({exc})") from None
    record = finegrained.check_record(stored, str(path))
    target = load_profile(args.profile)
    factors = finegrained.derive(record, target)
    profile = finegrained.apply(replace(target, name=args.name or target.name), factors)
    b = factors.basis
    print(f"{path}: measured on {record.get('device', '?')} at {record.get('measured_at', '?')}, priced on "
          f"{target.name!r}")
    for name, value in factors.fields().items():
        print(f"  {name}: " + ("not measured (kept)" if value is None else f"{value:.4g}"))
    print(f"  host slopes fitted (s per local expert): executor {b['local_expert_host_s_fit']}, per-expert "
          f"launches {b['expert_loop_host_s_fit']}; router {b['router_measured_s']:.4g}/{b['router_priced_s']:.4g} s, "
          f"permutation {b['permutation_measured_s']:.4g}/{b['permutation_priced_s']:.4g} s (measured/priced)")
    try:  # the target's raw timings stay with it, so that `calibrate rebuild` still works on the output
        raw = load_raw(args.profile)
    except FoldtuneError:
        raw = None
    save_profile(profile, args.out, raw)
    print(f"wrote {args.out}")
    return 0


def _store(profile, url: str | None) -> str:
    url = database_settings(url).url
    migrate_or_explain(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            if not store_calibrated_profile(session, profile.name, profile.to_dict()):
                raise FoldtuneError(f"the database already holds a hardware profile {profile.name!r} that "
                                    f"calibrate did not write; choose another --name")
    finally:
        engine.dispose()
    return url


def _components(args: argparse.Namespace, profile, precision: str, cpu: bool, path) -> tuple:
    """(profile with this model shape's component factors, the report as a dict); prints the table.

    Factors of other model shapes already in ``path`` (an earlier ``calibrate --model`` to the same file)
    are kept; the same shape is replaced.
    """
    spec = get_model(args.model)
    if args.layers:
        spec = spec.with_layers(args.layers)
    print(f"components of {spec.name} at seq {args.seq}, mbs {args.mbs}, {precision} on one "
          f"{'CPU' if cpu else 'GPU'} ({args.components})", flush=True)
    step = None
    if args.components == "in-step":
        # torch: only when --model runs
        from executor.microbench.step_components import STEP_MICRO_BATCHES, measure_step

        micro = args.step_micro_batches or STEP_MICRO_BATCHES
        step = measure_step(spec, args.seq, args.mbs, precision, "cpu" if cpu else "cuda", micro_batches=micro,
                            timeout_s=timeout_s(args, "calibrate"))
        print(f"1-GPU step {step.layout}, {micro} micro-batches: {seconds(step.step_time)} (median of "
              f"{len(step.step_times)})")
        report = report_from_phases(spec, args.seq, args.mbs, precision, step.device or "cpu", step.phases, micro,
                                    profile)
    else:
        from executor.microbench.components import measure_components

        device, measured, timing = measure_components(spec, args.seq, args.mbs, precision,
                                                      "cpu" if cpu else "cuda:0")
        report = build_report(spec, args.seq, args.mbs, precision, device, measured, profile, timing)
    print(f"{'component':<10} {'measured (s)':>12} {'predicted (s)':>13} {'factor':>7}  timed as")
    for c in report.components:
        scale, unit = (1.0, "") if c.name != "optimizer" else (1e6, " (s per 1M parameters)")
        print(f"{c.name:<10} {c.measured_s * scale:>12.4g} {c.predicted_s * scale:>13.4g} {c.ratio:>7.2f}  "
              f"{report.timing.get(c.name, '?')}{unit}")
    host = None
    if args.host_probe and not cpu:
        from executor.microbench.host_probe import HOST_PROBE_SEQ, measure_host

        print(f"host probe: the 1-GPU step at seq {HOST_PROBE_SEQ}, without and with full recomputation ...",
              flush=True)
        base_s, full_s, steps_s = measure_host(spec, precision, args.mbs, timeout_s=timeout_s(args, "calibrate"))
        host = HostProbe(HOST_PROBE_SEQ, args.mbs, base_s, full_s, steps_s)
        found = host_factors(spec, host, precision, profile)
        report = replace(report, factors={**report.factors, **found})
        device_base, device_full = device_seconds(spec, host, precision, profile)
        print(f"host per micro-batch: {seconds(base_s)}, with full recomputation {seconds(full_s)} "
              f"(the model's device time {seconds(device_base)} and {seconds(device_full)}) -> "
              + (", ".join(f"{k} {v:.2f}" for k, v in found.items()) or "no host factor"))
        if len(found) < 2:
            print(f"  a step under {DEVICE_BOUND_MARGIN}x the model's device time may be device-bound, and an "
                  f"increment under {MIN_RECOMPUTE_SHARE:.0%} of the base is noise: nothing was learnt from it")
    elif args.host_probe:
        print("host probe: skipped on CPU ranks (no host floor to measure: each op ends before the next starts)")
    print(f"term factors for {report.key}: " + ", ".join(f"{t} {f:.3f}" for t, f in report.factors.items()))
    factors = {}
    if Path(path).expanduser().exists():
        try:
            factors = {k: dict(v) for k, v in load_profile(path).component_factors}
        except FoldtuneError:
            factors = {}
    factors[report.key] = report.factors
    record = report.to_dict()
    if host is not None:
        record["host_probe"] = asdict(host)
    if step is not None:  # the step the components came from, to check them against its phases later
        record["step"] = {"layout": step.layout, "global_batch_size": step.global_batch_size,
                          "step_time": step.step_time, "phases": step.phases}
    return replace(profile, component_factors=factors), record


def _check_ray_arguments(args: argparse.Namespace) -> None:
    """One clear error for a --ray run the cluster cannot answer for, before Ray starts."""
    if not args.gpu:
        raise SpecError("--ray needs --gpu: the cluster's GPU type (or cpu for CPU ranks), not this machine's")
    if args.gpus is None:
        raise SpecError("--ray needs --gpus: the ranks over all the nodes")
    if args.model:
        raise SpecError("--model times one model's components on one local GPU: run it without --ray")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise SpecError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    if args.gpus < 1:
        raise SpecError(f"--gpus must be >= 1, got {args.gpus}")


def _ray_launcher(args: argparse.Namespace, cpu: bool, ranks: int):
    """(``executor.launch_ray.launch`` bound to the cluster and its ranks per node, what it runs on in words);
    SpecError when the cluster cannot place ``ranks`` ranks that way."""
    from executor import launch_ray  # starts or attaches Ray and imports torch: only with --ray

    launch_ray.attach_ray(args.ray_address)
    shape = launch_ray.cluster_shape(launch_ray.rank_resource("gloo" if cpu else "nccl"))
    per_node = args.gpus_per_node or shape.slots_per_node
    if per_node < 1:
        raise SpecError(f"the Ray cluster has no node with a {shape.resource} to run a rank on")
    if ranks % per_node and ranks > per_node:
        raise SpecError(f"--gpus {ranks} must be a multiple of the ranks per node ({per_node}) when the ranks span "
                        f"nodes: every node holds as many")
    needed = max(1, ranks // per_node)
    on_node = min(per_node, ranks)
    fitting = sum(1 for n in shape.nodes if n.slots >= on_node)
    if fitting < needed:
        raise SpecError(f"--gpus {ranks} at {per_node} per node needs {needed} Ray node(s) with {on_node} "
                        f"{shape.resource} each; the cluster has {fitting} of {shape.num_nodes}")
    launcher = functools.partial(launch_ray.launch, ranks_per_node=per_node, name="calibrate")
    return launcher, f"{ranks} {'CPU rank(s), gloo' if cpu else 'GPU(s), NCCL'} over Ray: {needed} node(s) x {on_node}"


def run(args: argparse.Namespace) -> int:
    if args.action == "merge":
        return _merge(args)
    if args.action == "rebuild":
        return _rebuild(args)
    if args.action == "finegrained":
        return _finegrained(args)
    # torch stays out of every other foldtune command, which loads this module to build its parser
    import torch

    from executor.microbench.runner import BenchPlan, run_benchmarks
    from executor.microbench.sustained import SUSTAINED_SECONDS

    if args.model and not args.seq:
        raise SpecError("--model needs --seq (the sequence length the components run at)")
    args.mbs = 1 if args.mbs is None else args.mbs
    if not args.ray and (args.ray_address or args.gpus_per_node is not None):
        raise SpecError("--ray-address and --gpus-per-node need --ray (a calibration on a Ray cluster)")
    if args.ray:
        _check_ray_arguments(args)
    if args.step_micro_batches is not None and args.step_micro_batches < 1:
        raise SpecError(f"--step-micro-batches must be >= 1, got {args.step_micro_batches}")
    cpu = (args.gpu or "").lower() == "cpu" or (args.gpu is None and not torch.cuda.is_available())
    if args.gpu:
        get_hardware(args.gpu)  # an unknown name is the first thing to report
    if args.model:
        get_model(args.model)
    if args.ray:  # the devices are the cluster's: --gpu names them, nothing local is checked
        cpu = args.gpu.lower() == "cpu"
    elif not cpu and not torch.cuda.is_available():
        raise SpecError(f"--gpu {args.gpu} needs CUDA GPUs and this machine has none (--gpu cpu runs CPU ranks)")
    gpu = "cpu" if cpu else (args.gpu or guess_gpu(torch.cuda.get_device_name(0)))
    base = get_hardware(gpu)
    ranks = args.gpus if args.gpus is not None else (4 if cpu else torch.cuda.device_count())
    if ranks < 1:
        raise SpecError(f"--gpus must be >= 1, got {ranks}")
    launcher, where = (_ray_launcher(args, cpu, ranks) if args.ray else
                       (None, f"{ranks} {'CPU rank(s), gloo' if cpu else 'GPU(s), NCCL'}"))
    precision = args.precision or default_precision(gpu)
    if precision == "fp8" and cpu:
        raise SpecError("--precision fp8 needs CUDA GPUs with fp8 tensor cores (torch._scaled_mm)")
    if precision == "fp8" and args.model:
        raise SpecError("--precision fp8 times GEMMs only; the executor's components run in bf16/fp16/fp32: "
                        "drop --model or pick another precision")
    sustained_s = args.sustained_seconds
    if sustained_s is None:
        sustained_s = 0.0 if args.quick else SUSTAINED_SECONDS
    if not (math.isfinite(sustained_s) and sustained_s >= 0):  # inf would load the GPUs until --timeout
        raise SpecError(f"--sustained-seconds must be a finite number >= 0, got {sustained_s}")
    name = (args.name or f"{base.name}-calibrated").lower()
    print(f"calibrating {base.name} on {where}, {precision}{', quick' if args.quick else ''}", flush=True)
    raw = run_benchmarks(ranks, BenchPlan(precision=precision, quick=args.quick, sustained_s=sustained_s),
                         device="cpu" if cpu else "cuda", timeout_s=timeout_s(args, "calibrate"), launcher=launcher)
    profile = build_profile(base, raw, name)
    nodes = len(raw.get("nodes") or ())
    print(f"ranks ran on {nodes} node(s); network (NIC stage): " + (
        profile.network_source if nodes > 1 else f"not measured (one node), {profile.network_source}"))
    path = args.out or default_data_dir() / "hardware" / f"{name}.json"
    if args.model:
        profile, raw["components"] = _components(args, profile, precision, cpu, path)
    out = save_profile(profile, path, raw)
    print("GEMM efficiency (FLOPs -> of peak): "
          + ", ".join(f"{x:.3g}:{y:.3f}" for x, y in profile.gemm_efficiency.points))
    if profile.gemm_bwd_efficiency is not None:
        print("GEMM backward, input + weight gradients (forward FLOPs -> of peak): "
              + ", ".join(f"{x:.3g}:{y:.3f}" for x, y in profile.gemm_bwd_efficiency.points))
    grouped = list(profile.grouped_gemm_shape_efficiency)
    if not grouped and profile.grouped_gemm_efficiency is not None:  # a profile of one measured shape
        grouped = [("reference shape", profile.grouped_gemm_efficiency)]
    for shape, curve in grouped:
        print(f"grouped GEMM {shape} (tokens/expert -> of peak): "
              + ", ".join(f"{x:.0f}:{y:.3f}" for x, y in curve.points))
    if profile.attention_fwd_efficiency is not None:
        print("causal attention fwd / bwd (key length -> of bf16 peak): " + ", ".join(
            f"{x:.0f}:{y:.3f}/{profile.attention_bwd_efficiency(x):.3f}" for x, y in profile.attention_fwd_efficiency.points))
    print(f"memory copy: {profile.hbm_efficiency:.3f} of {base.gpu.hbm_bandwidth / 1e9:.0f} GB/s")
    for op, curve in profile.memory_bound_efficiency:
        print(f"memory-bound {op} (bytes per kernel -> of that bandwidth): "
              + ", ".join(f"{x:.3g}:{y:.3g}" for x, y in curve.points))
    print(f"launch overhead: {seconds(profile.op_launch_seconds)} per eager op"
          + (f", {seconds(profile.collective_launch_s)} per small collective"
             if profile.collective_launch_s is not None else "")
          + (f", {seconds(profile.moe_layer_host_s)} per executor MoE layer (tiny shapes, fwd+bwd)"
             if profile.moe_layer_host_s is not None else "")
          + (f", {seconds(profile.recompute_region_s)} per activation-checkpoint region"
             if profile.recompute_region_s is not None else ""))
    if profile.optimizer_seconds_per_param is not None:
        print(f"optimizer step: {seconds(profile.optimizer_seconds_per_param * 1e6)} per 1M parameters")
    if profile.sustained_clock_factor is not None:
        print(f"sustained load: tensor-core throughput {profile.sustained_clock_factor:.3f} of a burst's "
              f"(scales the compute peaks)")
    if profile.overlap_slowdown is not None:
        print(f"overlap interference: a hidden reduce-scatter still costs {profile.overlap_slowdown:.2f} of its "
              f"seconds")
    if raw.get("exchanges"):  # only a run on two or more ranks times the executor's exchanges
        print(f"executor exchanges per call beyond their price (fwd+bwd): CP K/V exchange "
              f"{seconds(profile.cp_exchange_fixed_s)}, CP chunk call floor {seconds(profile.cp_chunk_floor_s)}, "
              + ", ".join(f"{name} dispatch+combine {seconds(sec)}" for name, sec in profile.dispatcher_fixed_s))
    for key, curve in profile.collective_efficiency:
        print(f"{key:<22} " + ", ".join(f"{x / 2**20:.3g}MiB:{y:.3g}" for x, y in curve.points))
    print(f"profile {profile.name!r} written to {out}")
    if args.store:
        print(f"stored as hardware profile {profile.name!r} in {_store(profile, args.database_url)}")
    return 0
