"""Plan a vision-language MoE model: the LLM's folded layout, the encoder's own layout and its placement,
searched jointly, ranked by predicted step time.

For each placement the LLM's GPUs are known (all of them, or what a separate encoder leaves: whole nodes,
up to half the cluster), so the LLM planner (:func:`planner.rank.plan`) proposes its best ``llm_top`` layouts
there; each is then combined with every encoder layout the rule book accepts (encoder tp a divisor of the
vision heads within a node, cp 1, pp 1, dp the rest of its GPUs; homogeneous: the LLM's) and priced by
:mod:`costmodel.multimodal`. Layouts that break a rule are counted by rule, as the LLM planner does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from costmodel.multimodal import MultimodalEstimate, estimate_multimodal
from planner.enumerate import divisors
from planner.rank import NoValidLayoutError, plan
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import Rejection, check_multimodal, executor_multimodal_rules, is_executor_rule


@dataclass
class MultimodalPlan:
    """``ranked``: fitting layouts, fastest first; ``best_homogeneous`` / ``best_heterogeneous``: the fastest
    of each kind (None when none fits); ``rejected``: rule id -> layouts refused; ``why``: one line saying
    whether heterogeneity wins and which term decides it."""

    ranked: list[MultimodalEstimate]
    best_homogeneous: MultimodalEstimate | None
    best_heterogeneous: MultimodalEstimate | None
    rejected: Counter = field(default_factory=Counter)
    priced: int = 0
    not_fitting: int = 0
    why: str = ""


def _encoder_tps(vl: VisionLanguageSpec, cluster: ClusterSpec) -> list[int]:
    heads = vl.vision.num_attention_heads
    return [t for t in divisors(heads) if t <= cluster.hardware.gpus_per_node]


def _separate_gpus(cluster: ClusterSpec) -> list[int]:
    """GPU counts a separate encoder may take: whole nodes (or, on one node, halves down to one GPU), at most
    half the cluster."""
    per_node = cluster.hardware.gpus_per_node
    if cluster.num_gpus <= per_node:
        return [n for n in divisors(cluster.num_gpus) if n <= cluster.num_gpus // 2]
    return [n * per_node for n in range(1, cluster.num_gpus // per_node // 2 + 1)]


def _llm_layouts(vl: VisionLanguageSpec, training: TrainingSpec, cluster: ClusterSpec, top: int,
                 missing: list[NoValidLayoutError]) -> list[tuple[ParallelConfig, object]]:
    """The LLM planner's ``top`` fitting layouts on ``cluster``; none, its error kept in ``missing``, when no
    layout is valid there (another GPU share may still have some: 3 GPUs hold no LLM layout of a batch of 4,
    2 of them beside a separate encoder do)."""
    try:
        result = plan(vl.llm, training, cluster, top=top, rank_by="point", workers=1)
    except NoValidLayoutError as exc:
        missing.append(exc)
        return []
    return [(e.config, e) for e in result.ranked if e.fits]


def llm_cluster(layout: MultimodalLayout, cluster: ClusterSpec) -> ClusterSpec:
    """The GPUs the LLM of ``layout`` runs on: the cluster's, less a separate encoder's (its share after them)."""
    if layout.placement != "separate":
        return cluster
    return ClusterSpec(cluster.hardware, layout.llm.world_size, cluster.hbm_reserved_bytes, cluster.min_headroom)


def plan_multimodal(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs, cluster: ClusterSpec, *,
                    top: int = 10, llm_top: int = 4, placements: tuple[str, ...] = ("homogeneous", "colocated",
                                                                                       "separate")) -> MultimodalPlan:
    """The ``top`` fastest fitting multimodal layouts of ``vl`` on ``cluster`` (see the module docstring)."""
    images.check_fits(vl.vision, training.seq_length)
    out = MultimodalPlan([], None, None)
    candidates: list[tuple[MultimodalLayout, object, ClusterSpec]] = []
    missing: list[NoValidLayoutError] = []
    full = _llm_layouts(vl, training, cluster, llm_top, missing) if {"homogeneous", "colocated"} & set(placements) \
        else []
    for config, estimate in full:
        if "homogeneous" in placements:
            candidates.append((MultimodalLayout.homogeneous(config), estimate, cluster))
        if "colocated" in placements:
            for tp in _encoder_tps(vl, cluster):
                if config.world_size % tp == 0:
                    layout = MultimodalLayout(config, "colocated", encoder_tp=tp, encoder_dp=config.world_size // tp)
                    candidates.append((layout, estimate, cluster))
    if "separate" in placements:
        for gpus in _separate_gpus(cluster):
            try:
                llm_cluster = ClusterSpec(cluster.hardware, cluster.num_gpus - gpus, cluster.hbm_reserved_bytes,
                                          cluster.min_headroom)
            except ValueError:  # an LLM share that is no whole number of nodes
                continue
            for config, estimate in _llm_layouts(vl, training, llm_cluster, llm_top, missing):
                for tp in _encoder_tps(vl, cluster):
                    if gpus % tp == 0:
                        layout = MultimodalLayout(config, "separate", encoder_tp=tp, encoder_dp=gpus // tp)
                        candidates.append((layout, estimate, llm_cluster))
    if not candidates and missing:  # no GPU share holds an LLM layout: the whole cluster's reason
        raise missing[0]
    priced: list[MultimodalEstimate] = []
    for layout, llm_estimate, llm_cluster in candidates:
        rejections = [r for r in check_multimodal(vl, training, images, layout, cluster)
                      if not r.rule.startswith("executor_")]  # the plan is for Megatron, as the LLM planner's
        if rejections:
            out.rejected.update(r.rule for r in rejections)
            continue
        priced.append(estimate_multimodal(vl, training, images, layout, cluster, llm_estimate, llm_cluster))
    out.priced = len(priced)
    fitting = sorted((e for e in priced if e.fits), key=lambda e: e.step_time)
    out.not_fitting = len(priced) - len(fitting)
    out.best_homogeneous = next((e for e in fitting if not e.layout.is_heterogeneous), None)
    out.best_heterogeneous = next((e for e in fitting if e.layout.is_heterogeneous), None)
    # the top list always shows the best of each kind, so the comparison is in it
    ranked = fitting[:top]
    for best in (out.best_homogeneous, out.best_heterogeneous):
        if best is not None and best not in ranked:
            ranked.append(best)
    out.ranked = sorted(ranked, key=lambda e: e.step_time)
    out.why = why(out.best_homogeneous, out.best_heterogeneous)
    return out


def why(homogeneous: MultimodalEstimate | None, heterogeneous: MultimodalEstimate | None) -> str:
    """One line: whether the best heterogeneous layout beats the best homogeneous one, by how much, and the
    term whose difference decides it."""
    if homogeneous is None or heterogeneous is None:
        return "only " + ("heterogeneous" if homogeneous is None else "homogeneous") + " layouts fit"
    gain = homogeneous.step_time / heterogeneous.step_time - 1.0
    a, b = dict(homogeneous.terms), dict(heterogeneous.terms)
    deltas = {name: a.get(name, 0.0) - b.get(name, 0.0) for name in set(a) | set(b)}
    term = max(deltas, key=lambda n: abs(deltas[n]))
    winner = "heterogeneous" if gain > 0 else "homogeneous"
    return (f"{winner} wins: the best heterogeneous layout ({heterogeneous.layout.placement}) is "
            f"{gain * 100:+.1f} % in step throughput against the best homogeneous one; the largest difference is "
            f"the '{term}' term ({deltas[term]:+.3f} s: homogeneous {a.get(term, 0.0):.3f} s, heterogeneous "
            f"{b.get(term, 0.0):.3f} s)")


@dataclass
class RunnableMultimodal:
    """The fitting multimodal layouts the executor runs (fastest first, at most ``keep``), how many the planner
    ranked, and, when none is left, the rule that removed the best one (else None)."""

    runnable: list[MultimodalEstimate]
    planned: int
    not_executable: Counter = field(default_factory=Counter)
    rejection: Rejection | None = None


def runnable_multimodal(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs, cluster: ClusterSpec,
                        keep: int) -> RunnableMultimodal:
    """What a tuning job of ``vl`` searches: :func:`plan_multimodal`'s fitting layouts (every one of them) less
    those that break an executor rule (the LLM part's or :func:`spec.validity.executor_multimodal_rules`)."""
    result = plan_multimodal(vl, training, images, cluster, top=1 << 20)
    out = RunnableMultimodal([], len(result.ranked))
    first: Rejection | None = None
    for estimate in result.ranked:
        layout = estimate.layout
        refused = [r for r in check_multimodal(vl, training, images, layout, cluster) if is_executor_rule(r.rule)]
        refused += executor_multimodal_rules(layout, vl)
        if refused:
            out.not_executable.update(r.rule for r in refused)
            first = first or refused[0]
        elif len(out.runnable) < keep:
            out.runnable.append(estimate)
    if not out.runnable:
        out.rejection = first or Rejection("layout_fits", f"no multimodal layout of {vl.name} fits "
                                                          f"{cluster.num_gpus} {cluster.hardware.name} GPUs "
                                                          f"({out.planned} planned; rules broken: "
                                                          f"{dict(result.rejected) or 'none'})")
    return out
