import gc
import os
import uuid

import pytest

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
