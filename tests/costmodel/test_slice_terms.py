"""A slice in the cost model's terms: the parts a step is made of add up to the estimate's compute terms, and the
measured pieces become terms, stages and a step as worked by hand."""

import pytest

from costmodel.slices import (COMM_TERMS, Extras, compute_step, measured_layer_terms, predicted_layer_terms,
                              priced_rest, stage_compute)
from costmodel.step_time import StageKind, estimate_step_time, layout_parts
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model

H100 = get_hardware("h100-sxm")


@pytest.mark.parametrize("pp", [1, 2])
def test_layout_parts_add_up_to_the_estimates_compute_terms(pp):
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    cluster = ClusterSpec(H100, 16)
    config = ParallelConfig(world_size=16, tp=2, pp=pp, ep=4, micro_batch_size=1)
    parts = layout_parts(model, training, cluster, config)
    estimate = estimate_step_time(model, training, cluster, config)
    assert parts.micro_batches == 64 // (16 // (2 * pp))
    assert sum(k.moe_layers * k.count for k in parts.kinds) == model.num_layers
    # the slowest stage kind paces the step: its layers and extras, times the micro-batches
    for term in ("gemm", "grouped_gemm", "attention_core"):
        per_kind = [k.moe_layers * parts.moe[term] + (parts.embedding[term] if k.first else 0.0)
                    + (parts.head[term] + parts.head_blocks[term] if k.last else 0.0) for k in parts.kinds]
        assert parts.micro_batches * max(per_kind) == pytest.approx(estimate.term(term), rel=0.2)
        if pp == 1:  # one stage kind: exactly the estimate's
            assert parts.micro_batches * per_kind[0] == pytest.approx(estimate.term(term), rel=1e-12)
    assert set(predicted_layer_terms(parts, "moe")) == {"gemm", "grouped_gemm", "attention_core", "memory_bound"}
    rest = priced_rest(estimate)
    assert set(COMM_TERMS) <= set(rest) and "gemm" not in rest and "pp_bubble" not in rest
    assert sum(rest.values()) + sum(estimate.term(t) for t in ("gemm", "grouped_gemm", "attention_core",
                                                               "memory_bound", "recompute", "pp_bubble")) == \
        pytest.approx(estimate.step_time, rel=1e-12)


def test_measured_pieces_become_terms_with_memory_bound_the_rest():
    kind = {"layer_s": {"even": 10.0}, "no_recompute_s": {"even": 8.0}, "gemm_s": 2.0,
            "grouped_gemm_s": {"even": 3.0}, "attention_core_s": 1.0}
    assert measured_layer_terms(kind, "even") == {"gemm": 2.0, "grouped_gemm": 3.0, "attention_core": 1.0,
                                                  "memory_bound": 2.0, "recompute": 2.0}
    dense = {"layer_s": {"even": 5.0}, "gemm_s": 2.5, "attention_core_s": 1.0}  # no experts, no recomputation
    assert measured_layer_terms(dense, "even") == {"gemm": 2.5, "grouped_gemm": 0.0, "attention_core": 1.0,
                                                   "memory_bound": 1.5, "recompute": 0.0}


def test_stage_compute_and_step_worked_by_hand():
    layers = {"dense": {"gemm": 1.0, "grouped_gemm": 0.0, "attention_core": 0.5, "memory_bound": 0.5,
                        "recompute": 0.3},
              "moe": {"gemm": 1.0, "grouped_gemm": 2.0, "attention_core": 0.5, "memory_bound": 1.5,
                      "recompute": 0.6}}
    extras = Extras(embedding=0.25, head=1.0, head_blocks=0.5)
    first = StageKind(1, 1, 2, True, False, 0.0, (0,))
    last = StageKind(1, 0, 3, False, True, 0.0, (1,))
    # full recomputation of 1 layer of each stage: a third of the first stage's three layers' re-runs
    s0 = stage_compute(layers, first, extras, recompute_num_layers=1)
    assert s0 == pytest.approx({"gemm": 3.0, "grouped_gemm": 4.0, "attention_core": 1.5, "memory_bound": 3.5,
                                "recompute": (0.3 + 2 * 0.6) / 3, "extras": 0.25})
    s1 = stage_compute(layers, last, extras, recompute_s=0.7)  # the time model's own recomputation figure
    assert s1["recompute"] == 0.7 and s1["extras"] == 1.5 and s1["grouped_gemm"] == 6.0
    step = compute_step([sum(s0.values()), sum(s1.values())], (first, last), micro_batches=8, vpp=2)
    t0, t1 = sum(s0.values()), sum(s1.values())
    assert step.critical == 1 and step.steady == pytest.approx(8 * t1)
    assert step.bubble == pytest.approx(t0 / 2) and step.total == pytest.approx(8 * t1 + t0 / 2)
