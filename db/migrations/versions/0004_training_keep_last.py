"""trainings keep the newest N checkpoints

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 22:00:00

``trainings.keep_last``: how many complete checkpoints a training keeps (the newest; older ones are deleted
after each new one is complete). NULL, as every training stored before it, keeps them all.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('trainings') as batch:
        batch.add_column(sa.Column('keep_last', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('trainings') as batch:
        batch.drop_column('keep_last')
