"""Fine-grained MoE calibration (bench/finegrained_moe.py -> ``foldtune calibrate finegrained``): the measured host
seconds per local expert and the router's and permutation's factors are derived as hand-worked from a run's raw
seconds, loaded into the profile, and change exactly the terms they name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.cli.main import main
from api.schemas.catalog import HardwareProfileIn
from costmodel.calibrate import finegrained as calib
from costmodel.finegrained import point_layout, point_training, priced_point, routed_proxy
from costmodel.step_time import host_seconds_per_micro_batch, moe_piece_times
from spec.catalog import get_hardware
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.profile_io import load_profile, save_profile
from spec.training_spec import TrainingSpec

MODELS = ("deepseek-v3", "qwen3-30b-a3b")


def _record(hw, local=(4, 16, 64), tokens=(1024, 4096), host_slope=2e-6, loop_slope=30e-6, router=1.5,
            permute=2.0) -> dict:
    """A run whose host seconds are linear in the local experts (another intercept per model), whose router and
    permutation took ``router`` and ``permute`` times the price on ``hw``, and whose smaller token count (which the
    factors must ignore) took 10x."""
    rec = {"kind": calib.RECORD_KIND, "device": "test", "measured_at": "now", "points": [], "router": [], "host": []}
    for i, name in enumerate(MODELS):
        model = routed_proxy(name).name
        for n in local:
            rec["host"].append({"model": model, "local_experts": n, "tokens": 128,
                                "layer_host_s": 1e-3 * (i + 1) + host_slope * n,
                                "loop_host_s": 2e-3 * (i + 1) + loop_slope * n})
        for t in tokens:
            scale = 1.0 if t == max(tokens) else 10.0
            priced = priced_point(name, local[0], t, hw)
            rec["router"].append({"model": model, "tokens": t, "router_s": scale * router * priced.pieces["router"]})
            for n in local:
                p = priced_point(name, n, t, hw)
                rec["points"].append({"model": model, "local_experts": n, "ep": p.ep, "tokens": t,
                                      "permutation_s": scale * permute * p.permutation_s})
    return rec


def test_a_run_derives_the_slopes_and_the_factors_of_its_longest_points():
    hw = get_hardware("h200")
    found = calib.derive(_record(hw), hw)
    assert found.local_expert_host_s == pytest.approx(2e-6)
    assert found.expert_loop_host_s == pytest.approx(30e-6)
    assert found.moe_router_factor == pytest.approx(1.5)
    assert found.moe_permute_factor == pytest.approx(2.0)


def test_a_negative_slope_is_stored_as_zero_and_too_few_counts_leave_a_field_unmeasured():
    hw = get_hardware("h200")
    found = calib.derive(_record(hw, host_slope=-1e-7), hw)
    assert found.local_expert_host_s == 0.0 and found.basis["local_expert_host_s_fit"] == pytest.approx(-1e-7)
    one = calib.derive(_record(hw, local=(16,)), hw)
    assert one.local_expert_host_s is None and one.expert_loop_host_s is None
    assert calib.apply(hw, one).local_expert_host_s is None  # nothing measured: the profile keeps its own


def test_factors_are_derived_against_the_target_without_its_own_factors():
    hw = get_hardware("h200")
    record = _record(hw)
    already = replace(hw, moe_router_factor=3.0, moe_permute_factor=0.5, local_expert_host_s=1e-5)
    assert calib.derive(record, already).fields() == pytest.approx(calib.derive(record, hw).fields())


def test_the_factors_scale_the_priced_router_and_permutation_and_nothing_else():
    hw = get_hardware("h200")
    model = routed_proxy("qwen3-30b-a3b")
    config = point_layout(model, 16)
    training = point_training(4096, config.ep)
    plain = moe_piece_times(model, training, ClusterSpec(hw, config.world_size), config)
    scaled_hw = replace(hw, moe_router_factor=1.5, moe_permute_factor=2.0)
    scaled = moe_piece_times(model, training, ClusterSpec(scaled_hw, config.world_size), config)
    assert scaled["router"] == pytest.approx(1.5 * plain["router"])
    for piece in ("permute", "sort", "unpermute"):
        assert plain[piece] > 0 and scaled[piece] == pytest.approx(2.0 * plain[piece])
    for piece in ("grouped_gemm", "experts_other"):
        assert scaled[piece] == plain[piece]


def test_the_measured_seconds_per_local_expert_enter_the_host_floor_as_hand_worked():
    hw = get_hardware("h200")
    model = routed_proxy("deepseek-v3")  # one MoE layer
    training = TrainingSpec(seq_length=4096, global_batch_size=64, precision="bf16")
    measured = replace(hw, local_expert_host_s=4e-6, expert_loop_host_s=40e-6)
    for ep, dispatcher in ((8, "alltoall"), (32, "alltoall"), (8, "flex_deepep")):
        config = ParallelConfig(world_size=ep, ep=ep, micro_batch_size=1, moe_token_dispatcher_type=dispatcher)
        local = model.num_experts // ep
        base = host_seconds_per_micro_batch(model, training, ClusterSpec(hw, ep), config)[0]
        after = host_seconds_per_micro_batch(model, training, ClusterSpec(measured, ep), config)[0]
        if dispatcher == "alltoall":  # the executor: nothing per local expert before, 4 us each after
            assert after - base == pytest.approx(local * 4e-6)
        else:  # Megatron's TE GroupedLinear: 6 launches per local expert at the per-op cost before, 40 us each after
            assert after - base == pytest.approx(local * (40e-6 - 6 * hw.op_launch_seconds))


def test_foldtune_calibrate_finegrained_loads_a_run_into_the_profile(tmp_path, capsys):
    hw = get_hardware("h200")
    run = tmp_path / "finegrained_h200.json"
    run.write_text(json.dumps(_record(hw)))
    target = save_profile(replace(hw, name="h200-machine"), tmp_path / "machine.json")
    out = tmp_path / "with-fine.json"
    assert main(["calibrate", "finegrained", "--profile", str(target), "--from-file", str(run),
                 "--out", str(out)]) == 0
    loaded = load_profile(out)
    assert loaded.name == "h200-machine"
    assert loaded.local_expert_host_s == pytest.approx(2e-6) and loaded.expert_loop_host_s == pytest.approx(30e-6)
    assert loaded.moe_router_factor == pytest.approx(1.5) and loaded.moe_permute_factor == pytest.approx(2.0)
    assert "moe_router_factor: 1.5" in capsys.readouterr().out


def test_a_file_that_is_not_a_finegrained_run_is_refused_naming_it(tmp_path, capsys):
    target = save_profile(get_hardware("h200"), tmp_path / "machine.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"profile": {}}))
    code = main(["calibrate", "finegrained", "--profile", str(target), "--from-file", str(other),
                 "--out", str(tmp_path / "x.json")])
    assert code != 0
    assert "not a fine-grained MoE result" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_profile_with_the_fields_round_trips_through_its_file_and_the_api_schema(tmp_path):
    fields = {"local_expert_host_s": 0.0, "expert_loop_host_s": 3e-5, "moe_router_factor": 1.2,
              "moe_permute_factor": 0.8}
    profile = replace(get_hardware("h200"), name="h200-fine", **fields)
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    body = {k: v for k, v in profile.to_dict().items() if k not in ("network_source", "nics_per_node")}
    assert HardwareProfileIn.model_validate(body).model_dump()["moe_permute_factor"] == 0.8
    with pytest.raises(ValueError, match="moe_router_factor"):
        replace(profile, moe_router_factor=0.0)
