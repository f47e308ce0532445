"""stored training specs gain the Megatron memory knobs; job signatures recomputed

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 12:00:00

TrainingSpec gained ``fp8_recipe`` ('tensorwise'), ``fp8_param_gather`` (False), ``exp_avg_dtype`` and
``exp_avg_sq_dtype`` ('fp32'), ``cross_entropy_fusion_impl`` ('native') and ``megatron_memory`` (False). As in
0003: a job's signature is the SHA-256 of the canonical JSON of its model spec, its stored training spec, its GPU
name and GPU count, and a new request's training spec carries the new fields, so each stored training spec
without them gets them at their defaults and its job's signature is recomputed (written out here: a migration
must not change when the service's code does). Downgrade removes the fields again (a spec that set one away
from its default is left as it is) and restores the old signatures.
"""

from __future__ import annotations

import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

DEFAULTS = {"fp8_recipe": "tensorwise", "fp8_param_gather": False, "exp_avg_dtype": "fp32",
            "exp_avg_sq_dtype": "fp32", "cross_entropy_fusion_impl": "native", "megatron_memory": False}


def _signature(model_spec: dict, training_spec: dict, gpu: str, num_gpus: int) -> str:
    canonical = json.dumps({"model": model_spec, "training": training_spec, "gpu": gpu, "num_gpus": num_gpus},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _jobs() -> sa.Table:
    return sa.table("jobs", sa.column("id", sa.Integer), sa.column("model_spec", sa.JSON),
                    sa.column("training_spec", sa.JSON), sa.column("gpu_name", sa.String),
                    sa.column("num_gpus", sa.Integer), sa.column("signature", sa.String))


def _rewrite(change) -> None:
    """Apply ``change(training_spec) -> new spec or None`` (None: leave the row) to every job, signature too."""
    jobs = _jobs()
    conn = op.get_bind()
    rows = conn.execute(sa.select(jobs.c.id, jobs.c.model_spec, jobs.c.training_spec, jobs.c.gpu_name,
                                  jobs.c.num_gpus)).all()
    for row in rows:
        spec = row.training_spec if isinstance(row.training_spec, dict) else json.loads(row.training_spec)
        training = change(dict(spec))
        if training is None:
            continue
        conn.execute(jobs.update().where(jobs.c.id == row.id).values(
            training_spec=training, signature=_signature(row.model_spec, training, row.gpu_name, row.num_gpus)))


def upgrade() -> None:
    def add(spec: dict) -> dict | None:
        missing = {k: v for k, v in DEFAULTS.items() if k not in spec}
        return {**spec, **missing} if missing else None

    _rewrite(add)


def downgrade() -> None:
    def drop(spec: dict) -> dict | None:
        if any(spec.get(k, v) != v for k, v in DEFAULTS.items()):  # cannot be written without the fields
            return None
        return {k: v for k, v in spec.items() if k not in DEFAULTS}

    _rewrite(drop)
