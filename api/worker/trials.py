"""One trial of a tuning job: profile a layout through the Ray launcher with a short step budget.

The search calls ``run_trial(config, report)``; here that becomes ``executor.profile.profile_layout`` with
the Ray launcher, whose rank 0 streams every timed step to ``report`` (Optuna's intermediate values and
pruner) and stops all ranks when the search prunes the trial or the job is stopped.

Fault injection for tests and drills: the runner's ``FOLDTUNE_FAULT`` may select trials by their Optuna
number, ``kill:rank=1:step=0:trial=2`` (see :mod:`executor.progress`); a part with ``trial=`` reaches the
ranks of those trials only, a part without it reaches every trial.
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from executor import launch_ray
from executor.options import ExecutorOptions
from executor.profile import profile_layout
from executor.vlm.profile import profile_vl_layout
from executor.progress import FAULT_ENV
from executor.rank_pool import REUSE_ENV, reuse_enabled
from api.worker.settings import DEFAULT_TIMED_STEPS, DEFAULT_TRIAL_TIMEOUT_S, DEFAULT_WARMUP_STEPS, TrialEnv
from planner.search import TrialReport
from spec.errors import SpecError
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.parallel_config import ParallelConfig
from spec.router_options import RouterOptions
from spec.training_spec import TrainingSpec
from spec.shape_defaults import is_cpu


class JobStopped(BaseException):  # noqa: N818 (a control-flow signal, like KeyboardInterrupt)
    """The job was cancelled, given to another runner, or the runner is shutting down.

    A BaseException on purpose: :func:`planner.search.run_search` records any ``Exception`` of a trial as a
    failed trial, but a trial interrupted by a stop is no measurement at all. It propagates out of the
    search and leaves the Optuna trial RUNNING, which a resumed search fails as retryable and measures again.
    """


@dataclass(frozen=True)
class TrialSettings:
    """Step budget and limits of one trial: ``warmup_steps`` untimed and ``timed_steps`` timed optimizer
    steps, ``timeout_s`` seconds for the run, ``rank_memory_bytes`` of address space per CPU rank
    (None: the hardware profile's device memory); ``reuse_ranks``: trials of one shape run on the same rank
    actors (:class:`executor.launch_ray.RayRankPools`), else each trial starts and ends its own."""

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    timed_steps: int = DEFAULT_TIMED_STEPS
    timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    rank_memory_bytes: int | None = None
    faults: str = ""
    reuse_ranks: bool = True  # keep rank actors between trials of one shape (FOLDTUNE_REUSE_RANKS=0: off)

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.timed_steps < 1 or self.timeout_s <= 0:
            raise SpecError(f"trial budget needs warmup_steps >= 0, timed_steps >= 1 and timeout_s > 0, got "
                            f"{self.warmup_steps}, {self.timed_steps}, {self.timeout_s}")


def faults_for_trial(spec: str, number: int) -> str:
    """The ``FOLDTUNE_FAULT`` parts of ``spec`` that apply to trial ``number``, without their trial key."""
    parts = []
    for part in (spec or "").split(","):
        fields = [f for f in part.strip().split(":") if f]
        if not fields:
            continue
        selectors = [f for f in fields if f.startswith("trial=")]
        try:
            wanted = {int(s.split("=", 1)[1]) for s in selectors}
        except ValueError:
            raise SpecError(f"{FAULT_ENV} part {part!r}: trial must be an integer") from None
        if not wanted or number in wanted:
            parts.append(":".join(f for f in fields if not f.startswith("trial=")))
    return ",".join(parts)


def is_cpu_cluster(cluster: ClusterSpec) -> bool:
    """Whether ``cluster``'s ranks are CPU processes (gloo): spec.shape_defaults' one rule."""
    return is_cpu(cluster.hardware.gpu.name)


class TrialExecutor:
    """``run_trial`` for :func:`planner.search.run_search`, bound to one job's model, training and cluster.

    ``stop`` (an Event) abandons a running trial at once (the launcher kills its ranks, even in a hung
    step) and raises :class:`JobStopped`. A trial's ranks sit ``cluster.gpus_per_node`` to a Ray node, in the
    planner's rank order. A trial whose ``report.precision`` is set (a job searching precision) runs the job's
    training at that precision.
    """

    def __init__(self, model: ModelSpec | VisionLanguageSpec, training: TrainingSpec, cluster: ClusterSpec,
                 settings: TrialSettings,
                 stop: threading.Event, router: RouterOptions | None = None, name: str = "trial",
                 images: ImageInputs | None = None) -> None:
        self.model, self.training, self.cluster, self.settings = model, training, cluster, settings
        self.images = images  # a vision-language job's: its trials run the multimodal step on synthetic images
        self.name = name  # Ray names each trial's placement group and actors after it: <name>-trial-<number>
        self.stop = stop
        # the job's router options, model defaults decided (DeepSeek-V3's expert bias on unless switched off)
        self.options = ExecutorOptions.for_training(training, router,
                                                    model.llm if isinstance(model, VisionLanguageSpec) else model)
        # rank actors kept between trials of one shape (executor.rank_pool); None: each trial starts its own
        self.pools = launch_ray.RayRankPools() if settings.reuse_ranks else None

    def close(self) -> None:
        """End the rank actors kept between trials (call when the job's search ends)."""
        if self.pools is not None:
            self.pools.close()

    def training_for(self, report: TrialReport) -> TrainingSpec:
        """The job's training at the precision the search asks this trial to run (its own when None)."""
        precision = getattr(report, "precision", None)
        return self.training if precision is None else replace(self.training, precision=precision)

    def __call__(self, config: ParallelConfig, report: TrialReport):
        label = config.label()
        if self.stop.is_set():
            raise JobStopped(f"stopped before trial {label} ran")
        cpu = is_cpu_cluster(self.cluster)
        faults = faults_for_trial(self.settings.faults, report.number)
        memory = self.settings.rank_memory_bytes or (self.cluster.hardware.gpu.hbm_bytes if cpu else None)
        pruned = threading.Event()

        def on_step(step: int, seconds: float) -> bool:
            if report(step, seconds):
                pruned.set()
            return pruned.is_set() or self.stop.is_set()

        launch = self.pools.launch if self.pools is not None else launch_ray.launch
        launcher = functools.partial(launch, on_step=on_step, memory_limit_bytes=memory,
                                     env={FAULT_ENV: faults}, cancel=self.stop,
                                     ranks_per_node=self.cluster.gpus_per_node,
                                     name=f"{self.name}-trial-{report.number}")
        training = self.training_for(report)
        budget = dict(warmup_steps=self.settings.warmup_steps, timed_steps=self.settings.timed_steps,
                      timeout_s=self.settings.timeout_s, device="cpu" if cpu else "cuda",
                      hardware=self.cluster.hardware.name, launcher=launcher)
        if isinstance(self.model, VisionLanguageSpec):
            measurement = profile_vl_layout(self.model, training, self.images, config, self.options, **budget)
        else:
            measurement = profile_layout(self.model, training, config, self.options, **budget)
        if self.stop.is_set() and not pruned.is_set():
            raise JobStopped(f"stopped during trial {label}")
        return measurement


def trial_settings_from_env(environ: Mapping[str, str] | None = None) -> TrialSettings:
    """TrialSettings from FOLDTUNE_TRIAL_WARMUP_STEPS, FOLDTUNE_TRIAL_STEPS, FOLDTUNE_TRIAL_TIMEOUT_S,
    FOLDTUNE_RANK_MEMORY_BYTES, FOLDTUNE_FAULT and FOLDTUNE_REUSE_RANKS (:class:`TrialEnv`; default: the
    process environment)."""
    env = TrialEnv.read(environ)
    try:
        return TrialSettings(warmup_steps=env.trial_warmup_steps, timed_steps=env.trial_steps,
                             timeout_s=env.trial_timeout_s,
                             rank_memory_bytes=None if env.rank_memory_bytes is None else int(env.rank_memory_bytes),
                             faults=env.fault, reuse_ranks=reuse_enabled({REUSE_ENV: env.reuse_ranks}))
    except ValueError as exc:
        raise SpecError(f"bad trial setting in the environment: {exc}") from None


def fixed_cost_summary(costs: dict[int, float]) -> dict:
    """The job's fixed cost per trial (seconds from dispatch to the first timed step, by trial number, trials
    that measured it): the first trial's (it starts the ranks), the median of the others (ranks kept), the
    total. Zeros and Nones when no trial measured it."""
    ordered = [costs[n] for n in sorted(costs)]
    return {"trials": len(ordered), "first_s": ordered[0] if ordered else None,
            "median_after_first_s": statistics.median(ordered[1:]) if len(ordered) > 1 else None,
            "total_s": sum(ordered)}
