"""Intervals on every estimate (costmodel.uncertainty): each term's provenance from the profile and the layout,
the combination into a step-time and a memory interval worked by hand, the narrowing by calibration residuals,
and the intervals on the estimates the planner returns."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.memory import MemoryBreakdown
from costmodel.step_time import StepTimeBreakdown
from costmodel.terms import HIDDEN_TERMS, TERM_TABLE, TERMS
from costmodel.uncertainty import (COMMON_MEASURED, DATASHEET, EXTRAPOLATED, HOST_WIDTHS, MEASURED, RATE,
                                   UNMEASURED_NETWORK, WIDTHS, Interval, TermProvenance, Width, combine_step,
                                   memory_interval, narrowed, term_provenance)
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec, MeasuredCurve
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

H100 = get_hardware("h100-sxm")


def breakdown(terms: dict[str, float], hidden: dict[str, float] | None = None) -> StepTimeBreakdown:
    values = tuple((name, terms.get(name, 0.0)) for name in TERMS)
    return StepTimeBreakdown(step_time=sum(terms.values()), terms=values,
                             hidden=tuple((name, (hidden or {}).get(name, 0.0)) for name in HIDDEN_TERMS),
                             tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0, mfu=0.1, bottleneck="compute")


def provenance(**chosen: tuple[str, str, Width]) -> tuple[TermProvenance, ...]:
    """Every term of the table: ``chosen`` ones as (source, provenance, width), derived ones as the table says,
    the rest measured."""
    out = []
    for t in TERM_TABLE:
        if t.name in chosen:
            source, prov, width = chosen[t.name]
        elif t.constants == "derived":
            source, prov, width = "derived", "derived", Width(0.0, 0.0)
        elif t.constants == "host":
            source, prov, width = "host", MEASURED, HOST_WIDTHS[MEASURED]
        else:
            source, prov, width = t.name, MEASURED, WIDTHS[MEASURED]
        out.append(TermProvenance(t.name, source, prov, width, "test"))
    return tuple(out)


CHOSEN = {"gemm": ("gemm", MEASURED, Width(0.15, 0.25)),
          "grouped_gemm": ("grouped_gemm", EXTRAPOLATED, Width(0.25, 0.50)),
          "ep_a2a": ("network", UNMEASURED_NETWORK, Width(0.25, 1.50))}
TERMS_S = {"gemm": 1.0, "grouped_gemm": 2.0, "ep_a2a": 0.5, "pp_bubble": 0.35}


def test_step_interval_worked_by_hand():
    """gemm 1.0 s (measured -15/+25 %), grouped_gemm 2.0 s (extrapolated -25/+50 %), ep_a2a 0.5 s (network never
    measured -25/+150 %), bubble 0.35 s, 0.2 s of the all-to-all hidden. The bubble follows the layer terms:
    0.35 x (1, 2, 0.5) / 3.5 adds 0.1, 0.2, 0.05 -> sources 1.1, 2.2, 0.55 s.
    below = sqrt((0.15 x 1.1)^2 + (0.25 x 2.2)^2 + (0.25 x 0.55)^2) = sqrt(0.34863) = 0.59045, plus the common
    offset 0.05 x (1.1 + 2.2) = 0.165: 0.75545. above = sqrt((0.25 x 1.1)^2 + (0.5 x 2.2)^2 + (1.5 x 0.55)^2) =
    sqrt(1.96625) = 1.40223, + 0.165, + the hidden 0.2 x (0.5 overlap + 1.5 width) = 0.4: 1.96723.
    Step 3.85 s in [3.09455, 5.81723]."""
    assert COMMON_MEASURED == Width(0.05, 0.05)
    iv = combine_step(breakdown(TERMS_S, {"ep_a2a": 0.2}), provenance(**CHOSEN), host_seconds=0.0)
    assert (iv.value, iv.low, iv.high) == pytest.approx((3.85, 3.85 - 0.75545, 3.85 + 1.96723), abs=1e-5)
    assert iv.covers(3.1) and iv.covers(5.8) and not iv.covers(3.0) and not iv.covers(5.9)


def test_terms_of_one_source_add_linearly():
    """Two GEMM-priced terms of one source err together: 1 + 1 s at +25 % is +0.5 s (+0.1 s common), where two
    independent sources would give sqrt(2) x 0.25 s."""
    same = provenance(gemm=("gemm", MEASURED, WIDTHS[MEASURED]), attention_core=("gemm", MEASURED, WIDTHS[MEASURED]))
    apart = provenance(gemm=("gemm", MEASURED, WIDTHS[MEASURED]), attention_core=("attn", MEASURED, WIDTHS[MEASURED]))
    two = breakdown({"gemm": 1.0, "attention_core": 1.0})
    assert combine_step(two, same, 0.0).high == pytest.approx(2.0 + 0.5 + 0.1)
    assert combine_step(two, apart, 0.0).high == pytest.approx(2.0 + math.sqrt(2) * 0.25 + 0.1)


def test_the_host_enters_through_the_slower_of_host_and_device():
    """The same step on a rank whose host needs 4.0 s per step for its steady state (3.5 s of layer terms): the
    pessimistic end is the once-per-step rest (0.35 s, scaled as the device's high end: 0.35 x 5.81723 / 3.85)
    plus the host at +240 %: 0.52884 + 4.0 x 3.4 = 14.12884 s; the optimistic end stays the device's (the host at
    -30 %, 2.8 s, plus 0.28133 s is below it). On CPU ranks (serial) host and device add: 5.81723 + 13.6 s."""
    time = breakdown(TERMS_S, {"ep_a2a": 0.2})
    iv = combine_step(time, provenance(**CHOSEN), host_seconds=4.0)
    assert HOST_WIDTHS[MEASURED] == Width(0.30, 2.40)
    assert (iv.low, iv.high) == pytest.approx((3.09455, 14.12884), abs=1e-5)
    serial = combine_step(time, provenance(**CHOSEN), host_seconds=4.0, serial_host=True)
    assert serial.high == pytest.approx(5.81723 + 13.6, abs=1e-5)
    # a host floor the model already pays (host_overhead 0.5 s): the host's time is the steady state plus it
    floored = breakdown({**TERMS_S, "host_overhead": 0.5}, {"ep_a2a": 0.2})
    iv = combine_step(floored, provenance(**CHOSEN), host_seconds=0.0)
    assert iv.high == pytest.approx(0.52884 + (3.5 + 0.5) * 3.4, abs=1e-5)


def test_memory_interval_worked_by_hand():
    """10 + 10 + 20 GiB of weights, grads, optimizer state (+-1 %, linearly: 0.4), 30 activations and 5 logits
    (-8/+10 %), 2 of buffers (-25/+50 %) and 3 of allocator share (measured: +-50 %; a prior: -100/+200 %),
    dynamic ones in quadrature: below sqrt(2.4^2 + 0.4^2 + 0.5^2 + 1.5^2) = 2.90172, above sqrt(3^2 + 0.5^2 +
    1^2 + 1.5^2) = 3.53553. Total 80 in [80 - 3.30172, 80 + 3.93553]; with the prior, above sqrt(9 + 0.25 + 1 +
    36) = 6.80074."""
    m = MemoryBreakdown(0, 10.0, 10.0, 20.0, 30.0, 5.0, 2.0, 3.0, details=())
    iv = memory_interval(m, replace(H100, allocator_fragmentation=0.05))
    assert (iv.value, iv.low, iv.high) == pytest.approx((80.0, 80 - 3.30172, 80 + 3.93553), abs=1e-5)
    prior = memory_interval(m, H100)
    assert prior.high == pytest.approx(80 + 0.4 + 6.80074, abs=1e-5)


def test_narrowed_by_calibration_residuals_worked_by_hand():
    """1.0 s in [0.9, 1.5] (-10 / +50 %); a fit with relative RMSE 0.1 over 9 trials leaves 1.2816 x 0.1 x
    sqrt(10/9) = 0.13509 where that is narrower: the high side only, [0.9, 1.13509] around 1.0, and around the
    calibrated 1.1 s [0.99, 1.24860]."""
    iv = Interval(1.0, 0.9, 1.5)
    assert (narrowed(iv, 0.1, 9).low, narrowed(iv, 0.1, 9).high) == pytest.approx((0.9, 1.13509), abs=1e-5)
    moved = narrowed(iv, 0.1, 9, calibrated_value=1.1)
    assert (moved.value, moved.low, moved.high) == pytest.approx((1.1, 0.99, 1.24860), abs=1e-5)
    assert narrowed(iv, 0.1, 2) == iv  # two trials say nothing about the spread


def test_provenance_follows_the_profile_and_the_layout():
    """Datasheet everywhere on the catalog H100; a profile with curves: the GEMMs inside the curve are measured,
    a curve that ends above a layout's smallest GEMM makes them extrapolated; a collective over 2 ranks measured
    at 2 is measured, over 8 ranks (measured up to 2) extrapolated, across nodes without network curves never
    measured; the host without any measurement is a rule of thumb."""
    model, training = get_model("mixtral-8x7b"), TrainingSpec(seq_length=4096, global_batch_size=256)
    config = ParallelConfig(world_size=16, tp=2, ep=8, micro_batch_size=1)
    plain = {p.term: p for p in term_provenance(model, training, ClusterSpec(H100, 16), config)}
    assert list(plain) == list(TERMS)
    assert plain["gemm"].provenance == DATASHEET and plain["gemm"].source == "datasheet"
    assert plain["grouped_gemm"].source == "datasheet"  # datasheet defaults miss together
    assert plain["ep_a2a"].provenance == DATASHEET and plain["host_overhead"].provenance == DATASHEET
    assert plain["pp_bubble"].provenance == "derived"
    flat = MeasuredCurve(((1e9, 0.3), (2e12, 0.75)))
    coll = MeasuredCurve(((65536.0, 0.01), (268435456.0, 0.6)))
    measured = replace(H100, gemm_efficiency=flat, sustained_clock_factor=0.85, op_launch_s=8e-6,
                       collective_efficiency={"all_to_all:intra": coll, "all_to_all:intra:2": coll,
                                              "all_gather:intra": coll, "all_gather:intra:2": coll})
    got = {p.term: p for p in term_provenance(model, training, ClusterSpec(measured, 16), config)}
    assert got["gemm"].provenance == MEASURED and got["gemm"].width == WIDTHS[MEASURED]
    assert got["tp_comm"].provenance == MEASURED  # all-gather over the 2 TP ranks, measured at 2
    assert got["ep_a2a"].provenance == EXTRAPOLATED and "8 ranks, measured up to 2" in got["ep_a2a"].note
    assert got["host_overhead"].provenance == EXTRAPOLATED  # bare launches only: a lower bound
    high = replace(measured, gemm_efficiency=MeasuredCurve(((5e11, 0.7), (2e12, 0.75))))  # smallest: 6.9e10
    assert {p.term: p for p in term_provenance(model, training, ClusterSpec(high, 16), config)}[
        "gemm"].provenance == EXTRAPOLATED
    burst = replace(measured, sustained_clock_factor=None)
    clock = {p.term: p for p in term_provenance(model, training, ClusterSpec(burst, 16), config)}["gemm"]
    assert clock.width.high == pytest.approx(WIDTHS[MEASURED].high + 1 / 0.83 - 1)
    wide = ParallelConfig(world_size=16, ep=16, micro_batch_size=1)  # EP16 over two nodes of 8
    across = {p.term: p for p in term_provenance(model, training, ClusterSpec(measured, 16), wide)}
    assert across["ep_a2a"].provenance == UNMEASURED_NETWORK and across["ep_a2a"].source == "network"


def test_every_estimate_carries_its_intervals():
    model, training = get_model("mixtral-8x7b"), TrainingSpec(seq_length=4096, global_batch_size=256)
    e = estimate(model, training, ClusterSpec(H100, 16), ParallelConfig(world_size=16, tp=2, ep=8))
    iv = e.interval
    assert iv.rate == RATE == 0.8
    assert iv.step_time.low < e.time.step_time < iv.step_time.high == e.rank_time
    assert iv.memory.low < e.memory.total < iv.memory.high
    d = e.to_dict()
    assert d["step_time_interval_s"] == {"low": iv.step_time.low, "high": iv.step_time.high}
    assert d["memory_interval_bytes"] == {"low": iv.memory.low, "high": iv.memory.high}
    assert d["interval_rate"] == 0.8 and set(d["time_provenance"]) == set(TERMS)
