"""hardware profile source as text

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26 06:15:00

The source line `foldtune calibrate` writes ("calibrated <time> on 4x NVIDIA H200 (nccl, bf16)", plus where
component factors came from) outgrows 64 characters; PostgreSQL refused it with a 500.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('hardware_profiles') as batch:
        batch.alter_column('source', existing_type=sa.String(length=64), type_=sa.Text(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('hardware_profiles') as batch:
        batch.alter_column('source', existing_type=sa.Text(), type_=sa.String(length=64), existing_nullable=False)
