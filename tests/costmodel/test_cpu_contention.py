"""CPU ranks share the machine's cores: a profile whose ranks were timed alone (``HardwareProfile.cpu_cores``) has
each layout's contention priced (costmodel.step_time.cpu_contention), and the host's once-per-step work added to the
step rather than hidden under its collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.calibrate.profile_builder import build_profile
from costmodel.step_time import TERMS, cpu_contention, estimate_step_time
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.hardware import HardwareProfile
from spec.errors import SpecError

CPU = get_hardware("cpu")
MODEL = get_model("tiny-moe")
TRAINING = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32")
COMPUTE = ("gemm", "grouped_gemm", "attention_core", "memory_bound")


@pytest.mark.parametrize("ranks, cores, m, pp, vpp, expected", [
    (4, 2, 1, 1, 1, 2.0),   # dp4: four ranks busy on two cores
    (4, 2, 1, 2, 1, 1.0),   # pp2, one micro-batch: one stage at a time, two ranks busy
    (4, 2, 4, 2, 1, 1.6),   # pp2, four: busy 4 of 5 stage-slots, 4 * 4/5 = 3.2 ranks on two cores
    (4, 2, 2, 2, 2, 1.6),   # interleaved: bubble (pp-1)/vpp = 0.5 slot, 4 * 2/2.5 = 3.2
    (2, 2, 1, 1, 1, 1.0),   # as many cores as ranks: no contention
    (4, 8, 1, 1, 1, 1.0),   # never faster than alone
])
def test_contention_is_the_busy_ranks_over_the_cores(ranks, cores, m, pp, vpp, expected):
    assert cpu_contention(cores, ranks, m, pp, vpp) == pytest.approx(expected)


def _terms(profile, label):
    b = estimate_step_time(MODEL, TRAINING, ClusterSpec(profile, 4), ParallelConfig.parse(label))
    return b, dict(b.terms)


def test_a_profile_timed_alone_prices_each_layouts_contention_on_its_own_work_only():
    alone = replace(CPU, name="cpu-alone", cpu_cores=2)
    lockstep = replace(CPU, name="cpu-lockstep")
    dp4 = "tp1 cp1 pp1 vpp1 ep1 etp1 dp4 edp4 mbs2"
    b_alone, alone_terms = _terms(alone, dp4)
    _, lock_terms = _terms(lockstep, dp4)
    for name in COMPUTE + ("optimizer",):  # four ranks on two cores: twice the seconds
        assert alone_terms[name] == pytest.approx(2.0 * lock_terms[name]), name
    for name in ("dp_grad", "edp_grad"):  # collectives are timed in lockstep, under contention already
        assert alone_terms[name] == pytest.approx(lock_terms[name]), name
    assert b_alone.step_time == pytest.approx(sum(alone_terms[t] for t in TERMS))
    # pp2 with one micro-batch: two ranks busy at a time on two cores, priced as timed
    pp2 = "tp1 cp1 pp2 vpp1 ep1 etp1 dp2 edp2 mbs4"
    _, alone_terms = _terms(alone, pp2)
    _, lock_terms = _terms(lockstep, pp2)
    for name in COMPUTE:
        assert alone_terms[name] == pytest.approx(lock_terms[name]), name


def test_the_hosts_once_per_step_work_adds_to_the_step_on_cpu_ranks_timed_alone():
    # both profiles slow the host 20x, so its once-per-step work exceeds the step's collectives and optimizer
    slow = replace(CPU, moe_layer_host_s=20 * CPU.op_launch_seconds * 162)
    alone, lockstep = replace(slow, name="alone", cpu_cores=8), replace(slow, name="lockstep")
    label = "tp1 cp1 pp1 vpp1 ep1 etp1 dp4 edp4 mbs2"
    b_alone, alone_terms = _terms(alone, label)
    b_lock, lock_terms = _terms(lockstep, label)
    once = sum(lock_terms[t] for t in ("dp_grad", "edp_grad", "param_gather", "optimizer"))
    # eight cores for four ranks: no contention, the same terms but the host's
    for name in COMPUTE + ("dp_grad", "edp_grad", "optimizer"):
        assert alone_terms[name] == pytest.approx(lock_terms[name]), name
    # in lockstep the host's step work hides under the collectives up to their length; alone it all adds
    assert b_alone.step_time - b_lock.step_time == pytest.approx(once)


def test_calibration_records_the_cores_and_the_profile_keeps_them():
    raw = {"precision": "fp32", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [], "ranks": 4,
           "device_name": "cpu", "backend": "gloo", "measured_at": "2026-12-03T17:00:00+00:00", "cpu_cores": 2}
    profile = build_profile(CPU, raw, "cpu-4-ranks")
    assert profile.cpu_cores == 2
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
    del raw["cpu_cores"]
    assert build_profile(CPU, raw, "cpu-4-ranks").cpu_cores is None  # a lockstep-timed profile: no contention model
    with pytest.raises(SpecError, match="cpu_cores"):
        replace(CPU, cpu_cores=0)
