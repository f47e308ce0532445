"""Component factors: the executor's blocks as measured (``executor.microbench.components``) against this
model's prediction of the same work, as one correction factor per time-model term.

Components and the parts of :func:`costmodel.step_time.layer_times` (one micro-batch on a 1-GPU layout)
they are compared with: ``attention`` -> part 'attention' (gemm, attention_core, memory_bound); ``moe`` ->
'moe' (grouped_gemm, memory_bound, gemm); ``dense_mlp`` -> 'dense_mlp'; ``head`` -> 'head' (gemm,
memory_bound); ``embedding`` (in-step phases only, :mod:`costmodel.calibrate.step_phases`) -> 'embedding'
(memory_bound); ``optimizer`` -> the optimizer's seconds per parameter.

Factor mapping (:func:`term_factors`): each component's ratio r_c = measured_c / predicted_c is spread over
the terms the component's prediction contains, weighted by the term's predicted seconds in that component
times how often the component occurs in the model (attention per layer, moe per MoE layer, dense_mlp per
dense layer, head once): ``f_t = sum_c n_c r_c p_ct / sum_c n_c p_ct``. With these factors the corrected
prediction of one pass through the model on one GPU equals the measured sum of its components exactly; a
term only one component predicts (grouped_gemm, attention_core) takes that component's ratio.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from costmodel.compute import compute_rates
from costmodel.step_time import OPTIMIZER_BYTES_PER_PARAM, layer_times
from costmodel.terms import FACTOR_TERMS
from spec.hardware import ClusterSpec, HardwareProfile, component_key
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


@dataclass(frozen=True)
class ComponentTime:
    """One component: measured and predicted seconds (forward + backward of one micro-batch, or for
    'optimizer' seconds per parameter), and the predicted seconds per cost-model term."""

    name: str
    measured_s: float
    predicted_s: float
    predicted_terms: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


@dataclass(frozen=True)
class ComponentReport:
    """One model shape's components, measured and predicted, and the per-term factors they imply."""

    model: str
    seq_length: int
    micro_batch_size: int
    precision: str
    device: str
    components: tuple[ComponentTime, ...]
    counts: dict[str, int]  # occurrences of each component in one pass through the model
    factors: dict[str, float]  # term -> measured / predicted
    # component -> how its time was measured (executor.microbench.timing's method strings); empty in reports
    # written before the field existed, whose blocks were wall clock over 8 calls, host issue time included
    timing: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return component_key(self.model, self.seq_length, self.micro_batch_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "key": self.key}


def predicted_parts(spec: ModelSpec, seq_length: int, mbs: int, precision: str,
                    hardware: HardwareProfile) -> tuple[dict[str, dict[str, float]], float]:
    """({part: {term: seconds fwd+bwd}} of one micro-batch on one GPU, optimizer seconds per parameter)."""
    training = TrainingSpec(seq_length=seq_length, global_batch_size=mbs, precision=precision)
    parts = layer_times(spec, training, ClusterSpec(hardware, 1), ParallelConfig(world_size=1, micro_batch_size=mbs))
    out = {}
    for name, part in parts.items():
        bwd = dict(part.bwd)
        out[name] = {t: v + bwd[t] for t, v in part.fwd if v + bwd[t] > 0}
    per_param = (hardware.optimizer_seconds_per_param
                 or OPTIMIZER_BYTES_PER_PARAM / compute_rates(hardware, precision).hbm_bandwidth)
    return out, per_param


def component_counts(spec: ModelSpec) -> dict[str, int]:
    """How often each component occurs in one pass through ``spec``."""
    pattern = spec.moe_layer_pattern()
    return {"attention": spec.num_layers, "moe": sum(map(bool, pattern)),
            "dense_mlp": sum(1 for p in pattern if not p), "head": 1, "embedding": 1, "optimizer": 1}


def term_factors(components: tuple[ComponentTime, ...] | list[ComponentTime], counts: dict[str, int]) -> dict[str, float]:
    """Per-term factors: each component's ratio spread over its predicted terms (module docstring)."""
    weighted: dict[str, float] = {}
    predicted: dict[str, float] = {}
    for c in components:
        n = counts.get(c.name, 1)
        for term, seconds in c.predicted_terms.items():
            weighted[term] = weighted.get(term, 0.0) + n * c.ratio * seconds
            predicted[term] = predicted.get(term, 0.0) + n * seconds
    return {t: weighted[t] / predicted[t] for t in FACTOR_TERMS if predicted.get(t, 0.0) > 0.0}


def build_report(spec: ModelSpec, seq_length: int, micro_batch_size: int, precision: str, device: str,
                 measured: dict[str, float], hardware: HardwareProfile,
                 timing: dict[str, str] | None = None) -> ComponentReport:
    """Compare ``measured`` ({component: seconds}, 'optimizer' per parameter) with the prediction on
    ``hardware`` (the profile the factors will be stored in); ``timing`` ({component: method}) is kept in the
    report as it came. Raises ValueError naming every component
    without a positive finite measurement or prediction."""
    parts, per_param = predicted_parts(spec, seq_length, micro_batch_size, precision, hardware)
    components = [ComponentTime(name, seconds, sum(parts[name].values()), parts[name])
                  for name, seconds in measured.items() if name != "optimizer"]
    components.append(ComponentTime("optimizer", measured["optimizer"], per_param, {"optimizer": per_param}))
    bad = [f"{c.name}: measured {c.measured_s} s, predicted {c.predicted_s} s" for c in components
           if not (math.isfinite(c.measured_s) and c.measured_s > 0 and c.predicted_s > 0)]
    if bad:
        raise ValueError("components without a usable time: " + "; ".join(bad))
    counts = component_counts(spec)
    return ComponentReport(spec.name, seq_length, micro_batch_size, precision, device, tuple(components), counts,
                           term_factors(components, counts), dict(timing or {}))
