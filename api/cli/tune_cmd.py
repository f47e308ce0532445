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
from api.cli._shape_args import add_gpu_argument, add_shape_arguments, detected_gpu, resolve_shape
from api.cli._memory_args import add_headroom_argument
from api.cli._router_args import add_router_arguments, router_body_from
from api.cli._model_args import add_model_arguments, model_body
from api.schemas.jobs import JobCreate
from api.service.capability import check_job_runnable
from api.service.jobs import resolve_job, submit_job
from spec.catalog import has_hardware
from spec.layout_codec import Labelled
from spec.profile_io import use_profile_file
from api.cli._local_key import owner_of_local_key

HELP = "set up the embedded service and run one real tuning job here (SQLite, local Ray)"
# api.worker.auto_profile.AUTO_CALIBRATE_MODES, spelled out: the worker (torch) loads only when the job runs
AUTO_CALIBRATE_CHOICES = ("quick", "minimal", "off")
TUNE_AUTO_CALIBRATE = "quick"  # on every GPU type, cpu included: the machine tune runs on, measured once and stored
SEARCH_PRECISION_HELP = ("measure precision as a knob: trials at the training's --precision, bf16 and fp8 (fp8 only on "
                         "GPUs with an fp8 peak; the job says when it is dropped), ranked together by predicted "
                         "step time; the best layout names its precision")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default="tiny-moe", model_help="catalog model name")
    add_gpu_argument(parser, local=True)
    parser.add_argument("--profile", metavar="FILE",
                        help="hardware profile JSON (from foldtune calibrate) to price layouts with; replaces --gpu")
    parser.add_argument("--gpus", type=int, default=4, help="number of GPUs / CPU ranks (default: 4)")
    add_shape_arguments(parser)
    parser.add_argument("--max-trials", type=int, default=6, help="measured trials at most (default: 6)")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="search wall-clock budget (default: 900)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per trial (default: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per trial (default: 1)")
    parser.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial is stopped")
    parser.add_argument("--no-reuse", action="store_true",
                        help="start and end each trial's rank processes (default: kept between trials of one "
                             "shape; also FOLDTUNE_REUSE_RANKS=0)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node the planner assumes (also: FOLDTUNE_GPUS_PER_NODE; default: read from "
                             "the Ray cluster)")
    parser.add_argument("--database-url", help="service database (default: SQLite in FOLDTUNE_DATA_DIR or ~/.foldtune)")
    add_headroom_argument(parser)
    parser.add_argument("--auto-calibrate", choices=AUTO_CALIBRATE_CHOICES,
                        help="on a built-in (datasheet) profile with no stored calibration of its GPU type (on cpu: "
                             "of its rank count), first calibrate this machine, store it for later jobs and price "
                             "with it (also: FOLDTUNE_AUTO_CALIBRATE; default quick, cpu included; minimal: "
                             "seconds, for tests; off: the datasheet)")
    parser.add_argument("--search-precision", action="store_true", help=SEARCH_PRECISION_HELP)
    add_router_arguments(parser)


class TrialPrinter:
    """Prints the runner's events: one line per trial start and end, then the table and the best layout."""

    def __init__(self, out=None) -> None:
        self.out = out or sys.stdout

    def __call__(self, kind: str, data: dict) -> None:
        say = lambda text: print(text, file=self.out, flush=True)
        if kind == "calibrating":
            say(f"job {data['job_id']}: no calibrated profile of {data['gpu']} yet: calibrating this machine "
                f"({data['mode']}: GEMMs, attention, copies, launch overheads, collectives) before the search ...")
        elif kind == "calibrated":
            say(f"job {data['job_id']}: calibrated in {data['seconds']:.0f} s, stored as {data['name']!r} (later jobs "
                f"reuse it)" + (f"; {data['note']}" if data.get("note") else ""))
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
                say(f"  Ray: {ray['nodes']} node(s) with {slots} {ray['resource']} each; the planner assumes "
                    f"{ray['gpus_per_node']} per node; {ray['parallel_trials']} trial(s) at a time")
        elif kind == "trial_started":
            say(f"  trial {data['number']:>2}  {data['layout']:<60} predicted {_ms(data['predicted_step_time'])}"
                f"  running ...")
        elif kind == "trial_finished":
            state = {"complete": "ok", "pruned": "pruned", "failed": "FAILED"}.get(data["state"], data["state"])
            line = (f"  trial {data['number']:>2}  {data['layout']:<60} predicted {_ms(data['predicted_step_time'])}"
                    f"  measured {_ms(data.get('step_time'))}  {state}")
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
        say(f"  {'#':>3}  {'layout':<60} {'state':<9} {'predicted':>10} {'calibrated':>10} {'measured':>10} "
            f"{'error':>8}")
        for r in data["rows"]:
            err = f"{r.time_error:+.0%}" if r.time_error is not None else "-"
            say(f"  {r.number:>3}  {r.layout:<60} {r.state:<9} {_ms(r.predicted_step_time):>10} "
                f"{_ms(r.calibrated_step_time):>10} {_ms(r.measured_step_time):>10} {err:>8}")
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
        if data.get("best") is not None:
            best = Labelled(data["best"], data.get("best_precision") or None).label()
            say(f"best layout: {best}  {_ms(data['best_step_time'])} per step (measured)")
        say(f"job {data['job_id']}: {data['status']}" + (f" ({data['error']})" if data.get("error") else ""))


def tune_auto_calibrate(flag: str | None, setting: str | None) -> str:
    """The calibration mode of tune's job: ``--auto-calibrate``, else FOLDTUNE_AUTO_CALIBRATE (``setting``), else
    quick on every GPU type, cpu included. The runner's own default on cpu is off (its CPU jobs are tests), but
    tune's job is the first thing a user sees: the datasheet CPU entry priced its steps 86-99 % short
    (docs/benchmarks.md)."""
    return flag or setting or TUNE_AUTO_CALIBRATE


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def run(args: argparse.Namespace) -> int:
    # the worker imports torch, Optuna and the executor: only `foldtune tune` itself pays for them
    from api.worker.runner import Runner, RunnerSettings
    from api.worker.trials import TrialSettings

    if args.profile:  # registered under its own name; its GPU kind decides CPU or GPU ranks
        profile = use_profile_file(args.profile)
        hardware_name, args.gpu = profile.name, profile.gpu.name
    else:
        args.gpu = hardware_name = args.gpu or detected_gpu()
    shape = resolve_shape(args, args.gpu, "tune")
    request = validated_request(JobCreate, {
        **model_body(args), "training": {"seq_length": shape.seq, "global_batch_size": shape.gbs,
                                         "precision": shape.precision},
        "cluster": {"gpu": hardware_name, "num_gpus": args.gpus,
                    **({} if args.min_headroom is None else {"min_headroom": args.min_headroom})},
        "budget": {"max_trials": args.max_trials, "max_seconds": args.max_seconds},
        **({"search_precision": True} if args.search_precision else {}), **router_body_from(args)})
    start = time.monotonic()
    base = RunnerSettings.from_env(args.database_url, runner_id=f"tune-{os.getpid()}")
    trial = TrialSettings(warmup_steps=args.warmup, timed_steps=args.steps, timeout_s=args.trial_timeout,
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
