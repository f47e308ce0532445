"""Checking a plan's top layouts by slices (planner/verify.py): measured compute against the prediction per
term, the checked step, and the re-ranking, which follows the measured numbers and nothing else."""

import pytest

from costmodel.slices import LAYER_COMPUTE_TERMS, part_compute, predicted_parts
from planner.verify import rank_checks, scenario_loads, verify_plan
from spec import ClusterSpec, TrainingSpec, get_hardware, get_model
from spec.errors import FoldtuneError

H100 = get_hardware("h100-sxm")


def _measurement_from_model(model, training, cluster, config, loads, factor):
    """What a slice would report if every piece took ``factor`` x the cost model's prediction of it: the
    executor's dict shape (executor/slices.py), filled from the cost model."""
    kinds, parts = {}, None
    for name, load in loads.items():
        trained = training if len(set(load)) <= 1 else TrainingSpec(**{**training.to_dict(), "moe_expert_load": load})
        parts = predicted_parts(model, trained, cluster, config)
        for kind, layer in (("moe", parts.moe), ("dense", parts.dense)):
            if kind == "dense" and not any(k.dense_layers for k in parts.kinds):
                continue
            entry = kinds.setdefault(kind, {"gemm_s": factor * layer["gemm"],
                                            "attention_core_s": factor * layer["attention_core"],
                                            "layer_s": {}, "grouped_gemm_s": {}, "expert_rows": {}})
            plain = factor * sum(layer[t] for t in LAYER_COMPUTE_TERMS)
            entry["layer_s"][name] = plain + factor * _recompute_per_layer(config, parts.kinds[0])
            if config.recompute_granularity != "none":
                entry.setdefault("no_recompute_s", {})[name] = plain
            entry["grouped_gemm_s"][name] = factor * layer["grouped_gemm"]
            entry["expert_rows"][name] = [1]
    return {"scenarios": list(loads), "kinds": kinds,
            "parts": {"embedding_s": factor * part_compute(parts.embedding), "head_s": factor * part_compute(parts.head)}}


def _recompute_per_layer(config, kind):
    """One layer's recomputation seconds as a slice times it (a whole layer re-run under full recomputation)."""
    layers = kind.dense_layers + kind.moe_layers
    k = config.recompute_num_layers
    share = min(1.0, k / layers) if config.recompute_granularity == "full" and k else 1.0
    return kind.recompute_s / (share * layers)


def test_ranking_follows_the_measured_compute_and_terms_compare_measured_with_predicted():
    model = get_model("tiny-moe")
    training = TrainingSpec(seq_length=64, global_batch_size=64, precision="fp32")
    cluster = ClusterSpec(H100, 8)
    factors = {}  # the plan's best measures 20 x its prediction, the others as predicted

    def measure(config, loads):
        factors[config.label()] = 20.0 if not factors else 1.0
        return _measurement_from_model(model, training, cluster, config, loads, factors[config.label()])

    report = verify_plan(model, training, cluster, cluster, measure, top=3, hot_factor=2.0)
    assert [layout.plan_rank for layout in report.layouts] == [1, 2, 3]
    assert set(report.order) == {"even", "skewed"} == set(scenario_loads(model))
    best = report.layouts[0]
    for name, check in best.scenarios.items():
        for term, (measured, predicted) in check.terms.items():
            if term != "recompute" and predicted > 0:
                assert measured == pytest.approx(20.0 * predicted, rel=1e-9), (name, term)
        assert check.checked_step_s > check.predicted_step_s
    for layout in report.layouts[1:]:  # measured as predicted: the checked compute is the predicted compute
        for check in layout.scenarios.values():
            assert check.compute_measured == pytest.approx(check.compute_predicted, rel=1e-9)
    for name, labels in report.order.items():
        steps = [next(lay for lay in report.layouts if lay.config.label() == label).scenarios[name].checked_step_s
                 for label in labels]
        assert steps == sorted(steps)
        assert labels[-1] == best.config.label() and best.rank[name] == 3
    as_json = report.to_dict()
    assert as_json["layouts"][0]["scenarios"]["even"]["terms"]["gemm"]["ratio"] == pytest.approx(20.0)


def test_an_unmeasured_layout_ranks_last_with_its_reason():
    model = get_model("tiny-moe")
    training = TrainingSpec(seq_length=64, global_batch_size=64, precision="fp32")
    cluster = ClusterSpec(H100, 8)
    calls = []

    def measure(config, loads):
        calls.append(config)
        if len(calls) == 1:
            raise FoldtuneError("slice failed: out of memory")
        return _measurement_from_model(model, training, cluster, config, loads, 1.0)

    report = verify_plan(model, training, cluster, cluster, measure, top=2)
    first, second = report.layouts
    assert first.error == "slice failed: out of memory" and first.scenarios == {}
    assert first.rank == {"even": 2, "skewed": 2} and second.rank == {"even": 1, "skewed": 1}
    assert rank_checks([first], ["even"]) == {"even": [first.config.label()]}
