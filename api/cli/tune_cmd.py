"""``foldtune tune``: the main job in one command: set up the embedded service and run one real tuning job.

On a fresh machine it creates the data directory, migrates the SQLite database there (or the database of
FOLDTUNE_DATABASE_URL), stores the job under the owner of the local API key (FOLDTUNE_API_KEY, else the key
file in the data dir, created with owner ``local`` on first use: api/cli/_local_key.py) so that ``foldtune jobs``
and ``foldtune best`` see it, and runs it in this process with the same
runner code ``foldtune runner`` uses: the job, its trials and its Optuna study go through the database,
and every trial is a real profiled run of the MoE training step through Ray (a local Ray unless
FOLDTUNE_RAY_ADDRESS names one). Running the runner in-process rather than starting the API and a runner
keeps the first command free of ports, keys and background processes; ``foldtune serve`` + ``foldtune
runner`` + ``foldtune submit`` is the same job as a service. Its first job on a machine calibrates the
machine first (``--auto-calibrate``, default quick on every GPU type, cpu included: api/worker/auto_profile.py)
and stores the profile in that database, so later jobs price with it at once. Progress is printed for the
calibration and per trial, and the job ends with the best layout and the measured-vs-predicted table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from api.cli._local import check_ray_has_room, validated_request
from api.cli._units import column_width, seconds, seconds_cell
from api.cli._shape_args import (add_gpu_argument, add_shape_arguments, check_profile_agrees, detected_gpu,
                                 local_gpus, resolve_shape)
from api.cli.arguments import add, add_all, budget_defaults, retire, step_counts, timeout_s
from api.cli._router_args import add_router_arguments, router_body_from
from api.cli._model_args import add_model_arguments, model_body
from api.schemas.jobs import JobCreate
from api.service.capability import check_job_runnable
from api.service.jobs import resolve_job, submit_job
from spec.catalog import has_hardware
from spec.layout_codec import Labelled
from spec.profile_io import use_profile_file
from api.cli._local_key import owner_of_local_key
from executor.node import cpu_cores

HELP = "set up the embedded service and run one real tuning job here (SQLite, local Ray)"
# api.worker.auto_profile.AUTO_CALIBRATE_MODES, spelled out: the worker (torch) loads only when the job runs
AUTO_CALIBRATE_CHOICES = ("quick", "minimal", "off")


DEFAULT_MODEL = "tiny-moe"
TUNE_AUTO_CALIBRATE = "quick"  # on every GPU type, cpu included: the machine tune runs on, measured once and stored


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, required=False, note=f"default: {DEFAULT_MODEL}")
    add_gpu_argument(parser, local=True)
    add(parser, "--profile", "prices the layouts; its GPU kind is the --gpu, so give one of the two")
    add(parser, "--gpus", "default: 4 with --gpu cpu, else every local GPU")
    add_shape_arguments(parser)
    add_all(parser, "--max-trials", "--max-seconds", "--timed-steps", "--untimed-steps", "--timeout")
    parser.add_argument("--no-reuse", action="store_true",
                        help="start and end each trial's rank processes (default: kept between trials of one "
                             "shape; also FOLDTUNE_REUSE_RANKS=0)")
    add(parser, "--gpus-per-node", "the planner's; also: FOLDTUNE_GPUS_PER_NODE; default: read from the Ray cluster")
    add(parser, "--database-url")
    add(parser, "--min-headroom")
    parser.add_argument("--auto-calibrate", choices=AUTO_CALIBRATE_CHOICES,
                        help="on a built-in (datasheet) profile with no stored calibration of its GPU type (on cpu: "
                             "of its rank count), first calibrate this machine, store it for later jobs and price "
                             "with it (also: FOLDTUNE_AUTO_CALIBRATE; default quick, cpu included; minimal: "
                             "seconds, for tests; off: the datasheet)")
    add(parser, "--search-precision", "each trial at its own; the best layout names its precision")
    add_router_arguments(parser)
    retire(parser, "--warmup", "--untimed-steps", "--warmup is a training's learning-rate warm-up elsewhere")
    retire(parser, "--steps", "--timed-steps", "--steps counts a training's optimizer steps elsewhere")
    retire(parser, "--trial-timeout", "--timeout")


class TrialPrinter:
    """Prints the runner's events: one line per trial start and end, then the table and the best layout."""

    def __init__(self, out=None) -> None:
        self.out = out or sys.stdout

    def __call__(self, kind: str, data: dict) -> None:
        say = lambda text: print(text, file=self.out, flush=True)
        if kind == "calibrating":
            say(f"job {data['job_id']}: no calibrated profile of {data['gpu']} yet: calibrating this machine "
                f"({data['mode']}: GEMMs, attention, copies, memory-bound ops, launch overheads, collectives) "
                "before the search ...")
        elif kind == "calibrated":
            say(f"job {data['job_id']}: calibrated in {data['seconds']:.0f} s, stored as {data['name']!r} (later jobs "
                f"reuse it)" + (f"; {data['note']}" if data.get("note") else ""))
        elif kind == "job_started" and data.get("kind") == "verify":
            say(f"job {data['job_id']}: verify {data['model']} on {data['gpus']} x {data['gpu']}: the plan's top "
                f"{data['top']} layouts, each by one rank timed here (priced as {data['slice_gpu']})")
        elif kind == "layout_checked":
            say(f"  #{data['plan_rank']} {data['layout']}: "
                + (f"not measured: {data['error']}" if data.get("error") else "measured"))
        elif kind == "job_started":
            p = data.get("pricing_profile") or {}
            if p:
                say(f"job {data['job_id']}: priced with hardware profile {p['name']!r} ({p['source']}"
                    + (f"; {p['note']}" if p.get("note") else "") + ")")
            c = data["candidates"]
            say(f"job {data['job_id']}: {data['model']} on {data['gpus']} x {data['gpu']}: {c['valid']:,} valid "
                f"layouts, {c['fitting']:,} fit in memory, searching the best {c['searched']} the executor runs "
                f"with up to {data['max_trials']} trials")
            if c.get("precisions"):  # the job searches precision: what it measures, what it left out
                say(f"  precisions searched: {', '.join(c['precisions'])}"
                    + (f" ({c['precision_note']})" if c.get("precision_note") else ""))
            ray = data.get("ray_cluster")
            if ray:  # where the trials run: what Ray reported and what the planner was told
                slots = ", ".join(map(str, ray["slots_per_node"])) or "none"
                # a local Ray is given more CPU slots than the machine has cores (so the ranks and the calibration
                # fit): say what the ranks really share
                cores = (f" ({cpu_cores()} cores on this machine, shared by the ranks)"
                         if ray["resource"] == "CPU" and not os.environ.get("FOLDTUNE_RAY_ADDRESS") else "")
                say(f"  Ray: {ray['nodes']} node(s) with {slots} {ray['resource']} slot(s) each{cores}; the planner "
                    f"assumes {ray['gpus_per_node']} per node; {ray['parallel_trials']} trial(s) at a time")
        elif kind == "trial_started":
            say(f"  trial {data['number']:>2}  {data['layout']:<60} predicted {seconds(data['predicted_step_time'])}"
                f"  running ...")
        elif kind == "trial_finished":
            state = {"complete": "ok", "pruned": "pruned", "failed": "FAILED"}.get(data["state"], data["state"])
            line = (f"  trial {data['number']:>2}  {data['layout']:<60} predicted {seconds(data['predicted_step_time'])}"
                    f"  measured {seconds(data.get('step_time'))}  {state}")
            if data.get("failure_reason"):
                line += f": {data['failure_reason']}"
            m = data.get("measurement")
            if getattr(m, "fixed_cost_s", None) is not None:  # dispatch → first timed step (executor.rank_pool)
                line += (f"  fixed cost {m.fixed_cost_s:.1f} s (start-up {m.startup_s:.1f} s, warm-up "
                         f"{m.warmup_s:.1f} s{', reused ranks' if m.reused_ranks else ''})")
            say(line)
        elif kind == "job_finished":
            self._finished(data, say)

    def _finished(self, data: dict, say) -> None:
        if "rows" not in data:
            say(f"job {data['job_id']}: {data['status']}" + (f" ({data['error']})" if data.get("error") else ""))
            return
        say("")
        say("measured vs predicted (step time per optimizer step; error = (predicted - measured) / measured)")
        width = column_width([r.layout for r in data["rows"]], "layout", 60)
        say(f"  {'#':>3}  {'layout':<{width}} {'state':<9} {'predicted (s)':>13} {'calibrated (s)':>14} "
            f"{'measured (s)':>12} {'error':>8}")
        for r in data["rows"]:
            err = f"{r.time_error:+.0%}" if r.time_error is not None else "-"
            say(f"  {r.number:>3}  {r.layout:<{width}} {r.state:<9} {seconds_cell(r.predicted_step_time):>13} "
                f"{seconds_cell(r.calibrated_step_time):>14} {seconds_cell(r.measured_step_time):>12} {err:>8}")
        cal = data["result"]
        mult = ", ".join(f"{k} x{v:.2f}" for k, v in cal["time_multipliers"].items())
        say(f"calibration: {mult}; memory x{cal['memory_multiplier']:.2f} "
            f"(from {cal['num_observations']} measurements)")
        say(f"search stopped: {cal['stopped_because']}")
        fixed = cal.get("fixed_cost") or {}
        if fixed.get("trials"):
            after = fixed["median_after_first_s"]
            say(f"fixed cost per trial (dispatch to first timed step): first {fixed['first_s']:.1f} s, median after "
                f"the first {'-' if after is None else f'{after:.1f} s'}, {fixed['total_s']:.1f} s in all "
                f"({fixed['trials']} trials)")
        for precision, b in (cal.get("best_by_precision") or {}).items():
            say(f"best at {precision}: {b['layout']}  {seconds(b['step_time_s'])} per step (measured)")
        for precision, gain in (cal.get("gain_over_bf16") or {}).items():
            say(f"{precision} over bf16 (best measured of each): {gain:.2f}x "
                f"({'faster' if gain > 1 else 'not faster'} than bf16)")
        if data.get("best") is not None:
            best = Labelled(data["best"], data.get("best_precision") or None).label()
            say(f"best layout: {best}  {seconds(data['best_step_time'])} per step (measured)")
        say(f"job {data['job_id']}: {data['status']}" + (f" ({data['error']})" if data.get("error") else ""))


def tune_auto_calibrate(flag: str | None, setting: str | None) -> str:
    """The calibration mode of tune's job: ``--auto-calibrate``, else FOLDTUNE_AUTO_CALIBRATE (``setting``), else
    quick on every GPU type, cpu included. The runner's own default on cpu is off (its CPU jobs are tests), but
    tune's job is the first thing a user sees: the datasheet CPU entry priced its steps 86-99 % short
    (docs/benchmarks.md)."""
    return flag or setting or TUNE_AUTO_CALIBRATE


def run(args: argparse.Namespace) -> int:
    # the worker imports torch, Optuna and the executor: only `foldtune tune` itself pays for them
    from api.worker.runner import Runner, RunnerSettings
    from api.worker.trials import TrialSettings

    if not (args.model or args.model_file or args.model_dir or args.hf_config):
        args.model = DEFAULT_MODEL
    if args.profile:  # registered under its own name; its GPU kind decides CPU or GPU ranks
        profile = use_profile_file(args.profile)
        check_profile_agrees(args.gpu, profile.gpu.name, args.profile)
        hardware_name, args.gpu = profile.name, profile.gpu.name
    else:
        args.gpu = hardware_name = args.gpu or detected_gpu()
    if args.gpus is None:
        args.gpus = local_gpus(args.gpu)
    shape = resolve_shape(args, args.gpu, "tune")
    max_trials, max_seconds = budget_defaults(args, args.gpu)
    untimed, timed = step_counts(args)
    request = validated_request(JobCreate, {
        **model_body(args), "training": {"seq_length": shape.seq, "global_batch_size": shape.gbs,
                                         "precision": shape.precision},
        "cluster": {"gpu": hardware_name, "num_gpus": args.gpus,
                    **({} if args.min_headroom is None else {"min_headroom": args.min_headroom})},
        "budget": {"max_trials": max_trials, "max_seconds": max_seconds},
        **({"search_precision": True} if args.search_precision else {}), **router_body_from(args)})
    start = time.monotonic()
    base = RunnerSettings.from_env(args.database_url, runner_id=f"tune-{os.getpid()}")
    trial = TrialSettings(warmup_steps=untimed, timed_steps=timed, timeout_s=timeout_s(args, "tune"),
                          rank_memory_bytes=base.trial.rank_memory_bytes, faults=base.trial.faults,
                          reuse_ranks=base.trial.reuse_ranks and not args.no_reuse)
    settings = RunnerSettings(database_url=base.database_url, runner_id=base.runner_id, heartbeat_s=base.heartbeat_s,
                              stale_after_s=base.stale_after_s, poll_s=base.poll_s,
                              parallel_trials=base.parallel_trials, trial=trial,
                              gpus_per_node=base.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node,
                              auto_calibrate=tune_auto_calibrate(args.auto_calibrate, base.auto_calibrate))
    if has_hardware(hardware_name):  # the front door's check before Ray and the database (submit_job repeats it)
        resolved = resolve_job(None, request)
        check_job_runnable(resolved.model, resolved.training, resolved.cluster, request.budget.max_trials,
                           search_precision=request.search_precision)
    check_ray_has_room(args.gpu, args.gpus)
    runner = Runner(settings, on_event=TrialPrinter())
    try:
        with runner.sessions() as session:
            owner = owner_of_local_key(session, say=lambda text: print(text, flush=True))
            job, _ = submit_job(session, owner, request, None)  # a domain error is a FoldtuneError: main reports it
        print(f"database {settings.database_url}; job {job.id} stored, running it here "
              f"(Ray: {os.environ.get('FOLDTUNE_RAY_ADDRESS') or 'local'})", flush=True)
        status = runner.run_job_id(job.id)
    finally:
        runner.close()
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if status == "succeeded" else 1
