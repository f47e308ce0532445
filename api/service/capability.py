"""The one capability check at the front door: can the executor run this model (or proxy) at all, and, for
a tuning job, is there a layout of the requested cluster that is valid, predicted to fit and runnable by
the executor; for a training, does its layout pass Megatron's rules and the executor's.

The rules are the rule book's (``spec.validity.check``: the same the planner, the runner and the executor
apply); a refusal is a RuleViolation naming the rule, which the HTTP layer answers as a 422 problem and the CLI
as one line.
"""

from __future__ import annotations

from dataclasses import replace

from planner.runnable import MIN_PLANNED, job_top, runnable_plan, tuned_precisions
from api.service.errors import RuleViolation
from spec.errors import FoldtuneError
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.proxy import ProxyError, proxy_model
from spec.training_spec import TrainingSpec
from spec.validity import check, executor_model_rule

# where each refusal points in a request body
_LOC = {"executor_model": "body.model", "has_valid_layout": "body", "layout_fits": "body.cluster",
        "executor_layout": "body.cluster"}


def apply_proxy(model: ModelSpec, num_layers: int | None, proxy: str | None) -> ModelSpec:
    """The model a request runs (:func:`spec.proxy.proxy_model`); RuleViolation ``proxy_layers`` /
    ``proxy_kind`` when the proxy asked for is out of bounds."""
    try:
        return proxy_model(model, num_layers, proxy)
    except ProxyError as exc:
        loc = "body.num_layers_override" if exc.rule == "proxy_layers" else "body.proxy"
        raise RuleViolation(loc, exc.rule, str(exc)) from None


def check_model_runnable(model: ModelSpec, loc: str = "body.model") -> None:
    """RuleViolation ``executor_model`` naming every feature of ``model`` the executor does not build."""
    rejection = executor_model_rule(model)
    if rejection is not None:
        raise RuleViolation(loc, rejection.rule, rejection.reason)


def check_job_runnable(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, max_trials: int,
                       search_precision: bool = False) -> None:
    """RuleViolation unless the runner would find a layout to search: the model rule, then the planner's
    valid, fitting layouts filtered by the executor's layout rules (the runner's own call, so both agree).
    With ``search_precision`` a layout of any precision the job searches will do (the first that has one).

    Bounded time: the planner's ``MIN_PLANNED`` fastest layouts are a prefix of the runner's ``job_top``
    (seconds at most on a thousand-GPU cluster, one process, as POST /v1/plans); only when none of them runs
    is the runner's whole list ranked, which for a large budget on a large cluster takes tens of seconds."""
    precisions = tuned_precisions(training, cluster.gpu)[0] if search_precision else (training.precision,)
    first = None
    for precision in precisions:
        at = replace(training, precision=precision)
        # whether any layout runs does not depend on the order: the point estimate ranks ~6x faster than the
        # robust order (which times the candidates' intervals too), and the front door answers every submission
        result = runnable_plan(model, at, cluster, MIN_PLANNED, keep=1, rank_by="point")
        if result.rejection is not None and result.rejection.rule == "executor_layout" and \
                job_top(max_trials) > MIN_PLANNED:
            result = runnable_plan(model, at, cluster, job_top(max_trials), keep=1, rank_by="point")
        if result.rejection is None:
            return
        first = first or result.rejection
    raise RuleViolation(_LOC.get(first.rule, "body"), first.rule, first.reason)


def check_training_layout(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec | None,
                          config: ParallelConfig, loc: str = "body.layout") -> None:
    """RuleViolation naming the first broken rule (all of them in the message) when ``config`` breaks a rule
    of the rule book (:func:`spec.validity.check`: Megatron's, the config's own, the executor's) for ``model``
    trained as ``training`` on ``cluster`` (None: the layout's own world, the GPU not judged)."""
    try:
        rejections = check(model, training, config, cluster)
    except FoldtuneError as exc:
        raise RuleViolation(loc, "layout_valid", str(exc)) from None
    if rejections:
        raise RuleViolation(loc, rejections[0].rule, "; ".join(str(r) for r in rejections))


def check_layout_runnable(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, loc: str) -> None:
    """RuleViolation naming the executor's model rule, or the first rule of the rule book (all in the
    message), that ``config`` breaks for ``model`` trained as ``training`` (a local run, a job's best)."""
    check_model_runnable(model, loc)
    check_training_layout(model, training, None, config, loc)
