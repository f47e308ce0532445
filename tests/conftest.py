import gc
import importlib.util
import os
import shutil
import site
import tempfile
import uuid
from pathlib import Path

import pytest

from db.migrate import upgrade
from db.testing import postgres_unavailable_reason, temporary_postgres_schema
from tests.databases import copy_sqlite, database_kind, empty_postgres_schema, migrate_schema
from tests.executor.triton_child import INNER, MARK, ChildRun, InterpreterChild
from suite_env import foreign_foldtune_variables

# The suite's Ray instances run without Ray's token authentication: every test process shares one local Ray
# (tests/api/runner_env.py) and the runner subprocesses join it by address. Where the environment does not
# say otherwise; one test turns it on (tests/api/test_runner_sigterm.py: a runner whose own Ray has auth),
# and tests/executor/test_ray_auth.py covers the token file. See docs/deploy.md, "Ray token authentication".
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Marks every process this test session starts (Ray's included: they inherit the environment), so that the
# checks for leftover processes count this session's, not those of other test runs on a shared machine.
# Under pytest-xdist each worker is a session of its own (its own Ray, its own rank processes): the mark the
# workers inherit from the controller gets the worker's name, so one worker's check never counts another's.
os.environ.setdefault("FOLDTUNE_TEST_SESSION", uuid.uuid4().hex)
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if XDIST_WORKER and not os.environ["FOLDTUNE_TEST_SESSION"].endswith(f"-{XDIST_WORKER}"):
    os.environ["FOLDTUNE_TEST_SESSION"] += f"-{XDIST_WORKER}"
if XDIST_WORKER:
    # The workers share the cores: each worker's own torch work (the single-process tests) gets its share of
    # them, not a thread per core that contends with the other worker's: more threads than cores wait on each
    # other, and the tests' tiny tensors gain nothing from a second thread. Rank processes set their own.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Moves the objects alive when a test starts out of the collector's reach for the test's length.

    Ranks forked from this process inherit its heap, by then large (torch, Ray, every test module), and each
    collection in a rank walked all of it, writing to every page (copy-on-write): a launch took seconds, not a
    tenth of one. The objects come back after the test, so cycles among them are still collected."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def postgres_reason() -> str | None:
    """Why the test PostgreSQL server cannot be used (None: it can), asked once per session."""
    return postgres_unavailable_reason()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_kind(request, postgres_reason) -> str:
    """'sqlite' and 'postgres' in turn: the database tests run on both (see ``database_kind``)."""
    return database_kind(request, postgres_reason)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory):
    """A SQLite file migrated once per session; copying it is faster than migrating every test's database."""
    path = tmp_path_factory.mktemp("template") / "foldtune.sqlite3"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgres_migrated():
    """A private PostgreSQL schema migrated once per session (tests/databases.py); dropped at the session's end."""
    with temporary_postgres_schema() as url:
        yield migrate_schema(url)


@pytest.fixture
def migrated_url(request, db_kind, tmp_path, sqlite_template):
    """A migrated database with no rows (tests/databases.py): a copy of the SQLite template, or the session's
    PostgreSQL schema, emptied after the test."""
    if db_kind == "sqlite":
        yield copy_sqlite(sqlite_template, tmp_path)
        return
    schema = request.getfixturevalue("postgres_migrated")
    try:
        yield schema.url
    finally:
        empty_postgres_schema(schema)


TRITON_CHILD = pytest.StashKey[InterpreterChild]()


def pytest_collection_finish(session):
    """Starts the session's one Triton-interpreter child (tests/executor/triton_child.py) for every file
    whose test asks for ``triton_interpreter`` among the tests this session runs. Under pytest-xdist every
    worker collects every test but runs only some: worker gw0 starts the child in a folder all workers know
    (named by the run's id, beside their base temporary folders), and the worker that runs the tests asking
    for it (one xdist group, ``_xdist_groups``) waits for its exit status there."""
    if INNER or session.config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    files = sorted({str(item.path.resolve()) for item in session.items
                    if "triton_interpreter" in getattr(item, "fixturenames", ())})
    if not files:
        return
    config = session.config
    if XDIST_WORKER:
        run = os.environ["PYTEST_XDIST_TESTRUNUID"]
        workdir = config._tmp_path_factory.getbasetemp().parent / f"triton-child-{run}"
        workdir.mkdir(exist_ok=True)
        start = XDIST_WORKER == "gw0"
    else:
        workdir, start = Path(tempfile.mkdtemp(prefix="foldtune-triton-child-")), True
    config.stash[TRITON_CHILD] = InterpreterChild(files, config.rootpath, workdir, start=start)


def pytest_sessionfinish(session, exitstatus):
    """Ends the Triton-interpreter child. Under pytest-xdist, worker gw0, which started it, first waits for
    it (unless the run was stopped): the worker running the tests that read its report may still need it.
    The folder is removed where it is this session's own (not under pytest-xdist: there pytest's base
    temporary folder holds it, kept for the last few runs)."""
    child = session.config.stash.get(TRITON_CHILD, None)
    if child is None:
        return
    if XDIST_WORKER and child.proc is not None and not (session.shouldstop or session.shouldfail
                                                        or exitstatus == pytest.ExitCode.INTERRUPTED):
        child.result()
    child.stop()
    if not XDIST_WORKER:
        shutil.rmtree(child.report.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def triton_interpreter(request) -> ChildRun:
    """What the session's Triton-interpreter child did, once it has finished (tests/executor/triton_child.py)."""
    pytest.importorskip("triton")
    if INNER:
        pytest.skip("this is the child")
    return request.config.stash[TRITON_CHILD].result()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (_xdist_groups)
def pytest_collection_modifyitems(config, items):
    """Leaves out, outside the Triton-interpreter child, the tests only that child runs
    (tests/executor/triton_child.py): their parent test reports them. Runs the tests of a simulated Ray
    cluster (marker ``ray_cluster``) last: each shuts down the session's one local Ray (tests/api/runner_env.py)
    to start a cluster of its own, and the next test needing the local Ray would start it again."""
    child_only = [] if INNER else [item for item in items if item.get_closest_marker(MARK)]
    if child_only:
        items[:] = [item for item in items if not item.get_closest_marker(MARK)]
        config.hook.pytest_deselected(items=child_only)
    items.sort(key=lambda item: item.get_closest_marker("ray_cluster") is not None)  # stable: order kept within
    if XDIST_WORKER:
        _xdist_groups(items)


def _xdist_groups(items) -> None:
    """The units pytest-xdist's ``--dist loadgroup`` hands a worker (the README's test command): a test file
    (its module- and class-scoped fixtures, a served API or a browser, are set up once, by one worker), except
    the tests that read the Triton-interpreter child's report, one group, and the simulated Ray clusters
    (marker ``ray_cluster``), one group: the worker that runs them restarts its own local Ray after them if
    a later test of its needs it (the other worker's Ray is never touched)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if "triton_interpreter" in getattr(item, "fixturenames", ()):
            group = "triton_interpreter"
        elif item.get_closest_marker("ray_cluster"):
            group = "ray_cluster"
        else:
            group = item.path.relative_to(item.config.rootpath).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


# where `pip install --user` put packages, read before HOME moves, so child processes still import them
_USER_BASE = site.getuserbase()


@pytest.fixture(scope="session", autouse=True)
def _no_user_settings(tmp_path_factory):
    """The session runs without the user's FOLDTUNE_* settings and with a HOME of its own, from before the first
    session fixture (autouse comes first in its scope: the suite's Ray inherits this environment). The README's
    first command, `foldtune tune`, writes ~/.foldtune (its API key, database and profiles): a test that read
    them would pass or fail by what the machine ran before."""
    with pytest.MonkeyPatch.context() as patch:
        for name in foreign_foldtune_variables(os.environ):
            patch.delenv(name)
        if "PYTHONUSERBASE" not in os.environ:
            patch.setenv("PYTHONUSERBASE", _USER_BASE)
        patch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch):
    """Each test gets an empty HOME: what one test's `foldtune` writes to ~/.foldtune no other test sees."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
