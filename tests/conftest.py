import gc
import os
import uuid

import pytest

from tests.executor.triton_child import INNER, MARK, ChildRun, run_child

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


@pytest.fixture(scope="session")
def triton_interpreter(request, tmp_path_factory) -> ChildRun:
    """One Triton-interpreter child for the session (tests/executor/triton_child.py): it runs the interpreter
    tests of every file whose test asks for this fixture among the tests this session runs."""
    pytest.importorskip("triton")
    if INNER:
        pytest.skip("this is the child")
    files = sorted({str(item.path.resolve()) for item in request.session.items
                    if "triton_interpreter" in getattr(item, "fixturenames", ())})
    return run_child(files, request.config.rootpath, tmp_path_factory.mktemp("triton-interpreter"))


def pytest_collection_modifyitems(config, items):
    """Leaves out, outside the Triton-interpreter child, the tests only that child runs
    (tests/executor/triton_child.py): their parent test reports them."""
    if INNER:
        return
    child_only = [item for item in items if item.get_closest_marker(MARK)]
    if child_only:
        items[:] = [item for item in items if not item.get_closest_marker(MARK)]
        config.hook.pytest_deselected(items=child_only)
