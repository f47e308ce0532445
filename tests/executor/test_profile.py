"""`foldtune profile` and the Measurement it prints."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from executor.measurement import Measurement
from executor.profile import rank_memory
from spec.failure import FailureKind


def test_measurement_round_trips_through_json():
    m = Measurement(ok=True, model="tiny-moe", layout="tp2 ep2", world_size=2, device="cpu", step_time=0.1,
                    step_times=[0.1, 0.12], phases={"experts": 0.02}, tokens_per_s_per_gpu=10.0,
                    tflops_per_gpu=0.01, mfu=0.1, tokens_per_expert=[3, 5])
    assert Measurement.from_dict(json.loads(m.to_json())) == m
    failed = Measurement.failed("out of memory on rank 1: ...", FailureKind.OOM, model="x")
    assert not failed.ok and "out of memory" in failed.summary()
    assert Measurement.from_dict(json.loads(failed.to_json())) == failed
    assert failed.to_dict()["failure_kind"] == "oom" and m.failure_kind is None


def test_measurement_keeps_static_memory_and_reads_records_without_it():
    gib = 2**30
    m = Measurement(ok=True, model="m", layout="l", world_size=1, device="gpu", step_time=0.1, step_times=[0.1],
                    tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0, peak_allocated_bytes=3 * gib,
                    peak_reserved_bytes=4 * gib, static_allocated_bytes=gib, static_after_step_allocated_bytes=2 * gib)
    assert Measurement.from_dict(json.loads(m.to_json())) == m
    assert "static 1.00 GiB before the first step, 2.00 GiB after it" in m.summary()
    old = m.to_dict()
    del old["static_allocated_bytes"], old["static_after_step_allocated_bytes"]  # a record from before the fields
    loaded = Measurement.from_dict(old)
    assert loaded.static_allocated_bytes is None and loaded.static_after_step_allocated_bytes is None
    assert "static" not in loaded.summary()


def test_fixed_cost_is_dispatch_to_the_last_ranks_first_timed_step_split_where_the_last_rank_had_its_groups():
    from executor.profile import fixed_cost

    reports = [{"groups_at": 102.0, "first_timed_at": 110.0}, {"groups_at": 103.5, "first_timed_at": 109.0}]
    assert fixed_cost(reports, 100.0) == {"fixed_cost_s": 10.0, "startup_s": 3.5, "warmup_s": 6.5}
    skewed = [{"groups_at": 99.0, "first_timed_at": 99.5}]  # another node's clock a little behind the driver's
    assert fixed_cost(skewed, 100.0) == {"fixed_cost_s": 0.0, "startup_s": 0.0, "warmup_s": 0.0}
    assert fixed_cost([{"step_times": []}], 100.0)["fixed_cost_s"] is None  # a launcher's report without times


def test_measurement_keeps_the_fixed_cost_and_reads_records_without_it():
    m = Measurement(ok=True, model="m", layout="l", world_size=2, device="cpu", step_time=0.1, step_times=[0.1],
                    tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0, fixed_cost_s=4.5, startup_s=1.25, warmup_s=3.25,
                    reused_ranks=True)
    assert Measurement.from_dict(json.loads(m.to_json())) == m
    assert "fixed cost 4.50 s to the first timed step (start-up 1.25 s, warm-up 3.25 s; reused ranks)" in m.summary()
    old = {k: v for k, v in m.to_dict().items() if k not in ("fixed_cost_s", "startup_s", "warmup_s", "reused_ranks")}
    loaded = Measurement.from_dict(old)
    assert loaded.fixed_cost_s is None and loaded.reused_ranks is None and "fixed cost" not in loaded.summary()


@pytest.mark.slow
def test_profile_command_runs_tp2_ep2_on_cpu(capsys):
    code = main(["profile", "--model", "tiny-moe", "--tp", "2", "--ep", "2", "--seq", "32", "--gbs", "1", "--untimed-steps", "1",
                 "--timed-steps", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    m = Measurement.from_dict(json.loads(out))
    assert m.ok and m.world_size == 2 and m.layout.startswith("tp2 cp1 pp1 vpp1 ep2 etp1")
    assert len(m.step_times) == 2 and m.step_time > 0 and m.tokens_per_s_per_gpu > 0
    assert m.static_allocated_bytes is None and m.static_after_step_allocated_bytes is None  # CPU: no CUDA memory
    assert m.fixed_cost_s >= m.startup_s > 0 and m.reused_ranks is False  # fresh processes for this one run
    assert {"attention", "experts", "dispatch", "ep_alltoall", "tp_allgather", "optimizer"} <= set(m.phases)
    # every rank's phases, rank 0's being the headline ones
    assert len(m.phases_by_rank) == 2 and m.phases_by_rank[0] == m.phases
    assert set(m.phases_by_rank[1]) == set(m.phases) and m.phases_by_rank[1]["ep_alltoall"] > 0
    # every routed assignment of the timed steps is counted: 2 steps · 1 sequence (gbs = mbs·dp) · 32 tokens
    # · top-2 · 2 MoE layers
    assert sum(m.tokens_per_expert) == 2 * 1 * 32 * 2 * 2


def test_profile_reports_an_impossible_layout_without_running(capsys):
    code = main(["profile", "--model", "tiny-moe", "--ep", "3", "--timed-steps", "1"])
    err = capsys.readouterr().err  # the front door's one line (api.cli._model_args.check_local_run), exit 2
    assert code == 2 and err.count("\n") == 1
    assert "num_experts (8) must be divisible by ep (3)" in err and "[executor_experts_ep]" in err


def test_profile_rejects_bad_numbers_with_one_line(capsys):
    code = main(["profile", "--model", "tiny-moe", "--tp", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("foldtune: error: --tp must be positive")


def test_every_ranks_memory_is_kept_beside_the_maximum():
    reports = [{"peak_allocated": 5, "peak_reserved": 6, "static_before_step": 1, "static_after_step": 2,
                "step_times": [0.1]},
               {"peak_allocated": 9, "peak_reserved": 10, "static_before_step": 3}]
    assert rank_memory(reports) == [
        {"peak_allocated": 5, "peak_reserved": 6, "static_before_step": 1, "static_after_step": 2},
        {"peak_allocated": 9, "peak_reserved": 10, "static_before_step": 3, "static_after_step": None}]
