"""FOLDTUNE_REQUIRE_POSTGRES (set by .ci/run) turns an unreachable PostgreSQL into failures, not skips."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from db.testing import postgres_required

ROOT = Path(__file__).resolve().parents[2]


def test_the_setting_reads_as_a_flag():
    assert postgres_required({"FOLDTUNE_REQUIRE_POSTGRES": "1"})
    assert not postgres_required({}) and not postgres_required({"FOLDTUNE_REQUIRE_POSTGRES": "0"})


@pytest.mark.slow  # a child pytest
def test_ci_requires_postgres_and_an_unreachable_server_fails_the_postgres_tests(tmp_path):
    assert "export FOLDTUNE_REQUIRE_POSTGRES=1" in (ROOT / ".ci" / "run").read_text()
    # The child needs none of the installed pytest plugins; loading them (hypothesis, schemathesis) was most of
    # its start-up.
    env = {**os.environ, "FOLDTUNE_TEST_POSTGRES_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
           "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    test = "tests/db/test_migrations.py::test_upgrade_from_empty_creates_every_table_and_own_version_table"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), test]
    required = subprocess.run(args, env={**env, "FOLDTUNE_REQUIRE_POSTGRES": "1"}, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    # without the xdist plugin the child warns about the suite's xdist_group marks: the summary may count warnings
    assert required.returncode == 1 and re.search(r"1 passed, (\d+ warnings?, )?1 error", required.stdout), \
        required.stdout[-2000:]
    assert "unreachable" in required.stdout and "FOLDTUNE_REQUIRE_POSTGRES is set" in required.stdout
    optional = subprocess.run(args, env={**env, "FOLDTUNE_REQUIRE_POSTGRES": ""}, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert optional.returncode == 0 and re.search(r"1 passed, 1 skipped", optional.stdout), optional.stdout[-2000:]
