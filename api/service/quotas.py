"""What each owner may keep in the shared service: queued and running tuning jobs and trainings, trials
per job, and stored hardware profiles (how many, and how large each one is as JSON).

The counts are checked when something is submitted; two requests of one owner racing each other may
both pass at the last free place (a quota is a bound on growth, not an exact count). A request over a
quota answers 403 naming the quota (``quota_active_jobs``, ...); see docs/service.md, "Limits".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pydantic_settings import SettingsConfigDict

from sqlalchemy.orm import Session

from api.service.errors import ServiceError
from api.env_settings import FoldtuneEnv
from spec.errors import SpecError
from db.models import HardwareProfileRow, Job, Owner, Training
from db.ownership import count_owned

ACTIVE = ("queued", "running")


class QuotaExceeded(ServiceError):
    """An owner would hold more than a quota allows: ``quota`` names it, ``loc`` is the field concerned."""

    def __init__(self, loc: str, quota: str, message: str) -> None:
        super().__init__("quota-exceeded", "Quota exceeded", f"{loc}: {message} [{quota}]")
        self.loc, self.quota, self.message = loc, quota, message


@dataclass(frozen=True)
class Quotas:
    """Per owner: ``active_jobs`` / ``active_trainings`` queued or running at once, ``trials_per_job`` (a
    job's ``budget.max_trials``), ``profiles`` stored hardware profiles and ``profile_bytes`` the size of
    one as compact JSON. Environment: FOLDTUNE_QUOTA_<FIELD> (e.g. FOLDTUNE_QUOTA_ACTIVE_JOBS)."""

    active_jobs: int = 20
    active_trainings: int = 10
    trials_per_job: int = 200
    profiles: int = 50
    profile_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"FOLDTUNE_QUOTA_{f.name.upper()} must be at least 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Quotas:
        """The quotas of ``FOLDTUNE_QUOTA_<FIELD>`` (default: the process environment); the rest at their
        defaults. SpecError naming the variable for a value that is not a whole number or is below 1."""
        given = QuotaEnv.read(environ).model_dump(exclude_none=True)
        try:
            return cls(**given)
        except ValueError as exc:
            raise SpecError(f"bad {QuotaEnv.what} setting in the environment: {exc}") from None


class QuotaEnv(FoldtuneEnv):
    """``FOLDTUNE_QUOTA_<FIELD>`` of each :class:`Quotas` field (None: the field's default there)."""

    model_config = SettingsConfigDict(env_prefix="FOLDTUNE_QUOTA_")
    what = "service"
    active_jobs: int | None = None
    active_trainings: int | None = None
    trials_per_job: int | None = None
    profiles: int | None = None
    profile_bytes: int | None = None


def check_trials_per_job(quotas: Quotas, max_trials: int) -> None:
    """QuotaExceeded when a job asks for more trials than one job may run."""
    if max_trials > quotas.trials_per_job:
        raise QuotaExceeded("body.budget.max_trials", "quota_trials_per_job",
                            f"{max_trials} trials asked, at most {quotas.trials_per_job} per job")


def check_active_jobs(session: Session, owner: Owner, quotas: Quotas) -> None:
    """QuotaExceeded when the owner already has ``active_jobs`` jobs queued or running."""
    active = count_owned(session, Job, owner.id, ACTIVE)
    if active >= quotas.active_jobs:
        raise QuotaExceeded("body", "quota_active_jobs",
                            f"you have {active} jobs queued or running, the most allowed ({quotas.active_jobs}); "
                            "wait for one to finish or cancel one")


def check_training(session: Session, owner: Owner, quotas: Quotas) -> None:
    """QuotaExceeded when the owner already has ``active_trainings`` trainings queued or running."""
    active = count_owned(session, Training, owner.id, ACTIVE)
    if active >= quotas.active_trainings:
        raise QuotaExceeded("body", "quota_active_trainings",
                            f"you have {active} trainings queued or running, the most allowed "
                            f"({quotas.active_trainings}); wait for one to finish or cancel one")


def profile_size(profile: dict[str, Any], source: str) -> int:
    """Bytes of a stored profile: its compact JSON and its source text, UTF-8."""
    return len(json.dumps(profile, separators=(",", ":")).encode()) + len(source.encode())


def check_profile(session: Session, owner: Owner, quotas: Quotas, size: int) -> None:
    """QuotaExceeded when a profile of ``size`` bytes is larger than one may be, or the owner already
    stored ``profiles`` profiles."""
    if size > quotas.profile_bytes:
        raise QuotaExceeded("body", "quota_profile_bytes",
                            f"the profile takes {size} bytes as JSON, at most {quotas.profile_bytes} are stored")
    stored = count_owned(session, HardwareProfileRow, owner.id)
    if stored >= quotas.profiles:
        raise QuotaExceeded("body", "quota_profiles",
                            f"you have stored {stored} hardware profiles, the most allowed ({quotas.profiles})")
