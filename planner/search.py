"""The guided search: an Optuna study whose sampler is the (re-calibrated) cost model.

``run_search`` drives one study with ask/tell. Its sampler, :class:`CostModelSampler`, proposes the
cost model's best predictions first, then, after every measurement, refits the calibration
(:mod:`planner.calibration`) and proposes the untried layout with the best calibrated prediction,
with a small exploration bonus for layouts whose time is made of differently-weighted terms than
anything measured so far. Where the candidates carry step-time intervals (``costmodel.uncertainty``), the
trials go where those intervals overlap: the first is the layout with the lowest pessimistic end, the other
start-up trials the layouts whose optimistic end is below it (they might still be faster), fastest predicted
first (:func:`startup_order`); after them only layouts whose calibrated interval, narrowed by the calibration's
residuals, reaches below the best measured step are proposed while any is left (:func:`contenders`). It keeps
no state of its own: everything is re-read from the study, so a runner that restarts mid-job resumes the same
search from the study's storage.

Trials are run by an injected ``run_trial(config, report) -> measurement`` callable; ``report(step,
seconds)`` streams per-step times to Optuna and returns True when :class:`SlowTrialPruner` wants the
run stopped, and ``report.number`` is the trial's Optuna number. Memory enters as an Optuna constraint (measured peak, else predicted bytes, minus
capacity) and through the calibration; a trial whose measurement says ``failure_kind`` oom raises the
memory multiplier and so removes similar layouts from the rest of the search (the search reads that
word, never the reason text). Failed trials never end the job.

Precision as a searched knob: a candidate may carry its own ``precision`` (a tuning job with
``search_precision`` plans bf16 and fp8 and hands both to one study). The precision is then one more Optuna
parameter (:data:`PRECISION_PARAM`), the trial's ``report.precision`` tells ``run_trial`` what to run, and the
calibration is fitted per precision: the cost model mispredicts the two differently (fp8's datasheet peak
is rarely reached, so its compute term is over-optimistic while bf16's is not), and one common fit would
carry fp8's correction onto bf16 layouts never measured (or the reverse) and hide the other precision from
the search. Candidates without a precision (every job that does not search it) behave as before.

A searched precision is a decision the search checks rather than predicts: after the first trial, each
searched precision that has no measurement yet has its best candidate (by its own start-up order) measured
next (:meth:`CostModelSampler.unmeasured_precision_best`), and the trial budget stretches by one trial per such
precision so that a budget smaller than the precision count still measures each. The result names each
precision's best measured step (:attr:`SearchResult.best_by_precision`) and the measured gain of every other
precision over bf16 (:attr:`SearchResult.gain_over_bf16`: bf16's best step time over its, above 1 when it is
faster): a tuning job that searched fp8 says what fp8 bought, measured, not what the model predicted.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from costmodel.uncertainty import Interval, narrowed
from planner.calibration import Calibration, Observation, fit_calibration, group_seconds
from spec.failure import FailureKind
from spec.layout_codec import MULTIMODAL_OPTUNA_PARAMS, OPTUNA_PARAMS, PRECISION_PARAM, Labelled, optuna_key
from spec.multimodal_layout import layout_from_dict
from spec.parallel_config import ParallelConfig

# Trial user attributes written by the driver and read back by the sampler.
ATTR_LAYOUT = "layout"
ATTR_CONFIG = "config"
ATTR_PRED_TERMS = "predicted_terms"
ATTR_PRED_TIME = "predicted_step_time"
ATTR_PRED_MEMORY = "predicted_memory_bytes"
ATTR_PRED_INTERVAL = "predicted_step_time_interval"  # [low, high] seconds, where the candidate carries one
ATTR_PEAK = "measured_peak_bytes"
ATTR_OOM = "out_of_memory"
ATTR_FAILURE = "failure_reason"
ATTR_FAILURE_KIND = "failure_kind"  # a FailureKind value
ATTR_RETRY = "retryable"
ATTR_MEM_EXCESS = "memory_excess_bytes"
ATTR_CAPACITY = "capacity_bytes"
ATTR_EXPERT_LOAD = "expert_load"  # the measured share of routed tokens per expert
ATTR_PRECISION = "precision"  # the precision a trial ran (only for candidates that carry one)
#: the name and unit of the study's one objective: the measured seconds per optimizer step (Optuna's tools,
#: optuna-dashboard among them, show it instead of "Objective 0")
OBJECTIVE_NAME = "step_time_s"
MEMORY_CONSTRAINT = "memory"  # the name of memory_constraint's value among a trial's Optuna constraints

# Re-prices the candidates (same layouts) for a measured per-expert routing load: (load, candidates) -> candidates
Repredict = Callable[[tuple[float, ...], Sequence["Candidate"]], Sequence["Candidate"]]


@dataclass(frozen=True)
class Candidate:
    """A valid layout with its uncalibrated prediction (seconds per step, exposed per-term seconds, bytes);
    ``precision`` the training precision it is priced and run at when the search varies it (None: the job's)."""

    config: ParallelConfig
    predicted_step_time: float
    predicted_terms: tuple[tuple[str, float], ...]
    predicted_memory_bytes: float
    precision: str | None = None
    # the step-time interval (seconds) around predicted_step_time (costmodel.uncertainty); None: not known
    predicted_low: float | None = None
    predicted_high: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.predicted_low is not None and self.predicted_high is not None

    @property
    def rank_time(self) -> float:
        """The seconds the search orders it by at first: its interval's pessimistic end, else its prediction."""
        return self.predicted_high if self.predicted_high is not None else self.predicted_step_time

    @property
    def labelled(self) -> Labelled:
        """The layout with the precision the candidate carries (spec.layout_codec: its label and Optuna form)."""
        return Labelled(self.config, self.precision)

    @property
    def params(self) -> dict[str, Any]:
        """The trial's Optuna parameters (the searched precision among them when the candidate carries one)."""
        return self.labelled.optuna_params()

    @property
    def label(self) -> str:
        """The layout's label, with its ``precision=`` suffix when the candidate carries its precision."""
        return self.labelled.label()


def observations_from_trials(trials: Sequence[FrozenTrial], capacity_bytes: float,
                             terms_of: Callable[[FrozenTrial], Sequence | None] | None = None) -> list[Observation]:
    """Turn finished trials of a study into calibration observations; ``terms_of`` may supply a trial's
    current predicted terms (re-priced since it ran) instead of those stored with it."""
    out = []
    for t in trials:
        if ATTR_PRED_TERMS not in t.user_attrs:
            continue
        current = terms_of(t) if terms_of is not None else None
        terms = tuple((str(k), float(v)) for k, v in (current or t.user_attrs[ATTR_PRED_TERMS]))
        pred_mem = float(t.user_attrs.get(ATTR_PRED_MEMORY, 0.0))
        peak = t.user_attrs.get(ATTR_PEAK)
        if t.state == TrialState.COMPLETE and t.value is not None:
            out.append(Observation(terms, pred_mem, float(t.value), peak, False, capacity_bytes))
        elif t.state == TrialState.PRUNED and t.intermediate_values:
            # A pruned run still measured real steps: its median is an honest (slow) step time.
            median = statistics.median(t.intermediate_values.values())
            out.append(Observation(terms, pred_mem, median, peak, False, capacity_bytes))
        elif t.state == TrialState.FAIL and t.user_attrs.get(ATTR_OOM):
            out.append(Observation(terms, pred_mem, None, None, True, capacity_bytes))
    return out


class CostModelSampler(BaseSampler):
    """Optuna sampler that proposes layouts by calibrated cost-model prediction.

    ``candidates`` are the valid layouts that the uncalibrated model predicts to fit. The first
    ``n_startup`` proposals are the best uncalibrated predictions; later ones minimise
    ``calibrated_time · (1 − exploration · rmse · novelty)``, where rmse is the calibration's relative
    error and novelty how different a layout's mix of time terms is from every measured one (0..1).
    """

    def __init__(self, candidates: Sequence[Candidate], capacity_bytes: float, n_startup: int = 3,
                 exploration: float = 1.0, prior_strength: float = 0.5, seed: int | None = None,
                 repredict: Repredict | None = None) -> None:
        self._candidates = sorted(candidates, key=lambda c: c.rank_time)
        self._by_key = {optuna_key(c.params): c for c in self._candidates}
        # The model prices EP layouts for balanced routing until a trial measures the real per-expert load
        # (the same for every layout of one workload); then every candidate is re-priced once with it.
        self._repredict = repredict
        self.expert_load: tuple[float, ...] | None = None
        self._capacity = capacity_bytes
        self._n_startup = n_startup
        self._exploration = exploration
        self._prior_strength = prior_strength
        self._fallback = RandomSampler(seed=seed)
        self._space = search_space(self._candidates)
        self._lock = threading.Lock()

    # Optuna sampler API ----------------------------------------------------------------------------
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return dict(self._space)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        if not search_space:
            return {}
        with self._lock:
            choice = self.propose(study.get_trials(deepcopy=False), exclude_trial=trial.number)
        return dict(choice.params) if choice is not None else {}

    def sample_independent(self, study, trial, param_name, param_distribution):  # noqa: ANN001
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    # The policy ------------------------------------------------------------------------------------
    def candidate(self, params: dict[str, Any]) -> Candidate | None:
        """The candidate with these parameters, with its current (possibly re-priced) prediction."""
        return self._by_key.get(optuna_key(params))

    def _reprice(self, trials: Sequence[FrozenTrial]) -> None:
        if self._repredict is None or self.expert_load is not None:
            return
        for t in trials:
            load = t.user_attrs.get(ATTR_EXPERT_LOAD)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and load:
                self.expert_load = tuple(float(x) for x in load)
                try:
                    priced = list(self._repredict(self.expert_load, self._candidates))
                    if [optuna_key(c.params) for c in priced] != [optuna_key(c.params) for c in self._candidates]:
                        raise ValueError("repredict returned other layouts than it was given")
                except Exception as exc:  # a failed re-pricing must not end the job: keep the balanced prices
                    logging.getLogger(__name__).warning("routing load not applied to the predictions: %s", exc)
                    self._repredict = None
                    return
                self._candidates = sorted(priced, key=lambda c: c.rank_time)
                self._by_key = {optuna_key(c.params): c for c in self._candidates}
                return

    def calibration(self, trials: Sequence[FrozenTrial], precision: str | None = None) -> Calibration:
        """The fit over the trials run at ``precision`` (a study that does not search it has None only)."""
        terms_of = None
        if self.expert_load is not None:  # compare measurements with the re-priced predictions
            def terms_of(t: FrozenTrial):
                c = self._by_key.get(optuna_key(t.params))
                return c.predicted_terms if c is not None else None
        return fit_calibration(observations_from_trials(trials_at(trials, precision), self._capacity, terms_of),
                               self._prior_strength)

    def precisions(self) -> tuple[str | None, ...]:
        """The precisions the candidates carry (``(None,)`` when the search does not vary it)."""
        return tuple(dict.fromkeys(c.precision for c in self._candidates))

    def unmeasured_precisions(self, trials: Sequence[FrozenTrial], exclude_trial: int | None = None
                              ) -> tuple[str, ...]:
        """The searched precisions (when the search varies it) without a measured or running trial yet."""
        searched = self.precisions()
        if len(searched) < 2:
            return ()
        covered = {trial_precision(t) for t in trials if t.number != exclude_trial and t.params
                   and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)}
        return tuple(p for p in searched if p not in covered)

    def unmeasured_precision_best(self, trials: Sequence[FrozenTrial], taken: set[tuple],
                                  exclude_trial: int | None = None) -> Candidate | None:
        """After the first trial: the best untried candidate (its precision's start-up order) of the first searched
        precision not measured yet, or None. A failed trial does not count as its precision's measurement: the
        next best of that precision is measured instead."""
        if not taken:
            return None
        for precision in self.unmeasured_precisions(trials, exclude_trial):
            own = [c for c in self._candidates if c.precision == precision]
            best = next((c for c in startup_order(own) if optuna_key(c.params) not in taken), None)
            if best is not None:
                return best
        return None

    def propose(self, trials: Sequence[FrozenTrial], exclude_trial: int | None = None) -> Candidate | None:
        """The next layout to measure given the study's trials so far, or None when all are tried."""
        self._reprice(trials)
        taken: set[tuple] = set()
        measured_shares: list[dict[str, float]] = []
        for t in trials:
            if t.number == exclude_trial or not t.params:
                continue
            if t.state == TrialState.FAIL and t.user_attrs.get(ATTR_RETRY):
                continue  # its runner died: measure it again
            taken.add(optuna_key(t.params))
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and ATTR_PRED_TERMS in t.user_attrs:
                measured_shares.append(_shares(t.user_attrs[ATTR_PRED_TERMS]))
        untried = [c for c in self._candidates if optuna_key(c.params) not in taken]
        if not untried:
            return None
        checked = self.unmeasured_precision_best(trials, taken, exclude_trial)
        if checked is not None:  # every searched precision measured at its best before the model decides
            return checked
        finished = [t for t in trials if t.state.is_finished()]
        if len(finished) < self._n_startup:
            return next(c for c in startup_order(self._candidates) if optuna_key(c.params) not in taken)
        cals = {p: self.calibration(trials, p) for p in self.precisions()}
        fitting = [c for c in untried if cals[c.precision].memory(c.predicted_memory_bytes) <= self._capacity] \
            or untried
        measured = [t.value for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        if measured:  # where intervals overlap the best measured step: the layouts that may still beat it
            fitting = contenders(fitting, cals, min(measured)) or fitting

        def score(c: Candidate) -> float:
            cal = cals[c.precision]
            bonus = self._exploration * cal.relative_rmse
            novelty = _novelty(_shares(c.predicted_terms), measured_shares) if bonus else 0.0
            return cal.step_time(c.predicted_terms) * (1.0 - min(0.5, bonus * novelty))

        return min(fitting, key=score)


def startup_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The order of the search's first trials: the candidate with the lowest pessimistic end (``rank_time``), then
    those whose interval overlaps its interval (optimistic end below its pessimistic end: they may be faster),
    lowest prediction first, then the rest by ``rank_time``. Without intervals: by prediction."""
    if not candidates:
        return []
    ranked = sorted(candidates, key=lambda c: c.rank_time)
    first = ranked[0]
    overlap = sorted((c for c in ranked[1:] if c.has_interval and c.predicted_low < first.rank_time),
                     key=lambda c: c.predicted_step_time)
    seen = {id(c) for c in overlap}
    return [first, *overlap, *(c for c in ranked[1:] if id(c) not in seen)]


def calibrated_interval(candidate: Candidate, calibration: Calibration) -> Interval:
    """The candidate's step time after ``calibration`` (seconds) with its interval: the uncalibrated interval's
    relative widths around the calibrated time, each side narrowed to the fit's residual error where that is
    smaller (:func:`costmodel.uncertainty.narrowed`). A candidate without an interval has a zero-width one."""
    value = calibration.step_time(candidate.predicted_terms)
    if not candidate.has_interval:
        return Interval(value, value, value)
    own = Interval(candidate.predicted_step_time, candidate.predicted_low, candidate.predicted_high)
    return narrowed(own, calibration.relative_rmse, calibration.num_observations, value)


def contenders(candidates: Sequence[Candidate], calibrations: dict[str | None, Calibration],
               best_measured: float) -> list[Candidate]:
    """The candidates with an interval whose calibrated optimistic end is below ``best_measured`` (seconds): the
    untried layouts that may still be faster than the best trial. Empty when none carries an interval."""
    return [c for c in candidates if c.has_interval
            and calibrated_interval(c, calibrations[c.precision]).low < best_measured]


def memory_constraint(trial: FrozenTrial | optuna.Trial) -> tuple[float]:
    """Optuna constraint of a measured trial (<= 0 is feasible): bytes over device memory.

    Uses the measured peak when the run reported one (GPUs), else the prediction. :func:`run_search`
    records it (as ``MEMORY_CONSTRAINT``) for complete and pruned trials; a run that failed with
    out-of-memory is a failed trial instead.
    """
    capacity = float(trial.user_attrs.get(ATTR_CAPACITY, math.inf))
    peak = trial.user_attrs.get(ATTR_PEAK)
    used = float(peak) if peak else float(trial.user_attrs.get(ATTR_PRED_MEMORY, 0.0))
    return (used - capacity,)


def trial_precision(trial: FrozenTrial) -> str | None:
    """The precision a trial ran when the study searches it (its Optuna parameter), else None."""
    return trial.params.get(PRECISION_PARAM)


def trials_at(trials: Sequence[FrozenTrial], precision: str | None) -> list[FrozenTrial]:
    """The trials run at ``precision`` (None: those of a study that does not search it)."""
    return [t for t in trials if trial_precision(t) == precision]


def _feasible(trial: FrozenTrial) -> bool:
    """True unless Optuna recorded a violated constraint (a dict in Optuna 5, a list before)."""
    recorded = trial.constraints or ()
    values = recorded.values() if isinstance(recorded, dict) else recorded
    return all(v <= 0 for v in values)


def _shares(terms: Sequence[Sequence[Any]]) -> dict[str, float]:
    groups = group_seconds([(str(k), float(v)) for k, v in terms])
    total = sum(groups.values()) or 1.0
    return {g: s / total for g, s in groups.items()}


def _novelty(shares: dict[str, float], measured: list[dict[str, float]]) -> float:
    if not measured:
        return 1.0
    return min(sum(abs(shares[g] - m[g]) for g in shares) / 2.0 for m in measured)


def search_space(candidates: Sequence[Candidate]) -> dict[str, CategoricalDistribution]:
    """One categorical distribution per layout parameter, over the values the candidates use."""
    values: dict[str, set] = {name: set() for name in OPTUNA_PARAMS + (PRECISION_PARAM,) + MULTIMODAL_OPTUNA_PARAMS}
    for c in candidates:
        for name, value in c.params.items():
            values[name].add(value)
    return {name: CategoricalDistribution(sorted(v, key=str)) for name, v in values.items() if v}


class SlowTrialPruner(BasePruner):
    """Stops a short run whose median step time is clearly slower than the best finished trial.

    After ``warmup_steps`` reported steps, prune when median(reported) > (1 + ``margin``) · best.
    """

    def __init__(self, margin: float = 0.25, warmup_steps: int = 2) -> None:
        self.margin = margin
        self.warmup_steps = warmup_steps

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        values = list(trial.intermediate_values.values())
        if len(values) < self.warmup_steps:
            return False
        completed = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.value is not None]
        if not completed:
            return False
        return statistics.median(values) > (1.0 + self.margin) * min(completed)


@dataclass(frozen=True)
class SearchBudget:
    """When to stop: at most ``max_trials`` trials and ``max_seconds`` of wall time (None = no limit)."""

    max_trials: int = 12
    max_seconds: float | None = None
    parallel_trials: int = 1


@dataclass
class TrialRow:
    """One line of the measured-vs-predicted table."""

    number: int
    layout: str
    state: str
    predicted_step_time: float
    calibrated_step_time: float | None
    measured_step_time: float | None
    predicted_memory_bytes: float
    measured_peak_bytes: float | None
    failure_reason: str | None = None
    precision: str | None = None  # the precision it ran, when the search varies it

    @property
    def time_error(self) -> float | None:
        """(predicted − measured) / measured of the uncalibrated model, or None when not measured."""
        if not self.measured_step_time:
            return None
        return (self.predicted_step_time - self.measured_step_time) / self.measured_step_time


@dataclass(frozen=True)
class PrecisionBest:
    """The fastest measured trial at one searched precision: its label and step time (seconds; a pruned trial's
    median step)."""

    precision: str
    layout: str
    step_time: float


@dataclass
class SearchResult:
    best_config: ParallelConfig | None
    best_step_time: float | None
    rows: list[TrialRow]
    calibration: Calibration
    stopped_because: str
    extra: dict = field(default_factory=dict)
    best_precision: str | None = None  # the best trial's precision when the search varies it
    # per searched precision (the key: its name) the fit over its trials; empty unless the search varies it
    calibration_by_precision: dict[str, Calibration] = field(default_factory=dict)
    # per searched precision with a measured trial, its fastest (empty unless the search varies precision)
    best_by_precision: dict[str, PrecisionBest] = field(default_factory=dict)

    @property
    def gain_over_bf16(self) -> dict[str, float]:
        """Per other measured precision: bf16's best step time over its best (above 1: faster than bf16), from
        the measurements; empty when bf16 was not searched or not measured."""
        base = self.best_by_precision.get("bf16")
        if base is None:
            return {}
        return {p: base.step_time / b.step_time for p, b in self.best_by_precision.items() if p != "bf16"}


class TrialReport:
    """The ``report`` handed to ``run_trial``: ``report(step, seconds)`` streams one step's time to Optuna and
    returns True when the pruner wants the run stopped; ``number`` is the Optuna trial number being measured
    (what stored trials are keyed by); ``precision`` the training precision to run it at when the search
    varies it (None: the job's own)."""

    def __init__(self, trial: optuna.Trial, precision: str | None = None) -> None:
        self._trial = trial
        self.number: int = trial.number
        self.precision: str | None = precision

    def __call__(self, step: int, seconds: float) -> bool:
        self._trial.report(seconds, step)
        return self._trial.should_prune()


RunTrial = Callable[[ParallelConfig, TrialReport], Any]


def run_search(candidates: Sequence[Candidate], run_trial: RunTrial, *, capacity_bytes: float,
               budget: SearchBudget = SearchBudget(), storage: str | optuna.storages.BaseStorage | None = None,
               study_name: str = "foldtune", sampler: BaseSampler | None = None,
               pruner: BasePruner | None = None, on_event: Callable[[str, dict], None] | None = None,
               repredict: Repredict | None = None, study_attrs: dict[str, Any] | None = None) -> SearchResult:
    """Search ``candidates`` by measuring them with ``run_trial`` until the budget is spent.

    ``storage`` is an Optuna storage URL or object (None = in memory); with the same storage and
    ``study_name`` a second call resumes the study: finished trials count towards the budget and
    trials left RUNNING by a dead runner are failed as retryable and measured again.
    ``on_event(kind, data)`` receives 'trial_started', 'trial_finished' and 'search_finished'.
    ``repredict`` (default sampler only): re-prices the candidates once a trial has measured the routing
    load per expert (a measurement's ``tokens_per_expert``); later trials store the re-priced prediction.
    ``study_attrs`` are stored on the study (``Study.set_user_attr``: JSON values), so that a study read by
    other tools (optuna-dashboard) says what it searched: the model, the cluster, the job.
    """
    if not candidates:
        raise ValueError("no candidate layouts to search")
    by_key = {optuna_key(c.params): c for c in candidates}
    sampler = sampler or CostModelSampler(candidates, capacity_bytes, repredict=repredict)
    study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize", sampler=sampler,
                                pruner=pruner or SlowTrialPruner(), load_if_exists=True)
    with warnings.catch_warnings():  # experimental in Optuna 5.0 (stable since 3.2): the warning says nothing
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([OBJECTIVE_NAME])
    for key, value in (study_attrs or {}).items():
        study.set_user_attr(key, value)
    emit = on_event or (lambda kind, data: None)
    for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_user_attr(stale._trial_id, ATTR_RETRY, True)
        study._storage.set_trial_user_attr(stale._trial_id, ATTR_FAILURE, "runner stopped mid-trial; retried")
        study._storage.set_trial_user_attr(stale._trial_id, ATTR_FAILURE_KIND, FailureKind.LOST.value)
        study.tell(stale.number, state=TrialState.FAIL)
    start = time.monotonic()
    distributions = search_space(candidates)

    def finished_count() -> int:
        return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished()
                   and not t.user_attrs.get(ATTR_RETRY))

    def start_trial() -> tuple[optuna.Trial, Candidate] | None:
        trial = study.ask(distributions)
        cand = by_key.get(optuna_key(trial.params))
        if cand is not None and isinstance(sampler, CostModelSampler):
            cand = sampler.candidate(trial.params) or cand  # re-priced after a routing measurement
        if cand is None:  # the sampler had nothing left (or an outside sampler proposed an invalid combo)
            trial.set_user_attr(ATTR_FAILURE, "not a valid candidate layout")
            trial.set_user_attr(ATTR_FAILURE_KIND, FailureKind.INVALID.value)
            study.tell(trial, state=TrialState.FAIL)
            return None
        trial.set_user_attr(ATTR_LAYOUT, cand.label)
        if cand.precision is not None:
            trial.set_user_attr(ATTR_PRECISION, cand.precision)
        trial.set_user_attr(ATTR_CONFIG, cand.config.to_dict())
        trial.set_user_attr(ATTR_PRED_TERMS, [list(t) for t in cand.predicted_terms])
        trial.set_user_attr(ATTR_PRED_TIME, cand.predicted_step_time)
        if cand.has_interval:
            trial.set_user_attr(ATTR_PRED_INTERVAL, [cand.predicted_low, cand.predicted_high])
        trial.set_user_attr(ATTR_PRED_MEMORY, cand.predicted_memory_bytes)
        trial.set_user_attr(ATTR_MEM_EXCESS, cand.predicted_memory_bytes - capacity_bytes)
        trial.set_user_attr(ATTR_CAPACITY, capacity_bytes)
        emit("trial_started", {"number": trial.number, "layout": cand.label, "labelled": cand.labelled,
                               "precision": cand.precision,
                               "predicted_step_time": cand.predicted_step_time})
        return trial, cand

    def execute(trial: optuna.Trial, cand: Candidate) -> Any:
        return run_trial(cand.config, TrialReport(trial, cand.precision))

    def finish(trial: optuna.Trial, cand: Candidate, fut: Future) -> None:
        try:
            m = fut.result()
            error = None
        except Exception as exc:  # a broken trial must never end the job
            m, error = None, f"{type(exc).__name__}: {exc}"
        peak = getattr(m, "peak_allocated_bytes", None) if m is not None else None
        if peak:
            trial.set_user_attr(ATTR_PEAK, float(peak))
        counts = getattr(m, "tokens_per_expert", None) if m is not None else None
        if counts and sum(counts) > 0:
            trial.set_user_attr(ATTR_EXPERT_LOAD, [c / sum(counts) for c in counts])
        if m is not None and getattr(m, "ok", False) and getattr(m, "step_time", None):
            pruned = getattr(m, "pruned", False)
            # Memory enters Optuna's constraint API, so the study (and any sampler replaying it) knows which
            # measured layouts were feasible; Optuna records constraints of complete and pruned trials only.
            trial.set_constraint(MEMORY_CONSTRAINT, memory_constraint(trial)[0])
            if pruned:
                study.tell(trial, state=TrialState.PRUNED)
            else:
                study.tell(trial, float(m.step_time))
            state = "pruned" if pruned else "complete"
        else:
            reason = error or getattr(m, "failure_reason", None) or "trial failed without a reason"
            kind = FailureKind((getattr(m, "failure_kind", None) if m is not None else None) or FailureKind.ERROR)
            trial.set_user_attr(ATTR_FAILURE, reason)
            trial.set_user_attr(ATTR_FAILURE_KIND, kind.value)
            if kind == FailureKind.OOM:
                trial.set_user_attr(ATTR_OOM, True)
            study.tell(trial, state=TrialState.FAIL)
            state = "failed"
        failed = state == "failed"
        emit("trial_finished", {"number": trial.number, "layout": cand.label, "precision": cand.precision,
                                "state": state,
                                "measurement": m,
                                "step_time": getattr(m, "step_time", None) if m is not None else None,
                                "predicted_step_time": cand.predicted_step_time,
                                "failure_reason": trial.user_attrs.get(ATTR_FAILURE) if failed else None,
                                "failure_kind": trial.user_attrs.get(ATTR_FAILURE_KIND) if failed else None})

    def precision_unchecked() -> bool:
        """Whether a searched precision has no measured or running trial yet (its best is then proposed next)."""
        return isinstance(sampler, CostModelSampler) and bool(
            sampler.unmeasured_precisions(study.get_trials(deepcopy=False)))

    # the budget stretches by one trial per searched precision beyond the first, so that each is measured
    stretch = len(sampler.precisions()) - 1 if isinstance(sampler, CostModelSampler) else 0
    stopped = "budget: max trials"
    running: dict[Future, tuple[optuna.Trial, Candidate]] = {}
    with ThreadPoolExecutor(max_workers=max(1, budget.parallel_trials)) as pool:
        exhausted = False
        while True:
            out_of_time = budget.max_seconds is not None and time.monotonic() - start >= budget.max_seconds
            while (not exhausted and not out_of_time and len(running) < max(1, budget.parallel_trials)
                   and (finished_count() + len(running) < budget.max_trials
                        or (finished_count() + len(running) < budget.max_trials + stretch
                            and precision_unchecked()))):
                started = start_trial()
                if started is None:
                    exhausted = True
                    break
                trial, cand = started
                running[pool.submit(execute, trial, cand)] = (trial, cand)
            if not running:
                if exhausted:
                    stopped = "every candidate layout measured"
                elif out_of_time:
                    stopped = "budget: max time"
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in done:
                trial, cand = running.pop(fut)
                finish(trial, cand, fut)

    return _result(study, sampler, capacity_bytes, stopped, emit)


def _result(study: optuna.Study, sampler: BaseSampler, capacity_bytes: float, stopped: str,
            emit: Callable[[str, dict], None]) -> SearchResult:
    trials = study.get_trials(deepcopy=False)
    searched = (sampler.precisions() if isinstance(sampler, CostModelSampler)
                else tuple(dict.fromkeys(trial_precision(t) for t in trials)) or (None,))
    if isinstance(sampler, CostModelSampler):
        cals = {p: sampler.calibration(trials, p) for p in searched}
    else:
        cals = {p: fit_calibration(observations_from_trials(trials_at(trials, p), capacity_bytes))
                for p in searched}
    rows = []
    for t in trials:
        if ATTR_LAYOUT not in t.user_attrs:
            continue
        terms = [(str(k), float(v)) for k, v in t.user_attrs.get(ATTR_PRED_TERMS, [])]
        measured = t.value if t.state == TrialState.COMPLETE else (
            statistics.median(t.intermediate_values.values()) if t.state == TrialState.PRUNED
            and t.intermediate_values else None)
        cal = cals.get(trial_precision(t))
        rows.append(TrialRow(number=t.number, layout=t.user_attrs[ATTR_LAYOUT], state=t.state.name.lower(),
                             predicted_step_time=float(t.user_attrs.get(ATTR_PRED_TIME, math.nan)),
                             calibrated_step_time=cal.step_time(terms) if terms and cal is not None else None,
                             measured_step_time=measured,
                             predicted_memory_bytes=float(t.user_attrs.get(ATTR_PRED_MEMORY, math.nan)),
                             measured_peak_bytes=t.user_attrs.get(ATTR_PEAK),
                             failure_reason=t.user_attrs.get(ATTR_FAILURE), precision=trial_precision(t)))
    best_config = best_time = best_precision = None
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                and _feasible(t)] or \
               [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if complete:
        best = min(complete, key=lambda t: t.value)
        best_config = layout_from_dict(best.user_attrs[ATTR_CONFIG])
        best_time = best.value
        best_precision = trial_precision(best)
    # the job's calibration: the best trial's precision's fit (the searched one measured most before any is best)
    main = best_precision if best_precision in cals else max(
        cals, key=lambda p: cals[p].num_observations)
    by_precision = {p: c for p, c in cals.items() if p is not None}
    bests: dict[str, PrecisionBest] = {}
    # a pruned trial counts by the median of the steps it ran: the pruner stopped it for being slower, and it may
    # be its precision's only measurement
    for r in sorted((r for r in rows if r.measured_step_time is not None and r.precision is not None),
                    key=lambda r: r.measured_step_time):
        bests.setdefault(r.precision, PrecisionBest(r.precision, r.layout, float(r.measured_step_time)))
    result = SearchResult(best_config, best_time, rows, cals[main], stopped, best_precision=best_precision,
                          calibration_by_precision=by_precision, best_by_precision=bests)
    emit("search_finished", {"best_layout": Labelled(best_config, best_precision).label() if best_config else None,
                             "best_precision": best_precision,
                             "best_step_time": best_time, "stopped_because": stopped,
                             "gain_over_bf16": result.gain_over_bf16})
    return result
