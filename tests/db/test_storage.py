"""Keys, training metrics and Optuna's separate storage."""

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from db.keys import create_api_key, hash_token, owner_for_token, revoke_keys
from db.models import ApiKey, Training, TrainingMetric
from db.optuna_storage import ensure_optuna_storage, optuna_storage_url
from db.trainings import (expert_load_at, expert_loads_after, kept_layer_rows, record_expert_load,
                          record_training_metrics)
from spec.limits import MAX_EXPERT_LOAD_CELLS


def test_api_key_is_stored_hashed_and_resolves_to_its_owner(sessions):
    with sessions() as s:
        owner, token = create_api_key(s, "alice")
        assert token.startswith("ft_") and len(token) > 40
        stored = s.scalars(select(ApiKey.key_hash)).all()
        assert stored == [hash_token(token)] and token not in stored
        assert owner_for_token(s, token).id == owner.id
        assert owner_for_token(s, token + "x") is None
        assert revoke_keys(s, "alice") == 1
        assert owner_for_token(s, token) is None


def test_training_metrics_replace_repeated_steps(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        tr = Training(owner_id=1, job_id=job_id, config={}, model_spec={}, training_spec={}, cluster={},
                      data_path="/d", steps=5, checkpoint_dir="/c")
        s.add(tr)
        s.commit()
        record_training_metrics(s, tr.id, [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}])
        record_training_metrics(s, tr.id, [{"step": 2, "loss": 3.5, "expert_load_max": 9.0,
                                            "expert_load_mean": 4.0, "peak_memory_bytes": 2**33}])
        rows = s.scalars(select(TrainingMetric).order_by(TrainingMetric.step)).all()
        assert [(r.step, r.loss) for r in rows] == [(1, 5.0), (2, 3.5)]
        assert rows[1].peak_memory_bytes == 2**33
        with pytest.raises(ValueError, match="bogus"):
            record_training_metrics(s, tr.id, [{"step": 3, "bogus": 1}])


def test_kept_layer_rows_fit_the_cap_evenly_spaced():
    assert kept_layer_rows(4, 8, max_cells=64) == [0, 1, 2, 3]  # 32 counts fit
    assert kept_layer_rows(7, 8, max_cells=32) == [0, 2, 4, 6]  # 4 rows of 8: first, last and evenly between
    assert kept_layer_rows(10, 8, max_cells=24) == [0, 4, 9]    # round(4.5) = 4
    assert kept_layer_rows(3, 100, max_cells=50) == [0]         # one layer wider than the cap: that one alone
    assert kept_layer_rows(59, 256) == [round(i * 58 / 15) for i in range(16)]  # DeepSeek-V3 at the default cap
    assert len(kept_layer_rows(59, 256)) * 256 <= MAX_EXPERT_LOAD_CELLS


def test_expert_loads_replace_repeated_steps_and_stay_under_the_cap(sessions, add_jobs):
    (job_id,) = add_jobs(1)
    with sessions() as s:
        tr = Training(owner_id=1, job_id=job_id, config={}, model_spec={}, training_spec={}, cluster={},
                      data_path="/d", steps=5, checkpoint_dir="/c")
        s.add(tr)
        s.commit()
        record_expert_load(s, tr.id, 1, [0, 1], [[1, 2], [3, 0]])
        record_expert_load(s, tr.id, 2, [0, 1], [[2, 1], [1, 2]])
        record_expert_load(s, tr.id, 2, [0, 1], [[3, 0], [0, 3]])  # a resumed run measures step 2 again
        assert [(r.step, r.tokens) for r in expert_loads_after(s, tr.id, 0, 10)] == [(1, [[1, 2], [3, 0]]),
                                                                                   (2, [[3, 0], [0, 3]])]
        assert expert_load_at(s, tr.id).step == 2 and expert_load_at(s, tr.id, 1).tokens == [[1, 2], [3, 0]]
        assert expert_load_at(s, tr.id, 4) is None
        experts = 64
        layers = list(range(3, 3 + 2 * (MAX_EXPERT_LOAD_CELLS // experts) + 5))  # over the cap: thinned
        wide = record_expert_load(s, tr.id, 3, layers, [[i] * experts for i in layers])
        stored = expert_load_at(s, tr.id, 3)
        assert stored.moe_layers == len(layers) and len(stored.layers) * experts <= MAX_EXPERT_LOAD_CELLS
        assert stored.layers[0] == layers[0] and stored.layers[-1] == layers[-1] and wide.layers == stored.layers
        assert all(row == [n] * experts for n, row in zip(stored.layers, stored.tokens))  # rows keep their layers
        assert record_expert_load(s, tr.id, 4, [], []) is None  # a dense model stores nothing
        with pytest.raises(ValueError, match="2 layer numbers for 1 rows"):
            record_expert_load(s, tr.id, 5, [0, 1], [[1, 2]])


def test_optuna_storage_url_layout():
    assert optuna_storage_url("sqlite:////data/foldtune.sqlite3") == "sqlite:////data/foldtune-optuna.sqlite3"
    pg = optuna_storage_url("postgresql+psycopg://u@h/db")
    assert "search_path%3Doptuna" in pg or "search_path=optuna" in pg
    pinned = optuna_storage_url("postgresql+psycopg://u@h/db?options=-csearch_path%3Dmine")
    assert "mine_optuna" in pinned


def test_optuna_tables_stay_out_of_the_service_schema(engine, migrated_url):
    optuna = pytest.importorskip("optuna")
    storage_url = ensure_optuna_storage(migrated_url)
    storage = optuna.storages.RDBStorage(storage_url)
    study = optuna.create_study(storage=storage, study_name="job-1", direction="minimize")
    study.tell(study.ask(), 1.0)
    storage.engine.dispose()
    service_tables = set(sa.inspect(engine).get_table_names())
    assert "studies" not in service_tables and "alembic_version" not in service_tables
    other = sa.create_engine(storage_url)
    try:
        assert {"studies", "trials", "alembic_version"} <= set(sa.inspect(other).get_table_names())
    finally:
        other.dispose()
