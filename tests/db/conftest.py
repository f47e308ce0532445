import pytest

from db.engine import make_engine, make_sessionmaker
from db.migrate import upgrade
from db.testing import postgres_required, postgres_unavailable_reason, temporary_database


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    """An empty database URL, once on SQLite and once in a private PostgreSQL schema."""
    reason = postgres_unavailable_reason() if request.param == "postgres" else None
    if reason:
        if postgres_required():  # CI: the PostgreSQL half of the suite must run, not vanish as skips
            pytest.fail(f"{reason} (FOLDTUNE_REQUIRE_POSTGRES is set)")
        pytest.skip(reason)
    with temporary_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def engine(db_url):
    upgrade(db_url)
    eng = make_engine(db_url)
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
