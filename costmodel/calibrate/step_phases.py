"""Component times read from the phases of a real 1-GPU training step (``Measurement.phases``).

The isolated blocks of ``executor.microbench.components`` do not run as the same blocks do inside a step:
timed alone, many-small-kernel attention blocks (MLA, Qwen3's q/k norms) measured the host (wall clock) or ran
with the host further ahead than a step lets it (device time), so their factors moved 1-GPU step predictions
away from the measured steps (docs/benchmarks.md). A training step's phase timer
(``executor.timing.PhaseTimer``) cuts the step into consecutive device-stream intervals named after the
executor's blocks; this module turns those per-step phase seconds into the component seconds that
:func:`costmodel.calibrate.component_factors.build_report` compares with the cost model.

Phase -> component mapping (the markers in executor/attention.py, mla.py, model.py, moe.py, mlp.py,
train_step.py), per occurrence of the component and per micro-batch (phases are summed over a step's
micro-batches):

* ``attention``: phase 'attention' (input RMSNorm, projections, rope, the attention core, output projection;
  forward and backward). The residual add after it runs in phase 'other' and is left out (one elementwise
  add: under 1 % of the block).
* ``moe``: phases 'router', 'dispatch', 'experts', 'combine', 'shared_experts' plus the MoE layers' share of
  'norm' (the pre-MLP RMSNorm, one per decoder layer, so 'norm' splits over layers evenly).
* ``dense_mlp``: phase 'mlp' plus the dense layers' share of 'norm'.
* ``head``: phase 'lm_head_loss' (final RMSNorm, output GEMM, cross-entropy, forward and backward).
* ``embedding``: phase 'embedding' (the lookup, its backward's dense [vocab, h] gradient and its fp32
  main-grad accumulation; the phase stays open until the next micro-batch's forward, so the step's few
  per-micro-batch statistics ops land in it too) -> part 'embedding' (memory_bound). The isolated blocks
  had no embedding; here it is needed: on the H200 layout tables the phase took 1.0-1.6 ms per
  micro-batch against 0.37-0.77 ms priced, and without it the head's factor (0.86-0.88) would remove the
  error that offsets it (left out, Qwen3's and DeepSeek-V2-Lite's held-out MAPE rises above 5 %;
  docs/benchmarks.md, "In-step components").
* ``optimizer``: phase 'optimizer' over the layout's parameters (seconds per parameter).

Left out: 'other' (residual adds, loss scaling, step statistics, host waits between blocks), 'grad_reduce' and the
'tp_allgather' / 'tp_reduce_scatter' marks, which at TP = 1 bracket identities (together < 0.5 % of the
step on the H200 tables). The step must run without recomputation (its re-run forward would land in the
blocks' phases), without CUDA graphs (the graphed half is one 'attention' phase with the norm in it) and on
a model without head blocks (``spec.head_features``: MTP depths; their layers add to the same phases).
"""

from __future__ import annotations

import math

from costmodel.calibrate.component_factors import ComponentReport, build_report
from costmodel.params import stage_param_counts
from spec.hardware import HardwareProfile
from spec.head_features import head_features
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig

#: timing method recorded in the component report and the stored profile
IN_STEP_PHASES = "in-step phases"

#: phase names summed into each layer component (before the 'norm' split)
COMPONENT_PHASES: dict[str, tuple[str, ...]] = {
    "attention": ("attention",),
    "moe": ("router", "dispatch", "experts", "combine", "shared_experts"),
    "dense_mlp": ("mlp",),
    "head": ("lm_head_loss",),
    "embedding": ("embedding",),
}


def step_parameters(spec: ModelSpec) -> int:
    """Parameters one GPU holds (and its optimizer steps) on the world-size-1 layout of ``spec``."""
    counts = stage_param_counts(spec, ParallelConfig(world_size=1), 0)
    return counts.dense + counts.expert


def components_from_phases(spec: ModelSpec, phases: dict[str, float], micro_batches: int,
                           parameters: int | None = None) -> dict[str, float]:
    """{component: seconds} of one 1-GPU step's ``phases`` (seconds per step, summed over ``micro_batches``):
    fwd+bwd seconds per occurrence per micro-batch for 'attention', 'moe', 'dense_mlp', 'head', 'embedding', and seconds
    per parameter for 'optimizer' (``parameters``: default :func:`step_parameters`). Components the model
    lacks (no dense layer, no MoE layer) are omitted. ValueError when a needed phase is missing or the
    model has head blocks, e.g. MTP depths (module docstring)."""
    heads = head_features(spec)
    if heads:
        raise ValueError(f"{spec.name}: {heads[0][0].label} blocks share the decoder's phases; in-step components "
                         f"need a model without them")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    pattern = spec.moe_layer_pattern()
    n_moe = sum(map(bool, pattern))
    counts = {"attention": spec.num_layers, "moe": n_moe, "dense_mlp": len(pattern) - n_moe, "head": 1,
              "embedding": 1}
    needed = ["attention", "lm_head_loss", "embedding", "optimizer"] + (["experts"] if n_moe else []) + \
        (["mlp"] if counts["dense_mlp"] else [])
    missing = [p for p in needed if not phases.get(p)]
    if missing:
        raise ValueError(f"phases without a time: {', '.join(missing)} (a step timed with phases on?)")
    norm_per_layer = phases.get("norm", 0.0) / spec.num_layers
    out = {}
    for name, names in COMPONENT_PHASES.items():
        n = counts[name]
        if n == 0:
            continue
        seconds = sum(phases.get(p, 0.0) for p in names)
        if name in ("moe", "dense_mlp"):
            seconds += norm_per_layer * n
        out[name] = seconds / (n * micro_batches)
    out["optimizer"] = phases["optimizer"] / (parameters or step_parameters(spec))
    bad = [k for k, v in out.items() if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"components without a positive time: {', '.join(bad)}")
    return out


def report_from_phases(spec: ModelSpec, seq_length: int, micro_batch_size: int, precision: str, device: str,
                       phases: dict[str, float], micro_batches: int, hardware: HardwareProfile) -> ComponentReport:
    """The component report of one 1-GPU step's ``phases`` (seconds per step over ``micro_batches``) against
    ``hardware``'s prediction, every component timed as IN_STEP_PHASES: what ``foldtune calibrate --model``
    stores and ``bench/instep_components.py`` computes from a stored table row."""
    measured = components_from_phases(spec, phases, micro_batches)
    return build_report(spec, seq_length, micro_batch_size, precision, device, measured, hardware,
                        {name: IN_STEP_PHASES for name in measured})
