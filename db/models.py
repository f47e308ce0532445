"""SQLAlchemy models of the service database: owners and API keys, tuning jobs and their trials,
hardware profiles, trainings with their per-step metrics and per-layer expert loads.

Specs are stored as JSON snapshots (``ModelSpec.to_dict()`` etc.) so a job keeps meaning the same thing
after the catalog changes. Times are timezone-aware UTC on the Python side on both databases.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON, BigInteger, CheckConstraint, DateTime, Float, ForeignKey, Index, Integer, MetaData, String, Text,
    TypeDecorator, UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
# tune: search layouts by measured trials; verify: check a plan's top layouts by one-rank slices
JOB_KINDS = ("tune", "verify")
FINISHED_JOB_STATUSES = ("succeeded", "failed", "cancelled")
TRIAL_STATUSES = ("running", "succeeded", "pruned", "failed")
TRAINING_STATUSES = JOB_STATUSES


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """A timestamp that always comes back timezone-aware in UTC (SQLite stores it naive, in UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC time")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


JSONType = JSON().with_variant(JSONB(), "postgresql")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class QueuedWork:
    """Columns of anything a runner claims from the queue (jobs, trainings): when it was created,
    started and finished, why it failed, which runner holds it and when that runner last said so, and
    how many times it was claimed."""

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)


class Owner(Base):
    """Whoever submits jobs; every job, training and API key belongs to one owner."""

    __tablename__ = "owners"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """An API key, stored as the SHA-256 of the token; the token itself is shown once and never stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("owners.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # first characters of the token, to tell keys apart
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Job(QueuedWork, Base):
    """A job about one model on one cluster for one training recipe: a tuning job (``kind`` 'tune') finds the
    fastest folded layout by measured trials; a verify job ('verify') checks the plan's top layouts by one-rank
    slices (``verify`` holds what it was asked, ``report`` what it found; it has no trials).

    ``signature`` is the SHA-256 of the canonical JSON of (model spec, training spec, gpu, num_gpus); jobs
    with the same signature answer the same question, which is what ``GET /best`` groups by.
    ``claimed_by``/``heartbeat_at`` belong to the runner executing it; ``attempts`` counts claims.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("status", JOB_STATUSES), name="status"),
        CheckConstraint(_in("kind", JOB_KINDS), name="kind"),
        CheckConstraint("max_trials >= 1", name="max_trials"),
        UniqueConstraint("owner_id", "idempotency_key"),
        Index("ix_jobs_owner_created", "owner_id", "created_at"),
        Index("ix_jobs_owner_status", "owner_id", "status"),
        Index("ix_jobs_owner_model", "owner_id", "model_name"),
        Index("ix_jobs_owner_signature", "owner_id", "signature"),
        Index("ix_jobs_queue", "status", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("owners.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default="queued")  # one of JOB_STATUSES
    model_name: Mapped[str] = mapped_column(String(200))
    model_spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    training_spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    cluster: Mapped[dict[str, Any]] = mapped_column(JSONType)  # {"gpu", "num_gpus", "hardware": profile dict}
    gpu_name: Mapped[str] = mapped_column(String(200))
    num_gpus: Mapped[int] = mapped_column(Integer)
    signature: Mapped[str] = mapped_column(String(64))
    max_trials: Mapped[int] = mapped_column(Integer)
    max_seconds: Mapped[float | None] = mapped_column(Float)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    best_trial_id: Mapped[int | None] = mapped_column(
        ForeignKey("trials.id", ondelete="SET NULL", use_alter=True))
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # what the search learned
    kind: Mapped[str] = mapped_column(String(16), default="tune", server_default="tune")  # one of JOB_KINDS
    verify: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # a verify job's request (top, slice GPU, ...)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # a verify job's report (planner.verify)


class Trial(Base):
    """One measured (or attempted) layout of a job, numbered as its Optuna trial.

    ``predicted`` is the cost model's breakdown, ``measurement`` the executor's Measurement as a dict;
    ``step_time_s`` (seconds) is copied out of it so the best trial is one indexed query.
    ``failure_kind`` is a short machine word (oom, crash, timeout, lost, ...), ``failure_reason`` the
    readable line.
    """

    __tablename__ = "trials"
    __table_args__ = (
        CheckConstraint(_in("status", TRIAL_STATUSES), name="status"),
        UniqueConstraint("job_id", "number"),
        Index("ix_trials_job_status_time", "job_id", "status", "step_time_s"),
        Index("ix_trials_status_heartbeat", "status", "heartbeat_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="running")
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)  # ParallelConfig.to_dict()
    label: Mapped[str | None] = mapped_column(String(300))  # ParallelConfig.label()
    predicted: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    predicted_step_time_s: Mapped[float | None] = mapped_column(Float)
    measurement: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    failure_kind: Mapped[str | None] = mapped_column(String(32))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    runner_id: Mapped[str | None] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    @property
    def precision(self) -> str | None:
        """The training precision the trial ran at: its own (kept in ``predicted`` when the job searched
        precision), else the executor's measurement's; None when neither says (no migration: both are JSON)."""
        return (self.predicted or {}).get("precision") or (self.measurement or {}).get("precision")


class HardwareProfileRow(Base):
    """A named HardwareProfile (``HardwareProfile.to_dict()``), e.g. measured by ``foldtune calibrate``."""

    __tablename__ = "hardware_profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    profile: Mapped[dict[str, Any]] = mapped_column(JSONType)
    source: Mapped[str] = mapped_column(Text)  # calibrate writes a sentence (device, time, method)
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("owners.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Training(QueuedWork, Base):
    """A full training run of one layout (from a job's best trial or given explicitly)."""

    __tablename__ = "trainings"
    __table_args__ = (
        CheckConstraint(_in("status", TRAINING_STATUSES), name="status"),
        CheckConstraint("steps >= 1", name="steps"),
        Index("ix_trainings_owner_created", "owner_id", "created_at"),
        Index("ix_trainings_queue", "status", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("owners.id", ondelete="CASCADE"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)  # ParallelConfig.to_dict()
    model_spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    training_spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    cluster: Mapped[dict[str, Any]] = mapped_column(JSONType)
    data_path: Mapped[str] = mapped_column(Text)
    steps: Mapped[int] = mapped_column(Integer)
    checkpoint_dir: Mapped[str] = mapped_column(Text)
    checkpoint_every: Mapped[int | None] = mapped_column(Integer)
    keep_last: Mapped[int | None] = mapped_column(Integer)  # newest complete checkpoints kept; NULL/0: all
    predicted_step_time_s: Mapped[float | None] = mapped_column(Float)


class TrainingMetric(Base):
    """One optimizer step of a training: loss, schedule, speed, memory and expert load (max/mean tokens)."""

    __tablename__ = "training_metrics"
    __table_args__ = (UniqueConstraint("training_id", "step"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    training_id: Mapped[int] = mapped_column(ForeignKey("trainings.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    eval_loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    tflops_per_gpu: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    expert_load_max: Mapped[float | None] = mapped_column(Float)
    expert_load_mean: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TrainingExpertLoad(Base):
    """The routed tokens of each expert in each MoE layer at one optimizer step of a training, summed over the
    step's global batch (each row: global batch tokens × top-k). ``layers``: the decoder layer numbers (0-based;
    head blocks such as MTP numbered on from the last decoder layer) of the rows kept in ``tokens``
    [rows][experts]; ``moe_layers``: how many MoE layers the model has. db.trainings keeps at most
    ``spec.limits.MAX_EXPERT_LOAD_CELLS`` counts a step (evenly spaced layers of a wider model)."""

    __tablename__ = "training_expert_loads"
    __table_args__ = (UniqueConstraint("training_id", "step"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    training_id: Mapped[int] = mapped_column(ForeignKey("trainings.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    moe_layers: Mapped[int] = mapped_column(Integer)
    layers: Mapped[list[int]] = mapped_column(JSONType)
    tokens: Mapped[list[list[int]]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
