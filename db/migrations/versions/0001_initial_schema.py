"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-26 01:23:43

Owners and API keys, jobs and trials, hardware profiles, trainings and their metrics. jobs.best_trial_id
and trials.job_id point at each other, so the former foreign key is added once both tables exist.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('owners',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_owners')),
    sa.UniqueConstraint('name', name=op.f('uq_owners_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('owner_id', sa.Integer(), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['owner_id'], ['owners.id'], name=op.f('fk_api_keys_owner_id_owners'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_owner_id'), ['owner_id'], unique=False)

    op.create_table('hardware_profiles',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('profile', JSON_TYPE, nullable=False),
    sa.Column('source', sa.String(length=64), nullable=False),
    sa.Column('owner_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['owners.id'], name=op.f('fk_hardware_profiles_owner_id_owners'),
                            ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hardware_profiles')),
    sa.UniqueConstraint('name', name=op.f('uq_hardware_profiles_name'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('owner_id', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=False),
    sa.Column('model_spec', JSON_TYPE, nullable=False),
    sa.Column('training_spec', JSON_TYPE, nullable=False),
    sa.Column('cluster', JSON_TYPE, nullable=False),
    sa.Column('gpu_name', sa.String(length=200), nullable=False),
    sa.Column('num_gpus', sa.Integer(), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('max_trials', sa.Integer(), nullable=False),
    sa.Column('max_seconds', sa.Float(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('claimed_by', sa.String(length=200), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('best_trial_id', sa.Integer(), nullable=True),
    sa.Column('calibration', JSON_TYPE, nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                       name=op.f('ck_jobs_status')),
    sa.CheckConstraint('max_trials >= 1', name=op.f('ck_jobs_max_trials')),
    sa.ForeignKeyConstraint(['owner_id'], ['owners.id'], name=op.f('fk_jobs_owner_id_owners'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('owner_id', 'idempotency_key', name=op.f('uq_jobs_owner_id_idempotency_key'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_owner_created', ['owner_id', 'created_at'], unique=False)
        batch_op.create_index('ix_jobs_owner_model', ['owner_id', 'model_name'], unique=False)
        batch_op.create_index('ix_jobs_owner_signature', ['owner_id', 'signature'], unique=False)
        batch_op.create_index('ix_jobs_owner_status', ['owner_id', 'status'], unique=False)
        batch_op.create_index('ix_jobs_queue', ['status', 'created_at'], unique=False)

    op.create_table('trainings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('owner_id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('config', JSON_TYPE, nullable=False),
    sa.Column('model_spec', JSON_TYPE, nullable=False),
    sa.Column('training_spec', JSON_TYPE, nullable=False),
    sa.Column('cluster', JSON_TYPE, nullable=False),
    sa.Column('data_path', sa.Text(), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('checkpoint_dir', sa.Text(), nullable=False),
    sa.Column('checkpoint_every', sa.Integer(), nullable=True),
    sa.Column('predicted_step_time_s', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('claimed_by', sa.String(length=200), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                       name=op.f('ck_trainings_status')),
    sa.CheckConstraint('steps >= 1', name=op.f('ck_trainings_steps')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_trainings_job_id_jobs'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['owner_id'], ['owners.id'], name=op.f('fk_trainings_owner_id_owners'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trainings'))
    )
    with op.batch_alter_table('trainings', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trainings_job_id'), ['job_id'], unique=False)
        batch_op.create_index('ix_trainings_owner_created', ['owner_id', 'created_at'], unique=False)
        batch_op.create_index('ix_trainings_queue', ['status', 'created_at'], unique=False)

    op.create_table('trials',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('config', JSON_TYPE, nullable=False),
    sa.Column('label', sa.String(length=300), nullable=True),
    sa.Column('predicted', JSON_TYPE, nullable=True),
    sa.Column('predicted_step_time_s', sa.Float(), nullable=True),
    sa.Column('measurement', JSON_TYPE, nullable=True),
    sa.Column('step_time_s', sa.Float(), nullable=True),
    sa.Column('failure_kind', sa.String(length=32), nullable=True),
    sa.Column('failure_reason', sa.Text(), nullable=True),
    sa.Column('runner_id', sa.String(length=200), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('running', 'succeeded', 'pruned', 'failed')", name=op.f('ck_trials_status')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_trials_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trials')),
    sa.UniqueConstraint('job_id', 'number', name=op.f('uq_trials_job_id_number'))
    )
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.create_index('ix_trials_job_status_time', ['job_id', 'status', 'step_time_s'], unique=False)
        batch_op.create_index('ix_trials_status_heartbeat', ['status', 'heartbeat_at'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f('fk_jobs_best_trial_id_trials'), 'trials', ['best_trial_id'], ['id'],
                                    ondelete='SET NULL')

    op.create_table('training_metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('training_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('eval_loss', sa.Float(), nullable=True),
    sa.Column('lr', sa.Float(), nullable=True),
    sa.Column('grad_norm', sa.Float(), nullable=True),
    sa.Column('step_time_s', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=True),
    sa.Column('tflops_per_gpu', sa.Float(), nullable=True),
    sa.Column('mfu', sa.Float(), nullable=True),
    sa.Column('peak_memory_bytes', sa.BigInteger(), nullable=True),
    sa.Column('expert_load_max', sa.Float(), nullable=True),
    sa.Column('expert_load_mean', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['training_id'], ['trainings.id'], name=op.f('fk_training_metrics_training_id_trainings'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_training_metrics')),
    sa.UniqueConstraint('training_id', 'step', name=op.f('uq_training_metrics_training_id_step'))
    )


def downgrade() -> None:
    op.drop_table('training_metrics')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_jobs_best_trial_id_trials'), type_='foreignkey')
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_index('ix_trials_status_heartbeat')
        batch_op.drop_index('ix_trials_job_status_time')

    op.drop_table('trials')
    with op.batch_alter_table('trainings', schema=None) as batch_op:
        batch_op.drop_index('ix_trainings_queue')
        batch_op.drop_index('ix_trainings_owner_created')
        batch_op.drop_index(batch_op.f('ix_trainings_job_id'))

    op.drop_table('trainings')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_queue')
        batch_op.drop_index('ix_jobs_owner_status')
        batch_op.drop_index('ix_jobs_owner_signature')
        batch_op.drop_index('ix_jobs_owner_model')
        batch_op.drop_index('ix_jobs_owner_created')

    op.drop_table('jobs')
    op.drop_table('hardware_profiles')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_owner_id'))

    op.drop_table('api_keys')
    op.drop_table('owners')
