"""The term table: every exposed time term of a step, and what each one means to the rest of the project.

One row per term of :class:`costmodel.step_time.StepTimeBreakdown`, in the order of its ``terms``. Every
other list of terms is derived from this table: the step-time term names and their indices, the layer
vectors' slots, the terms overlap can hide, the bottleneck labels and the terms they sum, the calibration's
term groups and the terms a component factor may scale. Adding a term is one row here plus the code in
``costmodel/step_time.py`` that computes it; a term name the table does not hold is an error wherever a
name is looked up (:func:`term_index`, :func:`calibration_group`).

Columns:

* ``scope``: ``"layer"`` terms are priced per micro-batch for each layer kind (one slot of the layer
  vectors in ``step_time``); ``"stage"`` terms follow from a pipeline rank's summed layers (recomputation,
  the pipeline bubble, the host floor); ``"step"`` terms happen once per optimizer step (gradient
  reduction, parameter all-gather, pipeline p2p of the first micro-batch, optimizer).
* ``group``: the calibration group (``planner.calibration``): terms that usually mis-predict together
  share one fitted multiplier.
* ``bottleneck``: the limiter label ``StepTimeBreakdown.bottleneck`` reports when this term dominates.
* ``hidden_by``: what overlap can hide the term behind (``None``: never hidden); such terms also report
  their hidden seconds in ``StepTimeBreakdown.hidden``.
* ``component_factor``: a single-GPU component measurement (``costmodel.calibrate.component_factors``) may scale it.
* ``constants``: what the term is priced from, which sets its provenance and so its uncertainty
  (``costmodel.uncertainty``): a compute curve (``gemm``, ``grouped_gemm``, ``attention``), the HBM rate
  (``hbm``), the optimizer step (``optimizer``), a ring or p2p collective over the term's group
  (``collective``), the dispatcher's exchange (``dispatch``), the host's issuing rate (``host``), or
  ``derived`` from other terms (recomputation re-runs the forward, the bubble waits for the stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.errors import InvalidConfigError

SCOPES = ("layer", "stage", "step")


@dataclass(frozen=True)
class Term:
    """One row of the term table (see the module docstring for the columns)."""

    name: str
    scope: str
    group: str
    bottleneck: str
    hidden_by: str | None = None
    component_factor: bool = False
    constants: str = ""

    @property
    def per_step(self) -> bool:
        """Paid once per optimizer step rather than per micro-batch."""
        return self.scope == "step"


TERM_TABLE: tuple[Term, ...] = (
    Term("gemm", "layer", "compute", "compute", component_factor=True, constants="gemm"),
    Term("grouped_gemm", "layer", "compute", "compute", component_factor=True, constants="grouped_gemm"),
    Term("attention_core", "layer", "compute", "compute", component_factor=True, constants="attention"),
    Term("memory_bound", "layer", "memory_bound", "memory-bound", component_factor=True, constants="hbm"),
    Term("recompute", "stage", "compute", "compute", constants="derived"),
    Term("tp_comm", "layer", "comm", "tp-comm", hidden_by="the GEMMs it feeds (tp_comm_overlap)",
         constants="collective"),
    Term("cp_comm", "layer", "comm", "cp-comm",
         hidden_by="the ring's attention blocks (cp_comm p2p, a2a+p2p); the all-gather and all-to-alls: nothing",
         constants="collective"),
    Term("ep_a2a", "layer", "all_to_all", "all-to-all",
         hidden_by="another micro-batch's compute (overlap_moe_expert_parallel_comm); the dispatch's, the "
                   "shared experts' forward (moe_shared_expert_overlap)", constants="dispatch"),
    Term("etp_comm", "layer", "comm", "all-to-all", constants="collective"),
    Term("dp_grad", "step", "comm", "dp-comm", hidden_by="the last micro-batch's backward (overlap_grad_reduce)",
         constants="collective"),
    Term("edp_grad", "step", "comm", "dp-comm", hidden_by="the last micro-batch's backward (overlap_grad_reduce)",
         constants="collective"),
    Term("param_gather", "step", "comm", "dp-comm",
         hidden_by="the first micro-batch's forward (overlap_param_gather)", constants="collective"),
    Term("pp_p2p", "step", "comm", "pp-comm", hidden_by="steady-state compute of interleaved schedules (vpp > 1)",
         constants="collective"),
    Term("pp_bubble", "stage", "compute", "pp-bubble", constants="derived"),
    Term("optimizer", "step", "memory_bound", "optimizer", component_factor=True, constants="optimizer"),
    Term("host_overhead", "stage", "compute", "host-overhead", constants="host"),
)

TERMS: tuple[str, ...] = tuple(t.name for t in TERM_TABLE)
TERM_INDEX: dict[str, int] = {name: i for i, name in enumerate(TERMS)}
# the slots of a layer vector (step_time's per-micro-batch costs of one layer kind), in table order
LAYER_TERMS: tuple[str, ...] = tuple(t.name for t in TERM_TABLE if t.scope == "layer")
LAYER_SLOT: dict[str, int] = {name: i for i, name in enumerate(LAYER_TERMS)}
HIDDEN_TERMS: tuple[str, ...] = tuple(t.name for t in TERM_TABLE if t.hidden_by is not None)
BOTTLENECK_OF_TERM: dict[str, str] = {t.name: t.bottleneck for t in TERM_TABLE}
# calibration group -> its terms, groups in the order of their first term
TERM_GROUPS: dict[str, tuple[str, ...]] = {}
for _t in TERM_TABLE:
    TERM_GROUPS[_t.group] = TERM_GROUPS.get(_t.group, ()) + (_t.name,)
# bottleneck label -> its terms, labels in the order of their first term ('compute' first)
BOTTLENECK_TERMS: dict[str, tuple[str, ...]] = {}
for _t in TERM_TABLE:
    BOTTLENECK_TERMS[_t.bottleneck] = BOTTLENECK_TERMS.get(_t.bottleneck, ()) + (_t.name,)
del _t
FACTOR_TERMS: tuple[str, ...] = tuple(t.name for t in TERM_TABLE if t.component_factor)

_SCOPE_ERRORS = [t.name for t in TERM_TABLE if t.scope not in SCOPES or not t.constants]
if _SCOPE_ERRORS or len(TERM_INDEX) != len(TERM_TABLE):
    raise ValueError(f"term table: unknown scope, no constants or repeated name in {_SCOPE_ERRORS or TERMS}")


def term_index(name: str, role: str = "time term") -> int:
    """Position of term ``name`` in ``StepTimeBreakdown.terms``; InvalidConfigError naming ``role`` for a name
    not in the table."""
    try:
        return TERM_INDEX[name]
    except KeyError:
        raise InvalidConfigError(f"unknown {role} {name!r}; terms are {', '.join(TERMS)}") from None


def calibration_group(name: str) -> str:
    """The calibration group of term ``name``; InvalidConfigError for a name not in the table."""
    return TERM_TABLE[term_index(name)].group
