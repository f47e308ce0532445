"""Prune the valid layouts by predicted memory and rank what fits by predicted step time: by default by the
pessimistic end of each layout's step-time interval (``rank_by='robust'``, :func:`_best_first`), else by the
point estimate.

The enumeration holds hundreds of thousands of valid configs on a large cluster; calling both cost models
on each would take minutes. The ranker leans on four monotone properties of any sane cost model and
evaluates only what they cannot settle:

1. memory grows with the micro-batch size, shrinks with more recomputation (none < selective(core_attn)
   < selective(core_attn+moe_act+layernorm) < full) and is no larger with the distributed optimizer.
   So per (layout, dispatcher, optimizer) the configs that fit form a staircase over (micro-batch,
   recompute), found with a handful of memory calls; the counts of fitting and pruned configs are exact
   under this property.
2. step time grows with more recomputation (the same layout redoes more forward work). Per (layout,
   micro-batch, dispatcher, optimizer) only the least recomputation that fits can be the fastest.
3. the distributed optimizer is no slower than the plain one (reduce-scatter + all-gather move what one
   all-reduce moves, and the optimizer step runs on a shard).
4. pipelining does not make the per-micro-batch work cheaper: with tp, cp, ep, etp, dispatcher and
   micro-batch fixed, every layer costs the same on any pp/vpp, and the most loaded of pp stages runs
   ``m_pp · max(stage) >= m_pp · (all layers) / pp = m_1 · (all layers)``, because the micro-batch
   count m grows with pp exactly as the layers per stage shrink. So the steady-state time of the
   single-stage layout (its step time without the once-per-step terms: gradient sync, parameter
   gather, optimizer) bounds the step time of every pp/vpp/recompute/optimizer variant from below: one
   time call bounds a whole group of candidates.

The fastest candidate of each (layout, micro-batch, dispatcher) enters a best-first queue keyed by its
group's bound; popping a bound-only entry times it for real, popping a timed one puts it on the list and
queues its slower siblings (more recompute, plain optimizer) keyed by its own time. The queue stops after
N timed pops, so only candidates whose bound beats the N-th best time are ever timed, and the top N are
exactly the N fastest fitting configs when properties 2-4 hold. With the default time model a group's bound
is itself deferred: its heads enter keyed by a floor of it that sums cached layer parts
(``costmodel.estimate.steady_state_floor``, no step assembled), and the first one popped computes the bound
and goes back keyed by it, where it would have stood from the start; most groups never reach the front, and
the queue times the same candidates in the same order. Both kinds of breach are detected where
they would matter and counted: ``order_violations`` (a sibling faster than the config it followed) and
``bound_violations`` (a candidate faster than its bound, or a bound below its floor); 0 means the properties
held wherever they were used. ``exhaustive=True`` (``--pareto``) times every fitting config instead and also
returns the Pareto front of step time against memory.

The ranking puts what foldtune's executor runs first: every config the queue puts on the list is judged by the
rule book's executor rules (``spec.validity.executor_refusal``), and the queue runs on until it holds the N
best executable configs (or runs dry), keeping the Megatron-only ones it met on the way; the list is the
executable ones by rank time, then the others. ``megatron=True`` ranks by rank time alone, what Megatron-Core
can run. Either way every ranked :class:`Estimate` says whether foldtune executes it and why not.

Work is split over the CPU cores (fork) when the enumeration is large.
"""

from __future__ import annotations

import gc
import heapq
import multiprocessing
import os
import threading
import time as _time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

from costmodel.estimate import Estimate, combine, pessimistic_step_time, steady_state_floor, step_time
from costmodel.memory import LayoutMemory, MemoryBreakdown, estimate_memory, peak_memory_bytes
from costmodel.step_time import StepTimeBreakdown
from costmodel.terms import TERM_TABLE
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit
from spec.training_spec import TrainingSpec
from spec.errors import InvalidConfigError, SpecError
from spec.validity import (Rejection, Validator, batch_rule, check_config, executor_model_rule, executor_refusal,
                           world_dense, world_expert)
from planner.time_limit import check_time
from planner.enumerate import (NO_OFFLOAD, BoundKey, ConfigMaker, DispatchOption, Enumeration, KnobOption, Layout,
                               SearchSpace, StaircaseKey, enumerate_layouts, pipeline_fields, recompute_count)

MemoryFn = Callable[[ModelSpec, TrainingSpec, ClusterSpec, ParallelConfig], MemoryBreakdown]
MemoryTotalFn = Callable[[ModelSpec, TrainingSpec, ClusterSpec, ParallelConfig], float]
# Terms paid once per step (the term table's per-step rows) or only because of pipelining (the bubble); the rest
# is the steady state of the micro-batches. Derived, so a new per-step term cannot pass for steady state.
PER_STEP_TERMS = frozenset(t.name for t in TERM_TABLE if t.per_step) | {"pp_bubble"}
TimeFn = Callable[[ModelSpec, TrainingSpec, ClusterSpec, ParallelConfig], StepTimeBreakdown]

PARALLEL_THRESHOLD = 20_000  # valid configs above which the scan is split over processes
# What the ranked list is ordered by: "robust", the step-time interval's pessimistic end (the default: a layout
# whose time rests on constants never measured ranks below one as fast whose constants were), or "point", the
# point estimate alone. An injected time model has no interval: both orders are its point estimates.
RANK_BY = ("robust", "point")
# Under rank_by='robust' the queue keeps picking past its top N until no remaining candidate can rank better
# (exact), but picks at most the shortlist (robust_shortlist(N): this many times N, and never fewer than
# ROBUST_MIN_SHORTLIST, so that asking for fewer layouts does not shorten the list they are drawn from):
# intervals wide on unmeasured constants would otherwise make it time most layouts within 2-3x of the fastest.
# PlanResult.robust_exact says whether the cap was reached.
ROBUST_SHORTLIST = 10
ROBUST_MIN_SHORTLIST = 100


def robust_shortlist(top: int) -> int:
    """How many executable layouts, fastest by point estimate first, a robust ranking of ``top`` draws from."""
    return max(ROBUST_SHORTLIST * top, ROBUST_MIN_SHORTLIST)
RobustFn = Callable[[ModelSpec, TrainingSpec, ClusterSpec, ParallelConfig, StepTimeBreakdown], float]


class NoValidLayoutError(InvalidConfigError):
    """Every layout of the search space breaks a validity rule (the message names the rules and an example)."""


def default_memory_fn() -> MemoryFn:
    return estimate_memory


def default_memory_total_fn() -> MemoryTotalFn:
    return peak_memory_bytes


def default_time_fn() -> TimeFn:
    return step_time  # estimate_step_time with the profile's component factors


@dataclass
class PlanResult:
    """Everything ``foldtune plan`` reports: counts, the ranked list, and how much work it took."""

    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    enumeration: Enumeration
    fitting: int  # valid configs predicted to fit in memory
    ranked: list[Estimate]  # best first by ``rank_by``
    pareto: list[Estimate] = field(default_factory=list)  # step time vs memory (exhaustive mode only)
    closest: Estimate | None = None  # the least-over-memory config when nothing fits
    memory_calls: int = 0
    time_calls: int = 0
    order_violations: int = 0
    bound_violations: int = 0
    bound_calls: int = 0  # time calls spent on lower bounds (included in time_calls)
    exhaustive: bool = False
    enumerate_seconds: float = 0.0
    rank_seconds: float = 0.0
    workers: int = 1
    rank_by: str = "robust"  # RANK_BY: what ``ranked`` is ordered by
    # under 'robust': True when the queue stopped by itself (the ranking is exact), False when it reached
    # ``robust_shortlist`` picks (the ranking is by rank time among the shortlist, fastest by point estimate)
    robust_exact: bool = True
    robust_shortlist: int = 0
    megatron: bool = False  # ranked by rank time alone (what Megatron-Core runs), not executable first

    @property
    def pruned_by_memory(self) -> int:
        return self.enumeration.valid - self.fitting

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


class Choice(NamedTuple):
    """One config of a :class:`_Job` by reference: the index of its layout, its micro-batch size and
    dispatcher, and the indices of its optimizer and recompute options (ParallelConfig objects are built
    only for the few configs that are priced or reported)."""

    idx: int
    mbs: int
    dispatcher: DispatchOption
    o: int
    r: int


class _Head(NamedTuple):
    """A family of configs for the best-first queue (:func:`_best_first`): its time bound (or the bound's
    floor), its layout and micro-batch index, its dispatcher option, the least fitting recompute of the first
    optimizer choice, and every optimizer choice's least fitting recompute per micro-batch index."""

    bound: float
    idx: int
    k: int
    dispatcher: DispatchOption
    r0: int
    r_mins: list[list[int | None]]


class _Ranked(NamedTuple):
    """One config a scan offers: its step time (seconds), the config by reference (a :class:`Choice`, or
    (job index, Choice) once scans of several jobs merge), in exhaustive mode its memory total (bytes), and the
    time it ranks by (seconds: the pessimistic end of its interval under ``rank_by='robust'``, else None: its
    step time), and whether it ranks among the executable configs (always, when ranked for Megatron-Core)."""

    step_time: float
    choice: Any
    memory: float | None = None
    robust: float | None = None
    executable: bool = True

    @property
    def rank(self) -> float:
        return self.step_time if self.robust is None else self.robust

    def rank_key(self) -> tuple:
        """Executable first, then by rank time (and memory, exhaustive mode)."""
        return not self.executable, self.rank, self.memory or 0.0


class _Closest(NamedTuple):
    """The config a scan found least over memory (bytes), by reference as in :class:`_Ranked`."""

    memory: float
    choice: Any


_new = tuple.__new__


@dataclass(frozen=True)
class _Job:
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    layouts: list[Layout]
    recompute: tuple[tuple[str, tuple[str, ...]], ...]
    distopts: tuple[bool, ...]
    memory_fn: Any
    memory_total_fn: Any
    time_fn: Any
    exhaustive: bool
    top: int = 10
    pipeline: PipelineSplit = DEFAULT_SPLIT
    offload: KnobOption = NO_OFFLOAD  # the knob option (offload, optimizer dtypes) every config of this job has
    # the default memory model's sweep (costmodel.memory.LayoutMemory, the same bytes as memory_total_fn);
    # None with an injected memory model
    layout_memory: Any = None
    # settle a layout's staircases without memory calls when its static bytes alone exceed the memory; off for
    # the rescan that names the closest config when nothing fits (pruned layouts never offered one)
    prune_static: bool = True
    # a cheap lower bound on _steady_state_bound (the default time model's, costmodel.estimate.steady_state_floor):
    # heads enter the best-first queue keyed by it and their group's bound is computed only when one is popped;
    # None with an injected time model (bounds computed for every group during the scan)
    floor_fn: Any = None
    # the time a timed candidate ranks by (RobustFn: the pessimistic end of its interval), None: its step time
    robust_fn: Any = None
    # config -> why the executor cannot run it (None: it can), spec.validity.executor_refusal bound to the model
    # and training: the ranking puts the configs it accepts first; None: ranked by rank time alone
    refusal: Any = None

    def executable(self, config: ParallelConfig) -> bool:
        """Whether ``config`` ranks among the executable configs (all of them without :attr:`refusal`)."""
        return self.refusal is None or self.refusal(config) is None

    def config(self, maker: ConfigMaker, choice: Choice) -> ParallelConfig:
        granularity, modules = self.recompute[choice.r]
        return maker.make(self.layouts[choice.idx], choice.mbs, choice.dispatcher, self.distopts[choice.o],
                          granularity, modules)

    def config_from(self, base: dict, mbs: int, o: int, r: int) -> ParallelConfig:
        granularity, modules = self.recompute[r]
        return ConfigMaker.from_base(base, mbs, self.distopts[o], granularity, modules)


@dataclass
class _Scan:
    """What one process learned about a slice of the layouts."""

    # default mode: the slice's top N; exhaustive mode: every fitting config, with its memory total
    heads: list[_Ranked] = field(default_factory=list)
    fitting: int = 0
    memory_calls: int = 0
    time_calls: int = 0
    bound_calls: int = 0
    order_violations: int = 0
    bound_violations: int = 0
    closest: _Closest | None = None
    pruned_static: int = 0  # staircases settled by LayoutMemory.least_bytes alone
    robust_cut: bool = False  # a robust queue stopped at its shortlist cap (PlanResult.robust_exact)

    def add(self, part: _Scan, tag=lambda choice: choice) -> None:
        """Fold ``part`` into this scan; ``tag`` maps each of its Choices (heads and closest) to this scan's."""
        self.heads.extend(_Ranked(h.step_time, tag(h.choice), h.memory, h.robust, h.executable) for h in part.heads)
        self.fitting += part.fitting
        self.memory_calls += part.memory_calls
        self.time_calls += part.time_calls
        self.bound_calls += part.bound_calls
        self.order_violations += part.order_violations
        self.bound_violations += part.bound_violations
        self.pruned_static += part.pruned_static
        self.robust_cut = self.robust_cut or part.robust_cut
        if part.closest is not None and (self.closest is None or part.closest.memory < self.closest.memory):
            self.closest = _Closest(part.closest.memory, tag(part.closest.choice))


_JOB: _Job | None = None  # set before forking workers, so they inherit it instead of unpickling it


def _scan(job: _Job, indices: range) -> _Scan:
    out = _Scan()
    maker = ConfigMaker(job.cluster.num_gpus, job.pipeline, job.offload)
    usable = job.cluster.usable_hbm_bytes
    n_rec = len(job.recompute)
    n_opt = len(job.distopts)
    model, training, cluster = job.model, job.training, job.cluster
    mem_fn, time_fn = job.memory_total_fn, job.time_fn
    trusted = ParallelConfig.trusted
    # the knob fields of every (optimizer, recompute) pair, merged into a layout's fields per call
    knobs = [[ConfigMaker.knobs(d, g, mods) for g, mods in job.recompute] for d in job.distopts]
    heads = out.heads
    memory_calls = time_calls = fitting = bound_calls = 0
    closest = out.closest
    # steady-state bounds by Layout.bound_key, and the heads' queue keys: the bounds, or their floors when
    # job.floor_fn is set
    bounds: dict[BoundKey, float] = {}
    keys = bounds if job.floor_fn is None else {}
    expect_all = [True] * n_opt  # per optimizer choice: did everything fit in the previous layout?
    # staircases by Layout.staircase_key: the one vpp lower is a close guess (the same weights, a few more
    # micro-batches in flight)
    earlier: dict[StaircaseKey, list[int | None]] = {}

    sweep = job.layout_memory
    # one config per (optimizer, recompute) option: the knobs LayoutMemory reads (it caches them by identity)
    knob_configs = [[trusted(maker.template, k) for k in row] for row in knobs]

    n_all = len(job.recompute)
    block = None
    neighbour_key: tuple | None = None  # the memory fields of the layout before (see `shared` below)
    for idx in indices:
        check_time()
        lay = job.layouts[idx]
        sizes = lay.micro_batch_sizes
        if (lay.tp, lay.cp, lay.pp) != block:  # the enumeration leaves a (tp, cp, pp) block for good: its
            block = (lay.tp, lay.cp, lay.pp)    # staircases can no longer be guesses
            earlier.clear()
        # dispatcher options the memory model prices alike (EP overlap beside plain alltoall) share their
        # LayoutMemory and their answers: fits(k, r) per optimizer choice at k·n_all + r; so do the neighbouring
        # layouts that differ in their CP communication type alone (the memory model prices every type alike)
        memory_key = (lay.tp, lay.cp, lay.pp, lay.vpp, lay.ep, lay.etp, sizes, lay.dispatchers)
        fresh = memory_key != neighbour_key
        if fresh:
            shared: dict[tuple, tuple] = {}
            too_big: list[bool] | None = None  # per optimizer choice: the static bytes alone exceed the memory
            neighbour_key = memory_key
        # the first dispatcher option's fields and config, built once for the static check and its staircases
        first_base = maker.base(lay, lay.dispatchers[0])
        first = trusted(first_base) if sweep is not None else None
        if sweep is not None and job.prune_static:  # the same static bytes for every dispatcher
            if fresh:
                memory = sweep(model, training, cluster, first)
                too_big = [memory.least_bytes(knob_configs[0][0]) > usable]
            if too_big[0]:
                # every staircase of the layout is empty: the first optimizer choice's (no config fits), and so
                # the others', whose floors it gives; only the bookkeeping of the staircases remains
                nothing: list[int | None] = [None] * len(sizes)
                for dispatcher in lay.dispatchers:
                    for o in range(n_opt):
                        earlier[lay.staircase_key(dispatcher, o)] = nothing
                expect_all = [False] * n_opt
                out.pruned_static += len(lay.dispatchers)
                continue
            if fresh:
                # the other optimizer choices' static bytes, needed only when the first choice's leave room
                too_big += [memory.least_bytes(option[0]) > usable for option in knob_configs[1:]]
                shared[sweep.key(first)] = (memory.peak_bytes,
                                            [[None] * (len(sizes) * n_all) for _ in range(n_opt)])
        for dispatcher in lay.dispatchers:
            base = first_base if dispatcher == lay.dispatchers[0] else maker.base(lay, dispatcher)
            n_rec = recompute_count(job.recompute, dispatcher)  # EP overlap stops before full recompute
            floors: list[int | None] = [0] * len(sizes)
            guesses = same_layout if dispatcher != lay.dispatchers[0] else [None] * n_opt
            same_layout: list[list[int | None] | None] = []
            r_mins_by_option: list[list[int | None]] = []
            if sweep is None:
                peak, answers = None, [[None] * (len(sizes) * n_all) for _ in range(n_opt)]
            else:
                layout_cfg = first if base is first_base else trusted(base)
                mkey = sweep.key(layout_cfg)
                entry = shared.get(mkey)
                if entry is None:
                    memory = sweep(model, training, cluster, layout_cfg)
                    entry = shared[mkey] = (memory.peak_bytes, [[None] * (len(sizes) * n_all) for _ in range(n_opt)])
                peak, answers = entry
            for o in range(n_opt):
                known: list[bool | None] = answers[o]
                row = knobs[o]
                option = knob_configs[o]

                def fits(k: int, r: int) -> bool:
                    nonlocal memory_calls, closest
                    ok = known[k * n_all + r]
                    if ok is None:
                        if peak is None:
                            cfg = trusted(base, row[r], {"micro_batch_size": sizes[k]})
                            total = mem_fn(model, training, cluster, cfg)
                        else:
                            total = peak(sizes[k], option[r])
                        memory_calls += 1
                        ok = known[k * n_all + r] = total <= usable
                        # an answer shared with an earlier dispatcher option was already offered here with the
                        # same total, which only a smaller total replaces
                        if closest is None or total < closest.memory:
                            closest = _Closest(total, Choice(idx, sizes[k], dispatcher, o, r))
                    return ok

                staircase = lay.staircase_key(dispatcher, o)
                guess = guesses[o] if guesses[o] is not None else earlier.get(staircase)
                if guess is not None and len(guess) != len(sizes):
                    guess = None
                if too_big is not None and too_big[o]:  # fits(k, r) is false everywhere: the staircase's answer
                    r_mins = [None] * len(sizes)
                    out.pruned_static += 1
                else:
                    r_mins = _staircase(fits, len(sizes), n_rec, floors, guess, expect_all[o])
                same_layout.append(r_mins)
                earlier[staircase] = r_mins
                all_fit = True
                for r, floor in zip(r_mins, floors):
                    if r is not None:
                        fitting += n_rec - r
                    if r is None or r != floor:
                        all_fit = False
                expect_all[o] = all_fit
                r_mins_by_option.append(r_mins)
                floors = r_mins  # the plain optimizer needs at least the recompute the distributed one needs
            if job.exhaustive:
                for k, mbs in enumerate(sizes):
                    for o, rm in enumerate(r_mins_by_option):
                        if rm[k] is None:
                            continue
                        for r in range(rm[k], n_rec):
                            cfg = job.config_from(base, mbs, o, r)
                            breakdown = time_fn(model, training, cluster, cfg)
                            total = mem_fn(model, training, cluster, cfg)
                            time_calls += 1
                            memory_calls += 1
                            robust = (None if job.robust_fn is None
                                      else job.robust_fn(model, training, cluster, cfg, breakdown))
                            heads.append(_Ranked(breakdown.step_time, Choice(idx, mbs, dispatcher, o, r), total,
                                                 robust, job.executable(cfg)))
                continue
            for k, r0 in enumerate(r_mins_by_option[0]):
                if r0 is None:  # the first optimizer choice does not fit; a later one cannot either
                    continue
                mbs = sizes[k]
                gkey = lay.bound_key(dispatcher, mbs)
                lb = keys.get(gkey)
                if lb is None:
                    if job.floor_fn is None:
                        lb = bounds[gkey] = _steady_state_bound(job, base, mbs, knobs[0][0])
                        bound_calls += 1
                    else:  # the bound itself only if the queue reaches this group (_best_first)
                        lb = _steady_state_floor(job, base, mbs, knobs[0][0])
                    keys[gkey] = lb
                # a Choice, and the other optimizer choices' least recompute, only once popped
                heads.append(_new(_Head, (lb, idx, k, dispatcher, r0, r_mins_by_option)))
    out.memory_calls, out.time_calls, out.fitting, out.closest = memory_calls, time_calls, fitting, closest
    out.bound_calls = bound_calls
    if not job.exhaustive:
        # this slice's own exact top N (the global top N is among the slices' top Ns), timed here where
        # the cost models' caches for these layouts are warm
        out.heads = _best_first(job, maker, heads, job.top, out, bounds)
    return out


# one stage holds every layer, the embedding and the loss: the placement options do not apply
_SINGLE_STAGE = {**pipeline_fields(DEFAULT_SPLIT), "pp": 1, "vpp": 1}


def _single_stage(job: _Job, base: dict, mbs: int, knob: dict) -> ParallelConfig | None:
    """The single-stage layout of a steady-state group (None when its larger dp does not divide the global batch)."""
    cfg = ParallelConfig.trusted(base, knob, _SINGLE_STAGE, {"micro_batch_size": mbs})
    if batch_rule(job.training.global_batch_size, mbs, cfg.world_size // (cfg.tp * cfg.cp)) is not None:
        return None
    return cfg


def _steady_state_floor(job: _Job, base: dict, mbs: int, knob: dict) -> float:
    """``job.floor_fn`` of the single-stage layout: a cheap lower bound (seconds) on :func:`_steady_state_bound`,
    0 where that is 0 (not a valid config)."""
    cfg = _single_stage(job, base, mbs, knob)
    if cfg is None:
        return 0.0
    try:
        return job.floor_fn(job.model, job.training, job.cluster, cfg)
    except InvalidConfigError:
        return 0.0


def _steady_state_bound(job: _Job, base: dict, mbs: int, knob: dict) -> float:
    """Lower bound (seconds) on the step time of every config sharing tp, cp, ep, etp, dispatcher and mbs.

    The single-stage layout's step time minus its once-per-step terms (property 4 of the module
    docstring). 0 when the single-stage layout is not a valid config (its larger dp may not divide the
    global batch): then the group is not bounded and its candidates are all timed.
    """
    cfg = _single_stage(job, base, mbs, knob)
    if cfg is None:
        return 0.0
    try:
        t = job.time_fn(job.model, job.training, job.cluster, cfg)
    except InvalidConfigError:
        return 0.0
    # with EP overlap the a2a left exposed depends on the micro-batch count and on the stage's share of the
    # layers (the first forward and last backward of a stage show one micro-batch's a2a): not bounded by the
    # single stage's, so the bound leaves it out
    skip = PER_STEP_TERMS | {"ep_a2a"} if cfg.overlap_moe_expert_parallel_comm else PER_STEP_TERMS
    return max(0.0, t.step_time - sum(v for name, v in t.terms if name in skip))


def _staircase(fits: Callable[[int, int], bool], n_mbs: int, n_rec: int, floors: list[int | None],
               guess: list[int | None] | None = None, expect_all: bool = True) -> list[int | None]:
    """Least fitting recompute level per micro-batch index (None: nothing fits), with few ``fits`` calls.

    ``fits(k, r)`` is monotone: true stays true for a smaller micro-batch index k or a larger recompute
    level r. ``floors[k]`` is a lower bound on the answer, None where nothing fits; the indices that may
    fit form a prefix. ``guess`` (the answer for a similar layout: another dispatcher, one vpp less) and
    ``expect_all`` (whether everything fitted in the previous layout) only order the calls, never decide.
    Everything-fits is settled by the most demanding cell (one call), nothing-fits by the least demanding
    one; otherwise each micro-batch starts at the guessed level (or the lowest possible) and walks,
    with the answer of the previous micro-batch as a lower bound (it can only rise with k).
    """
    result: list[int | None] = [None] * n_mbs
    alive = [k for k in range(n_mbs) if floors[k] is not None]
    if not alive:
        return result
    top = alive[-1]
    if expect_all if guess is None else all(g == f for g, f in zip(guess, floors)):
        if fits(top, floors[top]) and all(floors[k] == floors[top] for k in alive):
            for k in alive:
                result[k] = floors[k]
            return result
    if not fits(0, n_rec - 1):
        return result
    lower = 0
    for k in alive:
        lower = max(lower, floors[k])
        if guess is None:
            r = lower
        else:
            g = guess[k]
            r = n_rec - 1 if g is None else min(max(g, lower), n_rec - 1)
        if fits(k, r):
            while r > lower and fits(k, r - 1):
                r -= 1
        else:
            r += 1
            while r < n_rec and not fits(k, r):
                r += 1
            if r == n_rec:
                break
        result[k] = lower = r
    return result


def _scan_chunk(bounds: tuple[int, int]) -> _Scan:
    assert _JOB is not None
    return _scan(_JOB, range(*bounds))


def _scan_all(job: _Job, workers: int) -> _Scan:
    global _JOB
    n = len(job.layouts)
    if workers <= 1 or n < 2:
        return _scan(job, range(n))
    # Slices are runs of whole (tp, cp) blocks: the layouts of a block share the cost models' cached
    # parts and the steady-state bounds, so no two processes compute the same ones; about three slices
    # per worker even out the unequal blocks.
    starts = [i for i in range(n) if i == 0 or (job.layouts[i].tp, job.layouts[i].cp)
              != (job.layouts[i - 1].tp, job.layouts[i - 1].cp)] + [n]
    target = -(-n // (workers * 3))
    bounds = []
    begin = 0
    for end in starts[1:]:
        if end - begin >= target or end == n:
            bounds.append((begin, end))
            begin = end
    _JOB = job
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_scan_chunk, bounds, chunksize=1)
    finally:
        _JOB = None
    total = _Scan()
    for part in parts:
        total.add(part)
    return total


def _merged(scans: list[_Scan]) -> _Scan:
    """One scan of several jobs' scans: each head's and the closest config's Choice becomes (job index, Choice)."""
    total = _Scan()
    for j, part in enumerate(scans):
        total.add(part, lambda choice, j=j: (j, choice))
    return total


def _default_workers(valid: int) -> int:
    # fork() in a process with other threads (a web server, a job runner) can inherit a held lock and
    # hang the child; such callers get the single-process scan.
    if valid < PARALLEL_THRESHOLD or not hasattr(os, "fork") or threading.active_count() > 1:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


def pareto_front(points: list[tuple[float, float, Any]]) -> list[Any]:
    """Items not dominated in (step time, memory): sorted by time, each using less memory than every faster one."""
    front = []
    best_memory = float("inf")
    for t, m, item in sorted(points, key=lambda p: (p[0], p[1])):
        if m < best_memory:
            front.append(item)
            best_memory = m
    return front


def plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, *, top: int = 10,
         exhaustive: bool = False, space: SearchSpace | None = None, memory_fn: MemoryFn | None = None,
         time_fn: TimeFn | None = None, workers: int | None = None, rank_by: str = "robust",
         megatron: bool = False) -> PlanResult:
    """Enumerate, prune by memory and rank by step time; the ``top`` best fitting configs that foldtune's
    executor runs, best first, then (when fewer than ``top`` run) the best ones only Megatron-Core runs;
    ``megatron``: the ``top`` best, executable or not, with Megatron's own dispatchers searched too
    (:meth:`SearchSpace.with_megatron_dispatchers`: the flex dispatcher on DeepEP / HybridEP). Every ranked
    Estimate says whether the executor runs it (``executable``, ``executable_reason``).

    ``rank_by`` (:data:`RANK_BY`): ``"robust"`` orders by the pessimistic end of each layout's step-time
    interval (``Estimate.rank_time``), ``"point"`` by the point estimate. ``memory_fn`` / ``time_fn`` default
    to the cost model (costmodel.memory / costmodel.step_time); tests inject their own (no intervals: both
    orders are by their step times). The scan needs only total bytes: with the default memory model it uses its
    fast path ``peak_memory_bytes``, with an injected one ``memory_fn(...).total``. ``exhaustive`` times every
    fitting config and fills ``PlanResult.pareto``.
    """
    if rank_by not in RANK_BY:
        raise InvalidConfigError(f"rank_by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    if memory_fn is None:
        memory_fn, memory_total_fn = default_memory_fn(), default_memory_total_fn()
    else:
        def memory_total_fn(model, training, cluster, config, _fn=memory_fn):
            return _fn(model, training, cluster, config).total
    time_fn = time_fn or default_time_fn()
    if megatron:
        space = (space or SearchSpace()).with_megatron_dispatchers()
    # The scan allocates ~10^5 short-lived configs and breakdowns next to a growing list of candidates;
    # the cyclic collector would rescan that list over and over (measured: ~40 % of the planning time).
    # Nothing here makes reference cycles, so it is paused for the duration.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(model, training, cluster, top, exhaustive, space, memory_fn, memory_total_fn, time_fn, workers,
                     rank_by, megatron)
    finally:
        if gc_was_enabled:
            gc.enable()


def plan_precisions(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, *,
                    space: SearchSpace | None = None, **kwargs: Any) -> list[PlanResult]:
    """:func:`plan` once per precision the search space searches (:meth:`SearchSpace.precisions_for`: the
    training spec's alone unless the space opts in; fp8 only where the GPU has an fp8 peak), fastest best
    layout first; ``kwargs`` go to :func:`plan`. A precision with no valid layout is left out; if every
    one has none, the first precision's :class:`NoValidLayoutError` is raised."""
    space = space or SearchSpace()
    results, errors = [], []
    for precision in space.precisions_for(training, cluster.gpu):
        try:
            results.append(plan(model, replace(training, precision=precision), cluster, space=space,
                                **kwargs))
        except NoValidLayoutError as exc:
            errors.append(exc)
    if not results:
        raise errors[0]
    return sorted(results, key=lambda r: rank_key(r.ranked[0], r.rank_by) if r.ranked else float("inf"))


def rank_key(estimate: Estimate, rank_by: str = "robust") -> float:
    """The seconds ``estimate`` ranks by under ``rank_by`` (:data:`RANK_BY`)."""
    return estimate.rank_time if rank_by == "robust" else estimate.time.step_time


def _plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, top: int, exhaustive: bool,
          space: SearchSpace | None, memory_fn: MemoryFn, memory_total_fn: MemoryTotalFn, time_fn: TimeFn,
          workers: int | None, rank_by: str = "robust", megatron: bool = False) -> PlanResult:
    t0 = _time.perf_counter()
    enum = enumerate_layouts(model, training, cluster, space)
    t1 = _time.perf_counter()
    valid = enum.valid
    if not valid:
        ranked = sorted(enum.rejected.items(), key=lambda kv: -kv[1])
        why = "; ".join(f"{rule} {count:,} (e.g. {enum.examples[rule].reason})" for rule, count in ranked)
        raise NoValidLayoutError(f"no valid layout of {model.name} on {cluster.num_gpus} GPUs for seq "
                                 f"{training.seq_length}, global batch {training.global_batch_size}: all "
                                 f"{enum.considered:,} configs break a rule: {why}")
    # one scan per knob option (its staircases assume the optimizer and recompute options ordered by memory
    # and time, which offloading or narrower optimizer state, less memory for more time, would break): their
    # heads are merged below
    jobs, scans = [], []
    n_workers = workers if workers is not None else _default_workers(valid)
    sweep = LayoutMemory if memory_total_fn is peak_memory_bytes else None
    floor_fn = steady_state_floor if time_fn is step_time else None  # valid for the default time model only
    # intervals exist for the default time model only
    robust_fn = pessimistic_step_time if time_fn is step_time and rank_by == "robust" else None
    refusal = partial(executor_refusal, model, training)
    # a model the executor cannot build leaves no layout to put first: rank by rank time alone
    ranking_refusal = None if megatron or executor_model_rule(model) is not None else refusal
    for option in enum.offload:
        distopts, chain = enum.knobs_for(option)
        if not distopts or not chain:
            continue
        jobs.append(_Job(model, training, cluster, enum.layouts, chain, distopts, memory_fn, memory_total_fn,
                         time_fn, exhaustive, top, enum.pipeline, option, sweep, floor_fn=floor_fn,
                         robust_fn=robust_fn, refusal=ranking_refusal))
        scans.append(_scan_all(jobs[-1], n_workers))
    if not any(part.fitting for part in scans):
        # nothing fits: the closest config must be the one the full scans offer, pruned layouts included
        for j, part in enumerate(scans):
            if part.pruned_static:
                rescan = _scan_all(replace(jobs[j], prune_static=False), n_workers)
                rescan.memory_calls += part.memory_calls
                scans[j] = rescan
    scan = _merged(scans)
    makers = [ConfigMaker(cluster.num_gpus, enum.pipeline, j.offload) for j in jobs]
    result = PlanResult(model=model, training=training, cluster=cluster, enumeration=enum, fitting=scan.fitting,
                        ranked=[], memory_calls=scan.memory_calls, time_calls=scan.time_calls + scan.bound_calls,
                        bound_calls=scan.bound_calls, order_violations=scan.order_violations,
                        bound_violations=scan.bound_violations, exhaustive=exhaustive,
                        enumerate_seconds=t1 - t0, workers=n_workers, rank_by=rank_by,
                        robust_exact=not scan.robust_cut, megatron=megatron,
                        robust_shortlist=robust_shortlist(top) if robust_fn is not None else 0)
    intervals = time_fn is step_time  # the default cost model's breakdowns: their intervals too

    def estimate_of(tagged: tuple[int, Choice]) -> Estimate:
        j, choice = tagged
        cfg = jobs[j].config(makers[j], choice)
        return judged(combine(cfg, training, cluster, memory_fn(model, training, cluster, cfg),
                              time_fn(model, training, cluster, cfg), model if intervals else None), refusal(cfg))

    if exhaustive:
        heads = sorted(scan.heads, key=_Ranked.rank_key)
        result.ranked = [estimate_of(h.choice) for h in heads[:top]]
        front = pareto_front([(h.rank, h.memory, h) for h in heads])
        result.pareto = [estimate_of(h.choice) for h in front]
    else:  # the slices' top Ns
        heads = scan.heads
        if robust_fn is not None:
            heads, cut = _robust_walk(heads, top, scan.robust_cut)
            result.robust_exact = not cut
        best = sorted(heads, key=_Ranked.rank_key)[:top]
        result.ranked = [estimate_of(h.choice) for h in best]
    if not result.ranked and scan.closest is not None:
        result.closest = estimate_of(scan.closest.choice)
    result.rank_seconds = _time.perf_counter() - t1
    return result


def judged(estimate: Estimate, refusal: str | None) -> Estimate:
    """``estimate`` labelled with whether foldtune's executor runs its layout (``refusal``: why not, from
    ``spec.validity.executor_refusal``; None: it runs)."""
    return replace(estimate, executable=refusal is None, executable_reason=refusal)


def _best_first(job: _Job, maker: ConfigMaker, heads: list[_Head], top: int, out: _Scan,
                bounds: dict[BoundKey, float]) -> list[_Ranked]:
    """The ``top`` fastest of ``heads`` and their siblings, timing a candidate only when its key is smallest.

    With ``job.floor_fn`` a head's ``bound`` is the bound's floor, and the bound (``bounds``, by
    :meth:`Layout.bound_key`) is computed when the head is first popped. Returns the picked configs, fastest
    first; counts time calls, bound calls and breaches of the monotone properties in ``out``.

    With ``job.refusal`` the ``top`` best executable ones: the queue runs on past configs the executor does not
    run, of which it keeps the best ``top`` by rank time (each marked so), after the executable ones.

    With ``job.robust_fn`` each picked candidate also gets its rank time (its interval's pessimistic end, never
    below its step time), and the queue keeps popping past the ``top``-th pick while its smallest key (a lower
    bound on every remaining step time, so on their rank times) is below the ``top``-th smallest rank time
    picked: the ``top`` best by rank time are then exactly those of the whole slice, returned best first. It
    picks at most ``robust_shortlist(top)`` (``out.robust_cut`` says it stopped there).
    """
    n_rec = len(job.recompute)
    lazy = job.floor_fn is not None
    knob = ConfigMaker.knobs(job.distopts[0], *job.recompute[0])  # the first option's, as _scan's bounds
    # a head enters as (bound or floor, its index): 10^5 of them, small. A popped floor comes back as (bound,
    # its index, None): it sorts where the head would have sorted by its bound from the start (floor <= bound, and
    # the index breaks ties before the third field), so the queue pops bounded heads and timed candidates in the
    # same order, and times the same candidates, as if every bound had been computed up front. Every later entry
    # is (key, tiebreak, timed, Choice, r_mins, is_family_head, its breakdown or None, executable), key = bound or
    # time, tiebreaks after every index
    heap: list[tuple] = [(h.bound, i) for i, h in enumerate(heads)]
    heapq.heapify(heap)
    counter = len(heap)
    picked: list[_Ranked] = []
    others: list[_Ranked] = []  # configs the executor does not run (with job.refusal only)
    last = float("-inf")
    robust_fn = job.robust_fn
    worst_kept: list[float] = []  # max-heap (negated) of the ``top`` smallest rank times picked
    cap = robust_shortlist(top)
    while heap and (len(picked) < top or (robust_fn is not None and heap[0][0] < -worst_kept[0])):
        if len(picked) >= cap:
            out.robust_cut = True
            break
        entry = heapq.heappop(heap)
        if len(entry) <= 3:
            key, i = entry[0], entry[1]
            h = heads[i]
            idx, k, dispatcher = h.idx, h.k, h.dispatcher
            if lazy and len(entry) == 2:  # a floor: the group's bound replaces it
                lay = job.layouts[idx]
                mbs = lay.micro_batch_sizes[k]
                gkey = lay.bound_key(dispatcher, mbs)
                lb = bounds.get(gkey)
                if lb is None:
                    lb = bounds[gkey] = _steady_state_bound(job, maker.base(lay, dispatcher), mbs, knob)
                    out.bound_calls += 1
                if lb < key:  # the floor was no lower bound: the order may differ from the bounds' own
                    out.bound_violations += 1
                heapq.heappush(heap, (lb, i, None))
                continue
            r_mins = tuple([rm[k] for rm in h.r_mins])
            timed, choice, head = False, Choice(idx, job.layouts[idx].micro_batch_sizes[k], dispatcher, 0, h.r0), True
            breakdown, executable = None, True
        else:
            key, _, timed, choice, r_mins, head, breakdown, executable = entry
        if not timed:
            cfg = job.config(maker, choice)
            breakdown = job.time_fn(job.model, job.training, job.cluster, cfg)
            t = breakdown.step_time
            out.time_calls += 1
            if t < key * (1 - 1e-9):
                out.bound_violations += 1
            counter += 1
            heapq.heappush(heap, (t, counter, True, choice, r_mins, head, breakdown if robust_fn else None,
                                  job.executable(cfg)))
            continue
        if key < last:
            out.order_violations += 1
        last = max(last, key)
        robust = None
        if robust_fn is not None:  # the rank time, for the few picked only
            robust = max(key, robust_fn(job.model, job.training, job.cluster, job.config(maker, choice), breakdown))
        if not executable:
            others.append(_Ranked(key, choice, None, robust, False))
        else:
            picked.append(_Ranked(key, choice, None, robust))
        if robust is not None and executable:
            if len(worst_kept) < top:
                heapq.heappush(worst_kept, -robust)
            elif robust < -worst_kept[0]:
                heapq.heapreplace(worst_kept, -robust)
        # slower siblings: bounded by this config's time until they are popped
        o, r = choice.o, choice.r
        siblings = [(o, r + 1)] if r + 1 < min(n_rec, recompute_count(job.recompute, choice.dispatcher)) else []
        if head:
            siblings += [(o2, r_mins[o2]) for o2 in range(o + 1, len(r_mins)) if r_mins[o2] is not None]
        for o2, r2 in siblings:
            counter += 1
            heapq.heappush(heap, (key, counter, False, choice._replace(o=o2, r=r2), r_mins, False, None, True))
    if robust_fn is not None:  # all of them: the merge of the slices applies the shortlist (_robust_walk)
        return picked + others
    picked.sort(key=lambda p: p.rank)
    others.sort(key=lambda p: p.rank)
    return picked[:top] + others[:top]


def _robust_walk(heads: list[_Ranked], top: int, slice_cut: bool) -> tuple[list[_Ranked], bool]:
    """The picks one queue over all slices and knob options would have made, from the union of theirs: fastest
    by step time first, stopping once ``top`` executable ones are picked and the next step time is no less than
    the ``top``-th best rank time so far (none later can rank better), or at the shortlist cap. Each slice's own
    queue stops no earlier (its picks are a subset of these, so its ``top``-th best rank time is no better), so
    the union holds every pick of the one queue: the answer does not depend on how the scan was split over
    processes. Returns the picks and whether the cap cut the walk (``slice_cut``, whether a slice's queue reached
    it, where the walk runs out of picks first)."""
    cap = robust_shortlist(top)
    kept: list[_Ranked] = []
    worst: list[float] = []  # max-heap (negated) of the ``top`` smallest rank times among the executable picks
    n = 0
    for h in sorted(heads, key=lambda h: h.step_time):
        if n >= top and h.step_time >= -worst[0]:
            return kept, False
        if n >= cap:
            return kept, True
        kept.append(h)
        if h.executable:
            n += 1
            if len(worst) < top:
                heapq.heappush(worst, -h.rank)
            elif h.rank < -worst[0]:
                heapq.heapreplace(worst, -h.rank)
    return kept, slice_cut


@dataclass
class LayoutVerdict:
    """One layout judged on its own (``foldtune plan --explain``): its rule violations and, if valid, its estimate."""

    text: str
    config: ParallelConfig | None  # None when the sizes do not even divide the world
    rejections: list[Rejection]
    estimate: Estimate | None  # only for a valid layout

    @property
    def valid(self) -> bool:
        return not self.rejections


def _read_layout(text: str, validator: Validator) -> tuple[ParallelConfig | None, list[Rejection]]:
    """The layout ``text`` names on the validator's cluster (the codec, ``spec.layout_codec``, reads it), or
    (None, the rules its sizes break) when they do not divide the world: a verdict, not an error. A string
    the codec cannot read raises InvalidConfigError. Without a ``distopt=`` token the distributed optimizer
    follows the training spec (None: on)."""
    world = validator.cluster.num_gpus
    tokens = ParallelConfig.read_label(text)  # raises for a token it cannot read
    sizes = tokens.sizes
    tp, cp, pp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1)
    ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    found = []
    if min(tp, cp, pp, ep, etp) >= 1:  # below 1 the constructor names the size
        found = [r for r in (world_dense(world, tp, cp, pp), world_expert(world, ep, etp, pp)) if r]
    if found:  # no config exists for these sizes: dp and edp would not be whole
        found += [r for r in (validator.global_(), validator.tp(tp), validator.cp(cp),
                              validator.pp(pp, sizes.get("vpp", 1), DEFAULT_SPLIT), validator.ep(ep),
                              validator.etp(etp)) if r is not None]
        return None, found
    config = ParallelConfig.parse(text, world_size=world)
    if "use_distributed_optimizer" not in tokens.fields:
        distopt = validator.training.distributed_optimizer
        distopt = True if distopt is None else distopt
        config = config.replace(use_distributed_optimizer=distopt, overlap_param_gather=distopt)
    return config, []


def explain_layout(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, text: str, *,
                   memory_fn: MemoryFn | None = None, time_fn: TimeFn | None = None) -> LayoutVerdict:
    """Parse ``text`` (e.g. "tp2 pp4 ep8 mbs1") for this cluster, check every rule, estimate it when valid."""
    config, rejections = _read_layout(text, Validator(model, training, cluster))
    if config is None:
        return LayoutVerdict(text, None, rejections, None)
    rejections = check_config(model, training, cluster, config)
    if rejections:
        return LayoutVerdict(text, config, rejections, None)
    intervals = time_fn is None  # the default cost model: its intervals too
    memory_fn = memory_fn or default_memory_fn()
    time_fn = time_fn or default_time_fn()
    est = combine(config, training, cluster, memory_fn(model, training, cluster, config),
                  time_fn(model, training, cluster, config), model if intervals else None)
    return LayoutVerdict(text, config, [], judged(est, executor_refusal(model, training, config)))


def smallest_fitting_cluster(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, *,
                             max_gpus: int = 16384, space: SearchSpace | None = None,
                             workers: int | None = 1) -> tuple[int, Estimate] | None:
    """The smallest power-of-two multiple of ``cluster.num_gpus`` (same hardware, same training) up to ``max_gpus``
    on which some layout fits in memory, with its fastest layout; None when none up to ``max_gpus`` does.

    What "no layout fits" tells the user: how many GPUs of this kind would hold the model at this sequence
    length and global batch (more GPUs shard weights and optimizer state further, down to the batch's limit
    on data parallelism)."""
    n = cluster.num_gpus * 2
    while n <= max_gpus:
        try:
            bigger = replace(cluster, num_gpus=n)
        except SpecError:  # not whole nodes; doubling a whole-node count stays whole nodes
            n *= 2
            continue
        try:
            found = plan(model, training, bigger, top=1, space=space, workers=workers)
        except NoValidLayoutError:  # e.g. more data-parallel ranks than the global batch has sequences
            return None
        if found.best is not None:
            return n, found.best
        n *= 2
    return None
