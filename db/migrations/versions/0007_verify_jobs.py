"""verify jobs: a job kind, its request and its report

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 05:00:00

``jobs.kind``: 'tune' (every job stored before it) or 'verify' (the plan's top layouts checked by one-rank
slices); ``jobs.verify``: a verify job's request (how many layouts, the slices' hardware and layers, the skewed
routing's hot expert); ``jobs.report``: what a verify job found, per layout and term.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('kind', sa.String(length=16), nullable=False, server_default='tune'))
        batch.add_column(sa.Column('verify', JSON_TYPE, nullable=True))
        batch.add_column(sa.Column('report', JSON_TYPE, nullable=True))
        batch.create_check_constraint(op.f('ck_jobs_kind'), "kind IN ('tune', 'verify')")


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_constraint(op.f('ck_jobs_kind'), type_='check')
        batch.drop_column('report')
        batch.drop_column('verify')
        batch.drop_column('kind')
