import pytest

from db.engine import make_engine, make_sessionmaker
from db.testing import temporary_database


@pytest.fixture
def db_url(db_kind, tmp_path):
    """An empty (unmigrated) database URL of its own, once on SQLite and once in a private PostgreSQL schema:
    for the tests of the migrations themselves."""
    with temporary_database(db_kind, tmp_path) as url:
        yield url


@pytest.fixture
def engine(migrated_url):
    """An engine on a migrated database with no rows (``migrated_url``, tests/conftest.py)."""
    eng = make_engine(migrated_url)
    yield eng
    eng.dispose()


@pytest.fixture
def sessions(engine):
    return make_sessionmaker(engine)


@pytest.fixture
def add_jobs(sessions):
    """``add_jobs(count)`` inserts that many queued jobs of one owner; returns their ids in creation order."""
    return lambda count, owner_name="alice": _add_jobs(sessions, count, owner_name)


def _add_jobs(sessions, count, owner_name):
    from datetime import timedelta

    from db.keys import get_or_create_owner
    from db.models import Job, utcnow

    with sessions() as s:
        owner = get_or_create_owner(s, owner_name)
        t0 = utcnow()
        jobs = [Job(owner_id=owner.id, model_name="tiny-moe", model_spec={"name": "tiny-moe"},
                    training_spec={"seq_length": 64, "global_batch_size": 8}, cluster={"gpu": "cpu", "num_gpus": 2},
                    gpu_name="cpu", num_gpus=2, signature="sig", max_trials=4,
                    created_at=t0 + timedelta(microseconds=i)) for i in range(count)]
        s.add_all(jobs)
        s.commit()
        return [j.id for j in jobs]
