"""Out of the box: a job on a datasheet profile calibrates its GPU type once, stores the profile for later jobs
and prices with it (api/worker/auto_profile.py); the runner's setting; end to end on CPU ranks."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from api.worker.auto_profile import PricingProfile, auto_profile_name, pricing_profile, quick_calibration
from executor.launch_local import LaunchResult
from api.worker.runner import RunnerSettings
from spec.catalog import get_hardware
from spec.errors import FoldtuneError, SpecError

CPU = get_hardware("cpu")


class FakeStore:
    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.calibrations = 0

    def stored(self, name):
        return self.rows.get(name)

    def store(self, name, profile):
        self.rows[name] = profile
        return True

    def calibrate(self, hardware, num_gpus, precision, mode):
        self.calibrations += 1
        return replace(hardware, name=auto_profile_name(hardware, num_gpus), source="calibrated (fake)",
                       op_launch_s=3e-5, cpu_cores=2 if hardware.gpu.name == "cpu" else None)


def test_the_first_job_calibrates_and_stores_later_jobs_reuse():
    fake = FakeStore()
    profile, pricing = pricing_profile(CPU, 2, "fp32", "minimal", fake.stored, fake.store, fake.calibrate)
    assert pricing == PricingProfile("cpu-2-ranks-auto-calibrated", "calibrated by this job", True)
    assert profile.op_launch_s == 3e-5 and fake.calibrations == 1
    assert set(fake.rows) == {"cpu-2-ranks-auto-calibrated"}
    again, pricing = pricing_profile(CPU, 2, "fp32", "minimal", fake.stored, fake.store, fake.calibrate)
    assert pricing == PricingProfile("cpu-2-ranks-auto-calibrated", "stored calibration") and fake.calibrations == 1
    assert again == profile
    # CPU ranks share the machine's cores: a job of another rank count is measured (and stored) on its own
    _, pricing = pricing_profile(CPU, 4, "fp32", "minimal", fake.stored, fake.store, fake.calibrate)
    assert pricing == PricingProfile("cpu-4-ranks-auto-calibrated", "calibrated by this job", True)
    assert fake.calibrations == 2
    # a GPU type's devices do not share: one profile for every job on it
    h100 = get_hardware("h100-sxm")
    assert auto_profile_name(h100, 8) == auto_profile_name(h100, 64) == "h100-sxm-auto-calibrated"


def test_a_stored_cpu_profile_timed_in_lockstep_is_measured_again_and_replaced():
    fake = FakeStore()
    # what a calibration stored before CPU ranks were timed in turns: no cpu_cores
    fake.rows["cpu-4-ranks-auto-calibrated"] = replace(CPU, name="cpu-4-ranks-auto-calibrated",
                                                       source="calibrated (old)").to_dict()
    profile, pricing = pricing_profile(CPU, 4, "fp32", "minimal", fake.stored, fake.store, fake.calibrate)
    assert pricing == PricingProfile("cpu-4-ranks-auto-calibrated", "calibrated by this job", True)
    assert fake.calibrations == 1 and profile.cpu_cores == 2
    assert fake.rows["cpu-4-ranks-auto-calibrated"]["cpu_cores"] == 2  # replaced: the next job reuses it
    _, pricing = pricing_profile(CPU, 4, "fp32", "minimal", fake.stored, fake.store, fake.calibrate)
    assert pricing.source == "stored calibration" and fake.calibrations == 1
    # a GPU profile has no cores to record: a stored one stays current
    h100 = get_hardware("h100-sxm")
    fake.rows["h100-sxm-auto-calibrated"] = replace(h100, name="h100-sxm-auto-calibrated", source="x").to_dict()
    _, pricing = pricing_profile(h100, 8, "bf16", "quick", fake.stored, fake.store, fake.calibrate)
    assert pricing.source == "stored calibration" and fake.calibrations == 1


def test_a_cpu_calibration_runs_as_many_ranks_as_the_job():
    """Four CPU ranks on two cores get half a core each: the calibration measures them as the trials run."""
    calls = []

    def launcher(fn, world_size, args=(), **kwargs):
        calls.append((world_size, kwargs.get("ranks_per_node"), kwargs.get("backend")))
        return LaunchResult(ok=False, failure_reason="stopped (test)")

    for ranks in (4, 1):
        with pytest.raises(FoldtuneError, match="calibration run failed"):
            quick_calibration(CPU, ranks, "fp32", "minimal", launcher=launcher, slots_per_node=8)
    assert calls == [(4, 4, "gloo"), (2, 2, "gloo")]  # at least two: the gloo collectives need a pair


def test_submitted_profiles_off_and_failures_keep_what_the_job_had():
    fake = FakeStore()
    measured = replace(CPU, name="mine", source="calibrated 2026-11-26")
    assert pricing_profile(measured, 2, "fp32", "quick", fake.stored, fake.store, fake.calibrate) == (
        measured, PricingProfile("mine", "submitted"))
    hw, pricing = pricing_profile(CPU, 2, "fp32", "off", fake.stored, fake.store, fake.calibrate)
    assert hw == CPU and pricing.source == "datasheet" and "off" in pricing.note

    def broken(*_):
        raise FoldtuneError("this runner's machine has no GPU to calibrate")
    h100 = get_hardware("h100")
    hw, pricing = pricing_profile(h100, 8, "bf16", "quick", fake.stored, fake.store, broken)
    assert hw == h100 and not pricing.calibrated_by_job and "no GPU" in pricing.note
    assert fake.calibrations == 0 and fake.rows == {}


def test_a_gpu_calibration_through_the_cluster_runs_on_one_of_its_nodes():
    """The runner calibrates where its trials run (a head host may have no GPU): the ranks go to the launcher,
    as many as one node holds (at most the job's GPUs), all on that node."""
    h100 = get_hardware("h100-sxm")  # 8 GPUs per node in the catalog; this machine has none
    calls = []

    def launcher(fn, world_size, args=(), **kwargs):
        calls.append((world_size, kwargs.get("ranks_per_node"), kwargs.get("backend")))
        return LaunchResult(ok=False, failure_reason="no GPU here (test)")

    with pytest.raises(FoldtuneError, match="calibration run failed: no GPU here"):
        quick_calibration(h100, 16, "bf16", "quick", launcher=launcher, slots_per_node=4)
    with pytest.raises(FoldtuneError, match="calibration run failed"):
        quick_calibration(h100, 2, "bf16", "quick", launcher=launcher, slots_per_node=8)
    assert calls == [(4, 4, "nccl"), (2, 2, "nccl")]
    with pytest.raises(FoldtuneError, match="no GPU node to calibrate"):
        quick_calibration(h100, 8, "bf16", "quick", launcher=launcher, slots_per_node=0)
    assert len(calls) == 2


def test_runner_setting_defaults_quick_on_gpus_off_on_cpu():
    from api.cli.tune_cmd import AUTO_CALIBRATE_CHOICES
    from api.worker.auto_profile import AUTO_CALIBRATE_MODES
    assert AUTO_CALIBRATE_CHOICES == AUTO_CALIBRATE_MODES
    s = RunnerSettings(database_url="sqlite://", runner_id="r")
    assert s.auto_calibrate_mode(CPU) == "off" and s.auto_calibrate_mode(get_hardware("h100")) == "quick"
    env = {"FOLDTUNE_DATABASE_URL": "sqlite://", "FOLDTUNE_AUTO_CALIBRATE": "minimal"}
    assert RunnerSettings.from_env(environ=env).auto_calibrate_mode(CPU) == "minimal"
    with pytest.raises(SpecError, match="auto_calibrate"):
        RunnerSettings.from_env(environ={**env, "FOLDTUNE_AUTO_CALIBRATE": "always"})


@pytest.mark.slow
@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_a_cpu_job_calibrates_first_and_the_next_job_reuses_the_profile(client, alice, db_url):
    from runner_env import TINY_JOB, session_ray, wait_no_rank_actors

    from api.worker.runner import Runner
    from api.worker.trials import TrialSettings

    session_ray()
    body = copy.deepcopy(TINY_JOB)
    body["budget"]["max_trials"] = 1
    settings = RunnerSettings(database_url=db_url, runner_id="auto", heartbeat_s=1.0, poll_s=0.5,
                              trial=TrialSettings(warmup_steps=1, timed_steps=1, timeout_s=120.0),
                              auto_calibrate="minimal")
    results = []
    for _ in range(2):
        job_id = client.post("/v1/jobs", json=body, headers=alice).json()["id"]
        runner = Runner(settings)
        try:
            assert runner.run(once=True) == 1
        finally:
            runner.close()
        job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
        assert job["status"] == "succeeded", job["error"]
        results.append(job["calibration"]["pricing_profile"])
    assert results[0] == {"name": "cpu-2-ranks-auto-calibrated", "source": "calibrated by this job",
                          "calibrated_by_job": True, "note": ""}
    assert results[1] == {"name": "cpu-2-ranks-auto-calibrated", "source": "stored calibration",
                          "calibrated_by_job": False, "note": ""}
    stored = client.get("/v1/hardware-profiles", headers=alice).json()
    names = [p["name"] for p in (stored["items"] if isinstance(stored, dict) else stored)]
    assert "cpu-2-ranks-auto-calibrated" in names
    assert wait_no_rank_actors() == []


def test_a_jobs_headroom_is_stored_and_rebuilt_by_the_runner(client, alice):
    """cluster.min_headroom of POST /v1/jobs rides in the stored cluster and the runner's specs keep it."""
    from runner_env import TINY_JOB

    from api.worker.runner import job_specs
    from db.models import Job

    body = copy.deepcopy(TINY_JOB)
    body["cluster"]["min_headroom"] = 2**30
    r = client.post("/v1/jobs", json=body, headers=alice)
    assert r.status_code == 201, r.text
    job = Job(model_spec=get_model_dict("tiny-moe"), training_spec=TINY_JOB["training"], num_gpus=2,
              cluster={"hardware": CPU.to_dict(), "min_headroom": 2**30})
    assert job_specs(job)[2].min_headroom_bytes == 2**30
    legacy = Job(model_spec=get_model_dict("tiny-moe"), training_spec=TINY_JOB["training"], num_gpus=2,
                 cluster={"hardware": CPU.to_dict()})
    assert job_specs(legacy)[2].min_headroom == 0.05  # jobs stored before the field: the default
    bad = copy.deepcopy(TINY_JOB)
    bad["cluster"]["min_headroom"] = 0.95
    r = client.post("/v1/jobs", json=bad, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "headroom_fits"


def get_model_dict(name):
    from spec.catalog import get_model
    return get_model(name).to_dict()


def test_tune_calibrates_the_cpu_too_unless_told_otherwise():
    """`foldtune tune` (README command 1, CPU ranks) measures the machine before its search; the flag and
    FOLDTUNE_AUTO_CALIBRATE still choose."""
    from api.cli.tune_cmd import tune_auto_calibrate
    assert tune_auto_calibrate(None, None) == "quick"
    assert tune_auto_calibrate(None, "off") == "off" and tune_auto_calibrate("minimal", "off") == "minimal"


def test_tune_prints_the_calibration_and_its_duration():
    import io

    from api.cli.tune_cmd import TrialPrinter
    out = io.StringIO()
    printer = TrialPrinter(out)
    printer("calibrating", {"job_id": 3, "gpu": "cpu", "mode": "quick", "name": "cpu-4-ranks-auto-calibrated"})
    printer("calibrated", {"job_id": 3, "name": "cpu-4-ranks-auto-calibrated", "note": "", "seconds": 41.6})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job 3: no calibrated profile of cpu yet: calibrating this machine (quick")
    assert lines[1] == "job 3: calibrated in 42 s, stored as 'cpu-4-ranks-auto-calibrated' (later jobs reuse it)"
