"""Migrations build the schema from nothing on SQLite and PostgreSQL, match the models, and go back down."""

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from db.engine import make_engine
from db.migrate import VERSION_TABLE, current_revision, downgrade, head_revision, upgrade
from db.models import Base

TABLES = {"owners", "api_keys", "jobs", "trials", "hardware_profiles", "trainings", "training_metrics"}


def test_upgrade_from_empty_creates_every_table_and_own_version_table(db_url):
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        names = set(sa.inspect(engine).get_table_names())
        assert TABLES | {VERSION_TABLE} <= names
        assert "alembic_version" not in names  # Optuna's name stays free
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_models_and_migrations_agree(db_url):
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models differ from migrations: {diff}"
    finally:
        engine.dispose()


def test_downgrade_to_base_and_up_again(db_url):
    upgrade(db_url)
    downgrade(db_url, "base")
    engine = make_engine(db_url)
    try:
        assert not TABLES & set(sa.inspect(engine).get_table_names())
        upgrade(db_url)
        assert TABLES <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_is_idempotent(db_url):
    upgrade(db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
