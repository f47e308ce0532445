"""foldtune planner: enumerate every valid folded layout, prune by predicted memory, rank by predicted time.

Public API::

    from planner import plan, explain_layout, enumerate_layouts, megatron_args
    result = plan(model, training, cluster, top=10)        # PlanResult: counts, ranked Estimates, timings
    verdict = explain_layout(model, training, cluster, "tp2 pp4 ep8 mbs1")

``planner.search`` (the Optuna study) and ``planner.calibration`` are imported on their own; this package
import stays free of Optuna. The validity rules the enumeration applies are ``spec.validity``'s.
"""

from planner.enumerate import Enumeration, Layout, SearchSpace, enumerate_layouts
from planner.megatron_args import format_megatron_args, megatron_args, pipeline_layout
from planner.rank import (LayoutVerdict, NoValidLayoutError, PlanResult, explain_layout, pareto_front, plan,
                          plan_precisions)

__all__ = [
    "Enumeration", "Layout", "SearchSpace", "enumerate_layouts",
    "format_megatron_args", "megatron_args", "pipeline_layout",
    "LayoutVerdict", "NoValidLayoutError", "PlanResult", "explain_layout", "pareto_front", "plan",
    "plan_precisions",
]
