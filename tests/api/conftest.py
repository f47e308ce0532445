import copy
import shutil

import pytest
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.http.settings import ApiSettings
from db.keys import create_api_key
from db.migrate import upgrade
from db.testing import postgres_required, postgres_unavailable_reason, temporary_database
from service_env import ROOMY, auth, live_server

JOB = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
       "cluster": {"gpu": "cpu", "num_gpus": 4}, "budget": {"max_trials": 6, "max_seconds": 600}}


@pytest.fixture
def job_body():
    """A valid POST /v1/jobs body (a fresh copy per test)."""
    return copy.deepcopy(JOB)


@pytest.fixture
def data_root(tmp_path):
    """The test service's FOLDTUNE_DATA_ROOT: owner ``alice``'s server paths lie in ``data_root / "alice"``."""
    root = tmp_path / "data-root"
    root.mkdir()
    return root


@pytest.fixture
def training_body(data_root):
    """A valid POST /v1/trainings body for alice (tiny-moe on 2 CPU ranks, an existing data directory in her
    own directory under the data root)."""
    data = data_root / "alice" / "data"
    data.mkdir(parents=True)
    return {"layout": "tp1 ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": 64, "global_batch_size": 8, "data_path": str(data), "steps": 20,
            "checkpoint_dir": str(data_root / "alice" / "ckpt")}


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory):
    """A SQLite file migrated once per session; copying it is faster than migrating every test's database."""
    path = tmp_path_factory.mktemp("template") / "foldtune.sqlite3"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path, sqlite_template):
    """A migrated database of its own, once SQLite and once a private PostgreSQL schema."""
    reason = postgres_unavailable_reason() if request.param == "postgres" else None
    if reason:
        if postgres_required():  # CI: the PostgreSQL half of the suite must run, not vanish as skips
            pytest.fail(f"{reason} (FOLDTUNE_REQUIRE_POSTGRES is set)")
        pytest.skip(reason)
    with temporary_database(request.param, tmp_path) as url:
        if request.param == "sqlite":
            shutil.copyfile(sqlite_template, tmp_path / "foldtune.sqlite3")
        else:
            upgrade(url)
        yield url


@pytest.fixture
def app(db_url, data_root):
    application = create_app(ApiSettings(database_url=db_url, data_root=data_root, **ROOMY), migrate=True)
    yield application
    application.state.engine.dispose()


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def keys(app):
    """API keys of two owners: {'alice': token, 'bob': token}."""
    with app.state.sessions() as session:
        return {name: create_api_key(session, name)[1] for name in ("alice", "bob")}


@pytest.fixture
def alice(keys):
    return auth(keys["alice"])


@pytest.fixture
def bob(keys):
    return auth(keys["bob"])


@pytest.fixture
def server_url(app):
    with live_server(app) as url:
        yield url
