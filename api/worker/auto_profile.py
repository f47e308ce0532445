"""Out of the box: a job on a GPU type without a calibrated profile calibrates it first and shares the result.

A job submitted against a built-in (datasheet) hardware profile prices its layouts with the measured profile
``<gpu>-auto-calibrated`` of the service database (on the CPU type ``cpu-<N>-ranks-auto-calibrated``: CPU ranks
share cores, so the job's rank count is part of what is measured) when one exists; when none does, the runner first
runs a quick calibration (the machine microbenchmarks of ``foldtune calibrate --quick`` plus the sustained-load run,
a minute or two on a GPU) on the devices the job's trials run on: through the Ray launcher, on one node of the
cluster (a runner on a head host without GPUs calibrates its GPU hosts), or on this machine's own devices when no
launcher is given (``foldtune calibrate``'s local path). It stores it under that name for every later job on that
GPU type, and prices with it. The search's online calibration (per-term multipliers fitted on the measured trials)
works on top, as on any profile. A job submitted with a calibrated or stored profile keeps it;
``FOLDTUNE_AUTO_CALIBRATE=off`` keeps the datasheet.

Which profile priced the job, and whether this job measured it, rides in the job's ``calibration`` record
(``pricing_profile``) and in the runner's ``job_started`` event.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from costmodel.calibrate.profile_builder import build_profile
from executor.launch_local import LaunchResult
from executor.microbench.runner import BenchPlan, run_benchmarks
from executor.microbench.sustained import SUSTAINED_SECONDS
from spec.errors import FoldtuneError
from spec.hardware import HardwareProfile
from spec.shape_defaults import is_cpu

AUTO_CALIBRATE_MODES = ("quick", "minimal", "off")
DATASHEET_SOURCE = "datasheet"
# the fewest CPU ranks a CPU type's calibration runs: the gloo collectives need two
CPU_CALIBRATION_RANKS = 2


def calibration_ranks_cpu(num_gpus: int) -> int:
    """CPU ranks that calibrate the CPU type for a job of ``num_gpus`` ranks: as many as the job runs. CPU ranks
    share the machine's cores, so a rank's speed depends on how many run beside it (four ranks on two cores get
    half a core each): a profile measured on fewer ranks than the job runs prices its ranks too fast."""
    return max(num_gpus, CPU_CALIBRATION_RANKS)


def auto_profile_name(hardware: HardwareProfile, num_gpus: int) -> str:
    """The stored profile a job of ``num_gpus`` on ``hardware``'s GPU type shares, e.g. 'h100-sxm-auto-calibrated';
    on the CPU type one per rank count ('cpu-4-ranks-auto-calibrated': see :func:`calibration_ranks_cpu`)."""
    if is_cpu(hardware.gpu.name):
        return f"cpu-{calibration_ranks_cpu(num_gpus)}-ranks-auto-calibrated"
    return f"{hardware.gpu.name.lower()}-auto-calibrated"


@dataclass(frozen=True)
class PricingProfile:
    """The profile a job priced with: its name, where it came from and whether this job measured it."""

    name: str
    source: str  # 'datasheet', 'submitted', 'stored calibration', 'calibrated by this job'
    calibrated_by_job: bool = False
    note: str = ""  # why a datasheet job was not calibrated, when it was not

    def to_dict(self) -> dict:
        return asdict(self)


Calibrate = Callable[[HardwareProfile, int, str, str], HardwareProfile]


def quick_calibration(hardware: HardwareProfile, num_gpus: int, precision: str, mode: str,
                      launcher: Callable[..., LaunchResult] | None = None,
                      slots_per_node: int | None = None) -> HardwareProfile:
    """Measure devices of ``hardware``'s type (``mode`` 'quick' or 'minimal') and return the profile called
    :func:`auto_profile_name`. ``launcher`` (``executor.launch_ray.launch``'s contract) runs the ranks on one node
    of a cluster whose nodes hold ``slots_per_node`` devices each; without it, this machine's devices.
    FoldtuneError when there are none to measure."""
    cpu = is_cpu(hardware.gpu.name)
    if cpu:
        ranks = calibration_ranks_cpu(num_gpus)
    elif launcher is not None:
        if not slots_per_node:
            raise FoldtuneError("the Ray cluster has no GPU node to calibrate")
        ranks = min(num_gpus, hardware.gpus_per_node, slots_per_node)
    else:
        local = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local == 0:
            raise FoldtuneError("this runner's machine has no GPU to calibrate")
        ranks = min(num_gpus, hardware.gpus_per_node, local)
    if launcher is not None:  # every rank on one node: the machine's curves, as a local calibration times them
        launcher = functools.partial(launcher, ranks_per_node=ranks)
    # The sustained-load run stays in: without it the profile prices at the cool card's burst clock. Two H200s
    # held 0.83 of it under load; first trials priced without it were 22-25 % fast, with it 6-10 %
    # (docs/benchmarks.md).
    plan = BenchPlan(precision="bf16" if precision == "fp8" else precision, quick=True,
                     sustained_s=0.0 if mode == "minimal" else SUSTAINED_SECONDS, minimal=mode == "minimal")
    raw = run_benchmarks(ranks, plan, device="cpu" if cpu else "cuda", timeout_s=900.0, launcher=launcher)
    return build_profile(hardware, raw, auto_profile_name(hardware, num_gpus))


def current_profile(hardware: HardwareProfile, found: dict | None) -> dict | None:
    """``found`` (a stored auto-calibrated profile of ``hardware``'s type, or None), or None when it predates what a
    calibration now measures and must be measured again: a CPU profile without ``cpu_cores`` was timed with its
    ranks in lockstep, which prices every layout at one contention, whatever its ranks really share
    (docs/benchmarks.md, "CPU ranks' contention priced per layout")."""
    if found is not None and is_cpu(hardware.gpu.name) and found.get("cpu_cores") is None:
        return None
    return found


def pricing_profile(hardware: HardwareProfile, num_gpus: int, precision: str, mode: str,
                    stored: Callable[[str], dict | None], store: Callable[[str, dict], bool],
                    calibrate: Calibrate = quick_calibration) -> tuple[HardwareProfile, PricingProfile]:
    """The profile a job prices with and where it came from (see the module docstring).

    ``stored(name)`` returns a stored profile dict or None; ``store(name, profile)`` stores one (False: the
    name is held by a profile calibrate did not write). A stored profile that :func:`current_profile` finds out of
    date is measured again and replaced. A calibration that fails leaves the datasheet, with
    the reason in the note: the job still runs.
    """
    if hardware.source != DATASHEET_SOURCE:
        return hardware, PricingProfile(hardware.name, "submitted")
    if mode == "off":
        return hardware, PricingProfile(hardware.name, DATASHEET_SOURCE,
                                        note="auto-calibration off (FOLDTUNE_AUTO_CALIBRATE)")
    name = auto_profile_name(hardware, num_gpus)
    found = current_profile(hardware, stored(name))
    if found is not None:
        return HardwareProfile.from_dict(found), PricingProfile(name, "stored calibration")
    try:
        profile = calibrate(hardware, num_gpus, precision, mode)
    except FoldtuneError as exc:
        return hardware, PricingProfile(hardware.name, DATASHEET_SOURCE, note=f"not calibrated: {exc}")
    if not store(name, profile.to_dict()):
        return profile, PricingProfile(name, "calibrated by this job", True,
                                       note=f"not stored: the name {name!r} is taken by another profile")
    return profile, PricingProfile(name, "calibrated by this job", True)
