"""the Adam moments' dtypes move from stored training specs to the layout; training specs gain pad-to-capacity

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 12:00:00

The precision-aware optimizer's state dtypes are a layout knob (``ParallelConfig.exp_avg_dtype``,
``exp_avg_sq_dtype``, ``main_params_dtype``: searched by the planner, run by the executor), so TrainingSpec no
longer has ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (added by 0005); it gained ``moe_pad_expert_input_to_capacity``
(False). Every stored training spec (jobs and trainings) loses the two keys and gains the new one. A training's
layout (``trainings.config``) takes a moment dtype other than fp32 from its training spec, where it did not name
its own. A job has no layout: its question now covers every moment dtype the planner is asked to search. As in
0003 and 0005, a job's signature is the SHA-256 of the canonical JSON of its model spec, its stored training spec,
its GPU name and GPU count, so each rewritten job's signature is recomputed (written out here: a migration must
not change when the service's code does). Downgrade removes the new field and puts the two keys back: a job's at
fp32, a training's at its layout's moment dtypes, which leave its layout (that layout's three dtype fields with
them). A row that cannot be written without the new forms (padding to capacity; a layout's fp16 or fp8 state, or
master weights other than fp32: 0005's training spec knew fp32 and bf16 moments only) is left as it is.
"""

from __future__ import annotations

import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

MOVED = ("exp_avg_dtype", "exp_avg_sq_dtype")
ADDED = {"moe_pad_expert_input_to_capacity": False}


def _signature(model_spec: dict, training_spec: dict, gpu: str, num_gpus: int) -> str:
    canonical = json.dumps({"model": model_spec, "training": training_spec, "gpu": gpu, "num_gpus": num_gpus},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _json(value):
    return value if isinstance(value, dict) or value is None else json.loads(value)


def _rewrite_jobs(change) -> None:
    """Apply ``change(training_spec) -> new spec or None`` (None: leave the row) to every job, signature too."""
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("model_spec", sa.JSON),
                    sa.column("training_spec", sa.JSON), sa.column("gpu_name", sa.String),
                    sa.column("num_gpus", sa.Integer), sa.column("signature", sa.String))
    conn = op.get_bind()
    rows = conn.execute(sa.select(jobs.c.id, jobs.c.model_spec, jobs.c.training_spec, jobs.c.gpu_name,
                                  jobs.c.num_gpus)).all()
    for row in rows:
        training = change(dict(_json(row.training_spec)))
        if training is None:
            continue
        conn.execute(jobs.update().where(jobs.c.id == row.id).values(
            training_spec=training,
            signature=_signature(_json(row.model_spec), training, row.gpu_name, row.num_gpus)))


def _rewrite_trainings(change) -> None:
    """Apply ``change(training_spec, config) -> (spec, config) or None`` to every training."""
    trainings = sa.table("trainings", sa.column("id", sa.Integer), sa.column("training_spec", sa.JSON),
                         sa.column("config", sa.JSON))
    conn = op.get_bind()
    for row in conn.execute(sa.select(trainings.c.id, trainings.c.training_spec, trainings.c.config)).all():
        changed = change(dict(_json(row.training_spec) or {}), dict(_json(row.config) or {}))
        if changed is not None:
            conn.execute(trainings.update().where(trainings.c.id == row.id).values(
                training_spec=changed[0], config=changed[1]))


def _upgraded(spec: dict) -> dict | None:
    new = {k: v for k, v in spec.items() if k not in MOVED}
    new.update({k: v for k, v in ADDED.items() if k not in new})
    return None if new == spec else new


def upgrade() -> None:
    _rewrite_jobs(_upgraded)

    def training(spec: dict, config: dict):
        new = _upgraded(spec)
        if new is None:
            return None
        moved = {k: spec[k] for k in MOVED if spec.get(k, "fp32") != "fp32" and k not in config}
        return new, ({**config, **moved} if config else config)

    _rewrite_trainings(training)


def _downgraded(spec: dict, moments: dict) -> dict | None:
    if any(spec.get(k, v) != v for k, v in ADDED.items()):  # cannot be written without the field
        return None
    return {**{k: v for k, v in spec.items() if k not in ADDED}, **moments}


LAYOUT_FIELDS = MOVED + ("main_params_dtype",)


def downgrade() -> None:
    _rewrite_jobs(lambda spec: _downgraded(spec, {k: "fp32" for k in MOVED}))

    def training(spec: dict, config: dict):
        moments = {k: config.get(k, "fp32") for k in MOVED}
        if any(v not in ("fp32", "bf16") for v in moments.values()) or config.get("main_params_dtype", "fp32") != "fp32":
            return None
        new = _downgraded(spec, moments)
        return None if new is None else (new, {k: v for k, v in config.items() if k not in LAYOUT_FIELDS})

    _rewrite_trainings(training)
