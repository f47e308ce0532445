"""Migrations build the schema from nothing on SQLite and PostgreSQL, match the models, go back down, and carry
stored rows across a change of what they must hold."""

import hashlib
import json

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from db.engine import make_engine
from db.migrate import VERSION_TABLE, current_revision, downgrade, head_revision, upgrade
from db.models import Base
from api.service.jobs import job_signature
from spec.training_spec import TrainingSpec

TABLES = {"owners", "api_keys", "jobs", "trials", "hardware_profiles", "trainings", "training_metrics",
          "training_expert_loads"}
#: the TrainingSpec fields migration 0005 adds (a job stored before it has none of them)
ADDED_0005 = ("fp8_recipe", "fp8_param_gather", "exp_avg_dtype", "exp_avg_sq_dtype", "cross_entropy_fusion_impl",
              "megatron_memory")
#: the TrainingSpec field migration 0008 adds (it also moves 0005's exp_avg_dtype / exp_avg_sq_dtype to the layout)
ADDED_0008 = ("moe_pad_expert_input_to_capacity",)


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


def _insert_old_job(engine, training_spec: dict, signature: str) -> None:
    now = "2026-11-27 12:00:00+00:00"
    model = {"name": "tiny-moe", "num_layers": 2}
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO owners (id, name, created_at) VALUES (1, 'alice', :now)"), {"now": now})
        jobs = sa.table("jobs", *(sa.column(c) for c in (
            "id", "owner_id", "status", "model_name", "gpu_name", "num_gpus", "signature", "max_trials", "created_at",
            "updated_at", "attempts")), *(sa.column(c, sa.JSON) for c in ("model_spec", "training_spec", "cluster")))
        conn.execute(jobs.insert().values(
            id=7, owner_id=1, status="succeeded", model_name="tiny-moe", model_spec=model, training_spec=training_spec,
            cluster={"gpu": "cpu", "num_gpus": 2}, gpu_name="cpu", num_gpus=2, signature=signature, max_trials=2,
            created_at=now, updated_at=now, attempts=1))


def test_0003_gives_stored_training_specs_the_new_field_and_the_signature_new_requests_get(db_url):
    """A job stored at 0002 (its training spec without transformer_engine_fp8) shares its signature, after the
    upgrade, with the same question asked now — the service's job_signature over TrainingSpec.to_dict() — and
    downgrading restores both."""
    old_spec = {k: v for k, v in TrainingSpec(seq_length=64, global_batch_size=8).to_dict().items()
                if k != "transformer_engine_fp8" and k not in ADDED_0005 + ADDED_0008}
    model = {"name": "tiny-moe", "num_layers": 2}
    canonical = json.dumps({"model": model, "training": old_spec, "gpu": "cpu", "num_gpus": 2}, sort_keys=True,
                           separators=(",", ":"))
    old_signature = hashlib.sha256(canonical.encode()).hexdigest()
    upgrade(db_url, "0002")
    engine = make_engine(db_url)
    try:
        _insert_old_job(engine, old_spec, old_signature)
        upgrade(db_url)

        def stored():
            with engine.connect() as conn:
                row = conn.execute(sa.text("SELECT training_spec, signature FROM jobs WHERE id = 7")).one()
            spec = row.training_spec if isinstance(row.training_spec, dict) else json.loads(row.training_spec)
            return spec, row.signature

        spec, signature = stored()
        now = TrainingSpec(seq_length=64, global_batch_size=8).to_dict()
        assert spec == now and spec["transformer_engine_fp8"] is False
        assert signature == job_signature(model, now, "cpu", 2) != old_signature
        downgrade(db_url, "0002")
        assert stored() == (old_spec, old_signature)
    finally:
        engine.dispose()


def test_0005_gives_stored_training_specs_the_megatron_memory_knobs_and_the_signature_new_requests_get(db_url):
    """A job stored at 0004 (its training spec without the Megatron memory knobs) shares its signature, after the
    upgrade, with the same question asked now, and downgrading to 0004 restores both."""
    old_spec = {k: v for k, v in TrainingSpec(seq_length=64, global_batch_size=8).to_dict().items()
                if k not in ADDED_0005 + ADDED_0008}
    model = {"name": "tiny-moe", "num_layers": 2}
    canonical = json.dumps({"model": model, "training": old_spec, "gpu": "cpu", "num_gpus": 2}, sort_keys=True,
                           separators=(",", ":"))
    old_signature = hashlib.sha256(canonical.encode()).hexdigest()
    upgrade(db_url, "0004")
    engine = make_engine(db_url)
    try:
        _insert_old_job(engine, old_spec, old_signature)
        upgrade(db_url)

        def stored():
            with engine.connect() as conn:
                row = conn.execute(sa.text("SELECT training_spec, signature FROM jobs WHERE id = 7")).one()
            spec = row.training_spec if isinstance(row.training_spec, dict) else json.loads(row.training_spec)
            return spec, row.signature

        spec, signature = stored()
        now = TrainingSpec(seq_length=64, global_batch_size=8).to_dict()
        assert spec == now and spec["fp8_recipe"] == "tensorwise" and spec["megatron_memory"] is False
        assert signature == job_signature(model, now, "cpu", 2) != old_signature
        downgrade(db_url, "0004")
        assert stored() == (old_spec, old_signature)
    finally:
        engine.dispose()


def test_0008_moves_the_moment_dtypes_to_the_layout_and_gives_the_new_signature(db_url):
    """A job and a training stored at 0007 with bf16 Adam moments in their training specs: after the upgrade the
    job's spec is the one a request makes now (no moment dtypes, pad-to-capacity off) under the signature the
    service computes, and the training's layout holds the moments (it reads back as a ParallelConfig with them);
    downgrading to 0007 restores the training and gives the job fp32 moments (a job has no layout to have kept
    them in) under that spec's signature."""
    from spec.parallel_config import ParallelConfig

    now = TrainingSpec(seq_length=64, global_batch_size=8).to_dict()
    old_spec = {**{k: v for k, v in now.items() if k not in ADDED_0008}, "exp_avg_dtype": "bf16",
                "exp_avg_sq_dtype": "bf16"}
    model = {"name": "tiny-moe", "num_layers": 2}
    canonical = json.dumps({"model": model, "training": old_spec, "gpu": "cpu", "num_gpus": 2}, sort_keys=True,
                           separators=(",", ":"))
    old_signature = hashlib.sha256(canonical.encode()).hexdigest()
    old_config = {k: v for k, v in ParallelConfig(world_size=2).to_dict().items()
                  if k not in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")}
    upgrade(db_url, "0007")
    engine = make_engine(db_url)
    try:
        _insert_old_job(engine, old_spec, old_signature)
        stamp = "2026-12-02 12:00:00+00:00"
        with engine.begin() as conn:
            trainings = sa.table("trainings", *(sa.column(c) for c in (
                "id", "owner_id", "status", "data_path", "steps", "checkpoint_dir", "created_at", "updated_at",
                "attempts")), *(sa.column(c, sa.JSON) for c in ("config", "model_spec", "training_spec", "cluster")))
            conn.execute(trainings.insert().values(
                id=3, owner_id=1, status="queued", data_path="d", steps=2, checkpoint_dir="c", created_at=stamp,
                updated_at=stamp, attempts=0, config=old_config, model_spec=model, training_spec=old_spec,
                cluster={}))
        upgrade(db_url)

        def stored():
            with engine.connect() as conn:
                job = conn.execute(sa.text("SELECT training_spec, signature FROM jobs WHERE id = 7")).one()
                run = conn.execute(sa.text("SELECT training_spec, config FROM trainings WHERE id = 3")).one()
            load = lambda v: v if isinstance(v, dict) else json.loads(v)  # noqa: E731
            return load(job.training_spec), job.signature, load(run.training_spec), load(run.config)

        spec, signature, run_spec, config = stored()
        assert spec == run_spec == now and "exp_avg_dtype" not in spec
        assert signature == job_signature(model, now, "cpu", 2) != old_signature
        layout = ParallelConfig.from_dict(config)
        assert layout.optimizer_dtypes == ("bf16", "bf16", "fp32") and TrainingSpec.from_dict(run_spec)
        downgrade(db_url, "0007")
        fp32 = {**old_spec, "exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"}
        assert stored() == (fp32, job_signature(model, fp32, "cpu", 2), old_spec, old_config)
    finally:
        engine.dispose()


def _revision_before(file_suffix: str) -> str:
    """The revision a migration (named by its file's ending) upgrades from."""
    from alembic.script import ScriptDirectory

    from db.migrate import alembic_config

    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    [script] = [s for s in scripts.walk_revisions() if s.path.endswith(file_suffix)]
    return script.down_revision


def test_expert_loads_migration_adds_and_drops_its_table_keeping_the_trainings(db_url):
    """From the revision before it to head creates training_expert_loads beside a training stored before it; the
    model's rows go in and read back; back down drops the table alone (the training and its metrics stay)."""
    from db.engine import make_sessionmaker
    from db.trainings import expert_load_at, record_expert_load, record_training_metrics

    before = _revision_before("_training_expert_loads.py")
    upgrade(db_url, before)
    engine = make_engine(db_url)
    try:
        assert "training_expert_loads" not in sa.inspect(engine).get_table_names()
        now = "2026-12-01 12:00:00+00:00"
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO owners (id, name, created_at) VALUES (1, 'alice', :now)"), {"now": now})
            trainings = sa.table("trainings", *(sa.column(c) for c in (
                "id", "owner_id", "status", "data_path", "steps", "checkpoint_dir", "created_at", "updated_at",
                "attempts")), *(sa.column(c, sa.JSON) for c in ("config", "model_spec", "training_spec", "cluster")))
            conn.execute(trainings.insert().values(
                id=3, owner_id=1, status="succeeded", data_path="d", steps=2, checkpoint_dir="c", created_at=now,
                updated_at=now, attempts=1, config={}, model_spec={}, training_spec={}, cluster={}))
        upgrade(db_url)
        assert "training_expert_loads" in sa.inspect(engine).get_table_names()
        with make_sessionmaker(engine)() as s:
            record_training_metrics(s, 3, [{"step": 1, "loss": 2.0}])
            record_expert_load(s, 3, 1, [0, 1], [[3, 5, 0, 8], [4, 4, 4, 4]])
            stored = expert_load_at(s, 3)
            assert (stored.step, stored.layers, stored.tokens, stored.moe_layers) == (
                1, [0, 1], [[3, 5, 0, 8], [4, 4, 4, 4]], 2)
        engine.dispose()
        downgrade(db_url, before)
        names = set(sa.inspect(engine).get_table_names())
        assert "training_expert_loads" not in names and {"trainings", "training_metrics"} <= names
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM training_metrics WHERE training_id = 3")).scalar() == 1
        upgrade(db_url)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
