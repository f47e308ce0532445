"""Per-call costs of the executor's exchanges (CP K/V exchange, CP chunk kernels, dispatch + combine): where the
time model adds them, their rules of thumb when not measured, the profile fields, and how calibration derives
them from a measurement. Hand-worked."""

from dataclasses import replace

import pytest

from costmodel.calibrate.exchange_prices import CpCase, DispatchCase, cp_prices, dispatch_price, fixed_fields
from costmodel.compute import compute_rates
from costmodel.context_parallel import CP_FLASH_KERNEL_SLOWDOWN, chunk_attention_time, chunk_kernels, cp_attention_time
from costmodel.fixed_costs import cp_exchange_fixed, dispatcher_fixed, exchange_fixed
from costmodel.step_time import estimate_step_time, layer_times
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.errors import FoldtuneError
from spec.hardware import HardwareProfile

H100 = get_hardware("h100-sxm")
# zero per-call costs: what the model priced before these terms existed
BARE = replace(H100, cp_exchange_fixed_s=0.0, cp_chunk_floor_s=0.0,
               dispatcher_fixed_s=(("allgather", 0.0), ("alltoall", 0.0)))
MS = 1e-3


def _with(**fields) -> HardwareProfile:
    return replace(BARE, **fields)


def test_rules_of_thumb_when_not_measured():
    # the datasheet profile measures none: each call's collectives at the default 25 us of a near-empty one
    assert H100.collective_launch_s is None
    assert cp_exchange_fixed(H100) == pytest.approx(4 * 25e-6)  # K, V all-gathered; gradients reduce-scattered
    assert dispatcher_fixed(H100, "alltoall") == pytest.approx(5 * 25e-6)
    assert dispatcher_fixed(H100, "allgather") == pytest.approx(7 * 25e-6)
    # a measured collective launch scales the rule; a measured per-call cost replaces it, 0 included
    assert cp_exchange_fixed(replace(H100, collective_launch_s=40e-6)) == pytest.approx(4 * 40e-6)
    # the flex dispatcher (Megatron-only: calibration cannot time it) keeps its rule of thumb: 4 kernel launches
    assert exchange_fixed(BARE) == pytest.approx({"cp_exchange": 0.0, "alltoall": 0.0, "allgather": 0.0,
                                                  "flex_deepep": 4 * 25e-6, "flex_hybridep": 4 * 25e-6})
    assert dispatcher_fixed(_with(dispatcher_fixed_s=(("alltoall", 2 * MS),)), "alltoall") == 2 * MS
    # a dispatcher the profile leaves out keeps its rule of thumb
    assert dispatcher_fixed(replace(H100, dispatcher_fixed_s=(("alltoall", 2 * MS),)), "allgather") == \
        pytest.approx(7 * 25e-6)
    # and no chunk floor: the chunk kernels keep their launch overhead only
    assert compute_rates(H100, "bf16").cp_chunk_floor == 0.0


def test_chunk_calls_take_at_least_their_floor_half_each_way():
    bare = compute_rates(BARE, "bf16")
    # seq 4096 at CP2, rank 0: chunk 0 (1024 queries x 1024 keys) and chunk 3 (1024 x 4096), each direction
    # on its own; the busiest rank is the one with the longest sum
    def directions(rates, rank):
        return [chunk_attention_time(rates, 1, ch, 32, 128, 128, CP_FLASH_KERNEL_SLOWDOWN, rates.cp_chunk_floor / 2)
                for ch in chunk_kernels(4096, 2, rank)]

    kernels = directions(bare, 0)
    short = kernels[0][0]  # chunk 0's forward, the shortest kernel
    floor = 2 * short + 0.2 * MS  # half of it per direction lies 0.1 ms above that kernel
    rates = compute_rates(_with(cp_chunk_floor_s=floor), "bf16")
    for (f0, b0), (f1, b1) in zip(kernels, directions(rates, 0)):
        assert f1 == pytest.approx(max(f0, floor / 2)) and b1 == pytest.approx(max(b0, floor / 2))
    assert directions(rates, 0)[0][0] == pytest.approx(short + 0.1 * MS)  # raised to the floor
    assert directions(rates, 0)[1][1] == kernels[1][1]  # chunk 3's backward is longer: untouched
    busiest = max((directions(rates, r) for r in (0, 1)), key=lambda d: sum(map(sum, d)))
    fwd, bwd = cp_attention_time(rates, 1, 4096, 2, 32, 128, 128)
    assert (fwd, bwd) == pytest.approx((sum(d[0] for d in busiest), sum(d[1] for d in busiest)))
    # a floor under every kernel changes nothing; CP1 runs one plain kernel with no floor
    low = compute_rates(_with(cp_chunk_floor_s=1e-9), "bf16")
    assert cp_attention_time(low, 1, 4096, 2, 32, 128, 128) == pytest.approx(
        cp_attention_time(bare, 1, 4096, 2, 32, 128, 128))
    huge = compute_rates(_with(cp_chunk_floor_s=1.0), "bf16")
    assert cp_attention_time(huge, 1, 4096, 1, 32, 128, 128) == cp_attention_time(bare, 1, 4096, 1, 32, 128, 128)
    assert cp_attention_time(huge, 1, 4096, 2, 32, 128, 128) == pytest.approx((1.0, 1.0))  # 2 chunks x 0.5 s


def _layer(hardware, config, part):
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    times = layer_times(model, training, ClusterSpec(hardware, 8), config)[part]
    return dict(times.fwd), dict(times.bwd)


def test_cp_exchange_cost_is_added_to_cp_comm_of_every_attention_layer():
    config = ParallelConfig(world_size=8, cp=2, ep=4)
    (f0, b0), (f1, b1) = (_layer(hw, config, "attention") for hw in (BARE, _with(cp_exchange_fixed_s=0.5 * MS)))
    assert f1["cp_comm"] - f0["cp_comm"] == pytest.approx(0.25 * MS)
    assert b1["cp_comm"] - b0["cp_comm"] == pytest.approx(0.25 * MS)
    # no CP, no exchange, no cost
    no_cp = ParallelConfig(world_size=8, ep=8)
    assert _layer(_with(cp_exchange_fixed_s=0.5 * MS), no_cp, "attention")[0]["cp_comm"] == 0.0


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatch_cost_is_added_to_ep_a2a_of_every_moe_layer(dispatcher):
    config = ParallelConfig(world_size=8, ep=8, moe_token_dispatcher_type=dispatcher)
    other = "allgather" if dispatcher == "alltoall" else "alltoall"
    measured = _with(dispatcher_fixed_s=((dispatcher, 2 * MS), (other, 7 * MS)))
    (f0, b0), (f1, b1) = (_layer(hw, config, "moe") for hw in (BARE, measured))
    # its own dispatcher's cost (2 ms), not the other's, half forward, half backward
    assert f1["ep_a2a"] - f0["ep_a2a"] == pytest.approx(1 * MS)
    assert b1["ep_a2a"] - b0["ep_a2a"] == pytest.approx(1 * MS)
    # one rank in the group: nothing exchanged, nothing paid
    single = ParallelConfig(world_size=8, moe_token_dispatcher_type=dispatcher)
    assert _layer(measured, single, "moe")[0]["ep_a2a"] == 0.0


def test_full_recompute_re_runs_the_forward_half():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    config = ParallelConfig(world_size=8, ep=8, recompute_granularity="full")
    steps = [estimate_step_time(model, training, ClusterSpec(hw, 8), config)
             for hw in (BARE, _with(dispatcher_fixed_s=(("alltoall", 2 * MS),)))]
    # 32 MoE layers x 2 micro-batches (gbs 16, dp 8): the step pays 2 ms per layer and micro-batch, and full
    # recomputation re-runs the forward 1 ms of it
    assert steps[1].term("ep_a2a") - steps[0].term("ep_a2a") == pytest.approx(32 * 2 * 2 * MS)
    assert steps[1].term("recompute") - steps[0].term("recompute") == pytest.approx(32 * 2 * 1 * MS)


def test_ep_overlap_does_not_hide_the_dispatch_cost():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    config = ParallelConfig(world_size=8, ep=8, overlap_moe_expert_parallel_comm=True)
    steps = [estimate_step_time(model, training, ClusterSpec(hw, 8), config)
             for hw in (BARE, _with(dispatcher_fixed_s=(("alltoall", 2 * MS),)))]
    # the all-to-alls themselves hide behind the other micro-batch's compute; the 2 ms per call do not:
    # 32 layers x 2 micro-batches, all of it exposed
    assert dict(steps[0].hidden).get("ep_a2a", 0.0) > 0.0
    assert steps[1].term("ep_a2a") - steps[0].term("ep_a2a") == pytest.approx(32 * 2 * 2 * MS)
    assert dict(steps[1].hidden)["ep_a2a"] == pytest.approx(dict(steps[0].hidden)["ep_a2a"])


def test_profile_round_trips_and_checks_the_new_fields():
    profile = replace(H100, cp_exchange_fixed_s=0.5 * MS, cp_chunk_floor_s=0.0,
                      dispatcher_fixed_s={"alltoall": 2 * MS, "allgather": 1.5 * MS})
    assert profile.dispatcher_fixed_s == (("allgather", 1.5 * MS), ("alltoall", 2 * MS))  # a dict is kept sorted
    data = profile.to_dict()
    assert data["cp_exchange_fixed_s"] == 0.5 * MS and data["cp_chunk_floor_s"] == 0.0
    assert data["dispatcher_fixed_s"] == {"allgather": 1.5 * MS, "alltoall": 2 * MS}
    assert HardwareProfile.from_dict(data) == profile
    # not measured: the fields stay out of the file and come back None
    assert "cp_exchange_fixed_s" not in H100.to_dict() and "dispatcher_fixed_s" not in H100.to_dict()
    assert HardwareProfile.from_dict(H100.to_dict()) == H100
    with pytest.raises(FoldtuneError, match="cp_chunk_floor_s"):
        replace(H100, cp_chunk_floor_s=-1e-6)
    with pytest.raises(FoldtuneError, match=r"dispatcher_fixed_s\[alltoall\]"):
        replace(H100, dispatcher_fixed_s=(("alltoall", float("nan")),))


def test_calibration_keeps_what_a_measurement_shows_beyond_the_price():
    cp_case = CpCase(seq=2048, cp=2, heads=32, kv_heads=8, head_dim=128)
    d_case = DispatchCase(tokens=1024, ep=2, experts=8, topk=2, hidden=4096)
    core, kv = cp_prices(H100, cp_case, fixed=False)
    a2a, ag = (dispatch_price(H100, d_case, name, fixed=False) for name in ("alltoall", "allgather"))
    measured = {"cp": {"seq": 2048, "cp": 2, "heads": 32, "kv_heads": 8, "head_dim": 128, "act_bytes": 2,
                       "core_s": core + 0.8 * MS, "kv_s": kv + 0.5 * MS},
                "dispatch": {"tokens": 1024, "ep": 2, "experts": 8, "topk": 2, "hidden": 4096, "act_bytes": 2,
                             "seconds": {"alltoall": a2a + 2 * MS, "allgather": ag - 0.1 * MS}}}
    fields = fixed_fields(H100, measured)
    # seq 2048 at CP2: every chunk kernel is shorter than the floor that makes the core 0.8 ms longer, so the
    # core is 2 chunks x 2 directions x floor / 2: the floor is the measured core over the 2 chunks
    assert fields["cp_chunk_floor_s"] == pytest.approx((core + 0.8 * MS) / 2)
    assert fields["cp_exchange_fixed_s"] == pytest.approx(0.5 * MS)
    # faster than priced: floored at 0, never a negative cost
    assert dict(fields["dispatcher_fixed_s"]) == pytest.approx({"alltoall": 2 * MS, "allgather": 0.0})
    # priced with those fields, the model gives back the measurement (the rule-of-thumb defaults replaced)
    calibrated = replace(H100, **fields)
    assert sum(cp_prices(calibrated, cp_case)) == pytest.approx(core + kv + 1.3 * MS)
    # measured no slower than the kernels: no floor
    faster = {**measured, "cp": {**measured["cp"], "core_s": core}, "dispatch": None}
    assert fixed_fields(H100, faster)["cp_chunk_floor_s"] == 0.0
    assert dispatch_price(calibrated, d_case, "alltoall") == pytest.approx(a2a + 2 * MS)
    # a record without a part gives no field for it
    assert fixed_fields(H100, {"cp": None, "dispatch": measured["dispatch"]}).keys() == {"dispatcher_fixed_s"}


def test_the_bench_price_adds_the_rule_of_thumb_when_not_measured():
    case = DispatchCase(tokens=1024, ep=2, experts=8, topk=2, hidden=4096)
    for name, collectives in (("alltoall", 5), ("allgather", 7)):
        bare = dispatch_price(H100, case, name, fixed=False)
        assert dispatch_price(H100, case, name) == pytest.approx(bare + collectives * 25e-6)
    core, kv = cp_prices(H100, CpCase(2048, 2, 32, 8, 128), fixed=False)
    assert cp_prices(H100, CpCase(2048, 2, 32, 8, 128)) == pytest.approx((core, kv + 4 * 25e-6))
