"""foldtune calibrate on 2 CPU ranks (gloo) times the executor's own CP and dispatcher exchanges and fills the
profile's per-call cost fields from them; on one rank it cannot, and the base's values stay."""

from __future__ import annotations

import pytest
import torch

from costmodel.calibrate.exchange_prices import CpCase, DispatchCase, cp_prices, dispatch_price
from costmodel.calibrate.profile_builder import build_profile
from executor.microbench.exchanges import calibration_config, merge_exchanges
from executor.microbench.runner import BenchPlan, run_benchmarks
from spec.catalog import get_hardware

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated():
    raw = run_benchmarks(2, BenchPlan(precision="fp32", quick=True, minimal=True, sustained_s=0), device="cpu",
                         timeout_s=300)
    return raw, build_profile(get_hardware("cpu"), raw)


def test_two_rank_calibration_fills_the_per_call_costs(calibrated):
    raw, profile = calibrated
    x = raw["exchanges"]
    cfg = calibration_config(torch.device("cpu"))
    assert x["cp"]["seq"] == cfg.seqs[0] and x["cp"]["cp"] == 2 and x["cp"]["act_bytes"] == 4
    assert x["cp"]["matches"]  # the chunked CP attention computed CP1's attention before it was timed
    assert x["cp"]["core_s"] > 0 and x["cp"]["kv_s"] > 0
    assert set(x["dispatch"]["seconds"]) == {"alltoall", "allgather"}
    # each field is the measurement beyond the price of the curves built in the same run, floored at 0
    core, kv = cp_prices(profile, CpCase(x["cp"]["seq"], 2, x["cp"]["heads"], x["cp"]["kv_heads"],
                                         x["cp"]["head_dim"], 4), fixed=False)
    assert profile.cp_exchange_fixed_s == pytest.approx(max(0.0, x["cp"]["kv_s"] - kv))
    # the chunk floor prices the measured core back (unless the kernels alone are priced longer)
    floored = cp_prices(profile, CpCase(x["cp"]["seq"], 2, x["cp"]["heads"], x["cp"]["kv_heads"],
                                        x["cp"]["head_dim"], 4))[0]
    assert floored == pytest.approx(max(core, x["cp"]["core_s"]), rel=1e-9)
    case = DispatchCase(x["dispatch"]["tokens"], 2, x["dispatch"]["experts"], x["dispatch"]["topk"],
                        x["dispatch"]["hidden"], 4)
    for name, seconds in x["dispatch"]["seconds"].items():
        assert dict(profile.dispatcher_fixed_s)[name] == pytest.approx(
            max(0.0, seconds - dispatch_price(profile, case, name, fixed=False)))
    # measured fields, not the defaults (whether gloo's exchange beats the curves' price depends on the load)
    assert profile.cp_exchange_fixed_s is not None and profile.cp_chunk_floor_s is not None


def test_the_slowest_rank_sets_each_time():
    rank = {"cp": {"seq": 64, "core_s": 1.0, "kv_s": 2.0, "matches": True},
            "dispatch": {"tokens": 32, "seconds": {"alltoall": 3.0, "allgather": 1.0}}}
    other = {"cp": {"seq": 64, "core_s": 0.5, "kv_s": 4.0, "matches": False},
             "dispatch": {"tokens": 32, "seconds": {"alltoall": 1.0, "allgather": 2.0}}}
    merged = merge_exchanges([rank, other])
    assert merged["cp"] == {"seq": 64, "core_s": 1.0, "kv_s": 4.0, "matches": False}
    assert merged["dispatch"]["seconds"] == {"alltoall": 3.0, "allgather": 2.0}
    assert merge_exchanges([None, None]) is None


def test_without_a_measurement_the_base_values_stay(calibrated):
    raw, _ = calibrated
    base = get_hardware("cpu")
    profile = build_profile(base, {**raw, "exchanges": None})
    assert profile.cp_exchange_fixed_s is None and profile.dispatcher_fixed_s == ()
