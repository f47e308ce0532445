"""The layouts a tuning job searches: the cost model's ranked fitting layouts that the executor can run.

Why a cap of ``CANDIDATES_PER_TRIAL`` × max_trials: the sampler starts from the model's best predictions
and then moves by per-term-group calibration multipliers fitted on at most max_trials measurements. A
layout ranked far below the top few × budget would need its dominant term group mispredicted several
times more than every measured layout's, which the calibration (ridge towards 1, capped multipliers)
would not learn from so few points anyway; meanwhile every candidate costs the sampler work at each
ask. The planner is asked for more than the cap (``planner.runnable.job_top``) because some ranked layouts use
features the executor does not build yet (context or pipeline parallelism) and are dropped here, each
with its reason counted.

A job that searches precision (``search_precision``; :func:`planner.runnable.tuned_precisions`) is planned once per precision it
measures, each with its own cap, and the candidates of all of them are handed to one search, which orders
them by the high end of their step-time intervals together; each candidate carries its precision and interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from costmodel.estimate import Estimate
from costmodel.estimate import estimate as price_layout
from costmodel.multimodal import MultimodalEstimate
from planner.multimodal import runnable_multimodal
from planner.runnable import job_top, runnable_plan, tuned_precisions
from planner.search import Candidate
from spec.hardware import ClusterSpec
from spec.layout_codec import Labelled
from spec.model_spec import ModelSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.training_spec import TrainingSpec
from spec.validity import Rejection

CANDIDATES_PER_TRIAL = 4


@dataclass
class CandidateSet:
    """Candidates for the search, the estimates behind them (by layout and precision) and what was dropped."""

    candidates: list[Candidate]
    estimates: dict[Labelled, Estimate]  # by Candidate.labelled (the layout, with its precision when searched)
    planned: int  # ranked fitting layouts the planner returned
    valid: int  # valid layouts of the enumeration
    fitting: int  # of which predicted to fit in memory
    not_executable: dict[str, int] = field(default_factory=dict)  # reason -> count
    rejection: Rejection | None = None  # why there is no candidate (None when there are some)
    precisions: tuple[str, ...] = ()  # the precisions searched; empty: the job's own alone (no search)
    precision_note: str | None = None  # what the precision search left out and why

    def summary(self) -> dict[str, Any]:
        out = {"valid": self.valid, "fitting": self.fitting, "planned": self.planned,
               "searched": len(self.candidates), "not_executable": self.not_executable}
        if self.precisions:
            out["precisions"] = list(self.precisions)
            out["precision_note"] = self.precision_note
        return out


def predicted_dict(estimate: Estimate) -> dict[str, Any]:
    """The cost model's breakdown of one layout as stored with its trial (seconds, bytes)."""
    m = estimate.memory
    return {"step_time_s": estimate.time.step_time, "terms_s": dict(estimate.time.terms),
            "hidden_s": dict(estimate.time.hidden), "bottleneck": estimate.time.bottleneck,
            "mfu": estimate.time.mfu, "tokens_per_s_per_gpu": estimate.time.tokens_per_s_per_gpu,
            "memory_bytes": m.total,
            "memory": {"weights": m.weights, "grads": m.grads, "optimizer": m.optimizer,
                       "activations": m.activations, "logits": m.logits, "comm_buffers": m.comm_buffers,
                       "allocator_overhead": m.allocator_overhead},
            "limiter": estimate.limiter, "explanation": estimate.explanation}


def _candidate(estimate: Estimate, precision: str | None = None) -> Candidate:
    """The search's view of one estimated layout (seconds per step, exposed seconds per term, bytes)."""
    interval = estimate.interval.step_time if estimate.interval is not None else None
    return Candidate(config=estimate.config, predicted_step_time=estimate.time.step_time,
                     predicted_terms=tuple(estimate.time.terms), predicted_memory_bytes=estimate.memory.total,
                     precision=precision, predicted_low=interval.low if interval else None,
                     predicted_high=interval.high if interval else None)


def job_candidates(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, max_trials: int,
                   search_precision: bool = False) -> CandidateSet:
    """Plan, drop what the executor cannot run, keep the fastest ``CANDIDATES_PER_TRIAL`` × max_trials.
    No candidate: ``rejection`` names the rule (the front door's check, :func:`planner.runnable.runnable_plan`).
    With ``search_precision`` each of :func:`planner.runnable.tuned_precisions` is planned and capped so, and the candidates
    carry their precision (best first by their intervals' pessimistic ends, whatever the precision); the counts add up
    over them."""
    if not search_precision:
        result = runnable_plan(model, training, cluster, job_top(max_trials), keep=CANDIDATES_PER_TRIAL * max_trials,
                               workers=None)
        return CandidateSet([_candidate(e) for e in result.runnable], {Labelled(e.config): e for e in result.runnable},
                            result.planned, result.valid, result.fitting, result.not_executable, result.rejection)
    precisions, note = tuned_precisions(training, cluster.gpu)
    out = CandidateSet([], {}, 0, 0, 0, precisions=precisions, precision_note=note)
    rejections = []
    for precision in precisions:
        result = runnable_plan(model, replace(training, precision=precision), cluster, job_top(max_trials),
                               keep=CANDIDATES_PER_TRIAL * max_trials, workers=None)
        for e in result.runnable:
            cand = _candidate(e, precision)
            out.candidates.append(cand)
            out.estimates[cand.labelled] = e
        out.planned += result.planned
        out.valid += result.valid
        out.fitting += result.fitting
        for reason, n in result.not_executable.items():
            out.not_executable[reason] = out.not_executable.get(reason, 0) + n
        if result.rejection is not None:
            rejections.append(result.rejection)
    out.candidates.sort(key=lambda c: c.rank_time)
    if not out.candidates:
        out.rejection = rejections[0]
    return out


def repricer(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, cands: CandidateSet):
    """The search's ``repredict``: the same candidates priced with a measured per-expert routing load
    (``TrainingSpec.moe_expert_load``: the busiest EP rank paces EP layouts), each at its own precision.
    Updates ``cands.estimates`` so the trials that follow store the re-priced prediction."""
    def reprice(load: tuple[float, ...], current: list[Candidate]) -> list[Candidate]:
        measured = replace(training, moe_expert_load=tuple(load))
        out = []
        for c in current:
            at = measured if c.precision is None else replace(measured, precision=c.precision)
            e = price_layout(model, at, cluster, c.config)
            priced = _candidate(e, c.precision)
            cands.estimates[priced.labelled] = e
            out.append(priced)
        return out
    return reprice


def stored_prediction(estimate: Estimate | MultimodalEstimate) -> dict[str, Any]:
    """A layout's prediction as stored with its trial: :func:`predicted_dict`, or for a multimodal layout the
    planner's view (placement, LLM and encoder layouts, per-term seconds and reasons, bytes)."""
    if isinstance(estimate, MultimodalEstimate):
        return estimate.to_dict()
    return predicted_dict(estimate)


def multimodal_job_candidates(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs,
                              cluster: ClusterSpec, max_trials: int) -> CandidateSet:
    """A vision-language job's candidates: the fastest ``CANDIDATES_PER_TRIAL`` × max_trials multimodal layouts
    (homogeneous and heterogeneous together) the executor runs (:func:`planner.multimodal.runnable_multimodal`);
    ``estimates`` holds each one's :class:`MultimodalEstimate`."""
    result = runnable_multimodal(vl, training, images, cluster, keep=CANDIDATES_PER_TRIAL * max_trials)
    cands = [Candidate(config=e.layout, predicted_step_time=e.step_time, predicted_terms=e.calibration_terms(),
                       predicted_memory_bytes=e.memory_bytes) for e in result.runnable]
    return CandidateSet(cands, {Labelled(e.layout): e for e in result.runnable}, result.planned, result.planned,
                        result.planned, dict(result.not_executable), result.rejection)
