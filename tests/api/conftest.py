import contextlib
import copy

import pytest
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.http.settings import ApiSettings
from db.keys import create_api_key
from db.testing import temporary_postgres_schema
from service_env import ROOMY, auth, live_server
from tests.databases import copy_sqlite, database_kind

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


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.slow])])
def db_kind(request, postgres_reason) -> str:
    """As tests/conftest.py's, but the API's PostgreSQL half is in the whole suite only: the fast tier serves
    the API on SQLite, and tests/db checks the database layer on both."""
    return database_kind(request, postgres_reason)


@pytest.fixture
def db_url(migrated_url):
    """A migrated database with no rows, once SQLite and once PostgreSQL (``migrated_url``, tests/conftest.py)."""
    return migrated_url


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


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres,
                                                                                   pytest.mark.slow])])
def refused(request, postgres_reason, sqlite_template, tmp_path_factory):
    """(client, alice's headers, data root) of one API per database kind and test module, shared by the tests
    whose requests are all refused (nothing they send is stored): one app and one migration for them all instead
    of one per test. PostgreSQL: a schema of its own, so that the per-test emptying of the session's schema
    leaves it alone."""
    kind = database_kind(request, postgres_reason)
    with contextlib.ExitStack() as stack:
        root = tmp_path_factory.mktemp("refused")
        if kind == "sqlite":
            url = copy_sqlite(sqlite_template, root)
        else:
            url = stack.enter_context(temporary_postgres_schema())
        app = create_app(ApiSettings(database_url=url, data_root=root / "data-root", **ROOMY), migrate=True)
        stack.callback(app.state.engine.dispose)
        client = stack.enter_context(TestClient(app))
        with app.state.sessions() as session:
            token = create_api_key(session, "alice")[1]
        yield client, auth(token), root / "data-root"
