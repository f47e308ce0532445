"""trainings keep each step's routed tokens per MoE layer and expert

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 06:00:00

``training_expert_loads``: one row per stored optimizer step of a training, the routed tokens of each expert
in each MoE layer (``tokens`` [layers][experts], ``layers`` their decoder layer numbers, ``moe_layers`` how
many the model has). Trainings stored before it have none; their per-step max/mean (``training_metrics``) stay.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        'training_expert_loads',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('training_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('moe_layers', sa.Integer(), nullable=False),
        sa.Column('layers', JSON_TYPE, nullable=False),
        sa.Column('tokens', JSON_TYPE, nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['training_id'], ['trainings.id'],
                                name=op.f('fk_training_expert_loads_training_id_trainings'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_training_expert_loads')),
        sa.UniqueConstraint('training_id', 'step', name=op.f('uq_training_expert_loads_training_id_step')),
    )


def downgrade() -> None:
    op.drop_table('training_expert_loads')
