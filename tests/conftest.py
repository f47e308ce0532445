import gc
import os
import site
import uuid

import pytest

from suite_env import foreign_foldtune_variables

# The suite's Ray instances run without Ray's token authentication: every test process shares one local Ray
# (tests/api/runner_env.py) and the runner subprocesses join it by address. Where the environment does not
# say otherwise; one test turns it on (tests/api/test_runner_sigterm.py: a runner whose own Ray has auth),
# and tests/executor/test_ray_auth.py covers the token file. See docs/deploy.md, "Ray token authentication".
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Marks every process this test session starts (Ray's included: they inherit the environment), so that the
# checks for leftover processes count this session's, not those of other test runs on a shared machine.
os.environ.setdefault("FOLDTUNE_TEST_SESSION", uuid.uuid4().hex)


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Moves the objects alive when a test starts out of the collector's reach for the test's length.

    Ranks forked from this process inherit its heap, by then large (torch, Ray, every test module), and each
    collection in a rank walked all of it, writing to every page (copy-on-write): a launch took seconds, not a
    tenth of one. The objects come back after the test, so cycles among them are still collected."""
    gc.freeze()
    yield
    gc.unfreeze()


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
