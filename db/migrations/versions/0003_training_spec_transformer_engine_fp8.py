"""stored training specs gain transformer_engine_fp8; job signatures recomputed

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28 00:00:00

TrainingSpec gained ``transformer_engine_fp8`` (default False). A job's signature is the SHA-256 of the
canonical JSON of its model spec, its stored training spec, its GPU name and GPU count, and a new request's
training spec now carries the field: without this migration a job stored before it would never again share a
signature with the same question asked after it (``GET /best`` would not find it), and a retried idempotent
request would read as a different one. Each stored training spec without the field gets it at its default and
its job's signature is recomputed as api/service/jobs.py computes it (written out here: a migration must not
change when that code does). Downgrade removes the field again and restores the old signatures.
"""

from __future__ import annotations

import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

FIELD = "transformer_engine_fp8"
DEFAULT = False


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
        training = change(dict(row.training_spec))
        if training is None:
            continue
        conn.execute(jobs.update().where(jobs.c.id == row.id).values(
            training_spec=training, signature=_signature(row.model_spec, training, row.gpu_name, row.num_gpus)))


def upgrade() -> None:
    _rewrite(lambda spec: None if FIELD in spec else {**spec, FIELD: DEFAULT})


def downgrade() -> None:
    def drop(spec: dict) -> dict | None:
        if spec.get(FIELD, DEFAULT) != DEFAULT:  # a spec that needs the field cannot be written without it
            return None
        return {k: v for k, v in spec.items() if k != FIELD}

    _rewrite(drop)
