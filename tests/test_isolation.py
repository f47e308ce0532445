"""The suite runs without the user's foldtune state (tests/conftest.py): a machine where the README's first command
(`foldtune tune`) wrote ~/.foldtune, or whose shell exports FOLDTUNE_API_KEY, passes the same tests as a fresh one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from suite_env import foreign_foldtune_variables

ROOT = Path(__file__).resolve().parents[1]

# Run inside a pytest session of its own: what the CLI sees of the user (a planted key file and settings).
INNER_TEST = '''
import os, subprocess, sys

def test_the_user_is_out_of_sight():
    from api.cli._local_key import given_key
    assert given_key() is None, "the user's API key reached the test"
    assert "FOLDTUNE_DATA_DIR" not in os.environ and "FOLDTUNE_API_KEY" not in os.environ
    assert os.environ["FOLDTUNE_REQUIRE_POSTGRES"] == "1"  # the suite's own settings stay
    cli = subprocess.run([sys.executable, "-m", "api.cli.main", "jobs", "--url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "no API key" in cli.stderr, cli.stderr
'''


def test_this_session_has_its_own_home_and_no_user_settings():
    assert foreign_foldtune_variables(os.environ) == []
    assert os.environ["FOLDTUNE_TEST_SESSION"]  # the suite's own mark survives
    home = Path(os.environ["HOME"])
    assert home.is_dir() and list(home.iterdir()) == []  # a fresh one per test


def test_foreign_variables_are_every_foldtune_setting_but_the_suites():
    env = {"FOLDTUNE_API_KEY": "k", "FOLDTUNE_DATA_DIR": "/x", "FOLDTUNE_TEST_SESSION": "s", "HOME": "/root",
           "FOLDTUNE_REQUIRE_POSTGRES": "1", "FOLDTUNE_REQUIRE_BROWSER": "1", "FOLDTUNE_TEST_POSTGRES_URL": "u",
           "RAY_AUTH_MODE": "disabled"}
    assert foreign_foldtune_variables(env) == ["FOLDTUNE_API_KEY", "FOLDTUNE_DATA_DIR"]


def _inner_session(tmp_path: Path, with_conftest: bool) -> subprocess.CompletedProcess:
    """Run INNER_TEST in a pytest session whose HOME holds a `foldtune tune`-made ~/.foldtune/api-key and whose
    environment names it, with or without the suite's conftest."""
    home = tmp_path / "user-home"
    (home / ".foldtune").mkdir(parents=True)
    (home / ".foldtune" / "api-key").write_text("ft_planted_by_an_earlier_foldtune_tune\n")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_inner.py").write_text(INNER_TEST)
    if with_conftest:
        for name in ("conftest.py", "suite_env.py"):
            shutil.copy(ROOT / "tests" / name, suite / name)
    env = {**os.environ, "HOME": str(home), "FOLDTUNE_DATA_DIR": str(home / ".foldtune"),
           "FOLDTUNE_REQUIRE_POSTGRES": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("FOLDTUNE_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], cwd=suite,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two pytest sessions and two CLI processes: about ten seconds
def test_a_planted_key_in_the_users_home_stays_out_of_the_suite(tmp_path):
    isolated = _inner_session(tmp_path / "with", with_conftest=True)
    assert isolated.returncode == 0, isolated.stdout + isolated.stderr
    # the same session without the suite's conftest reads the planted key: the check above can fail
    exposed = _inner_session(tmp_path / "without", with_conftest=False)
    assert exposed.returncode == 1 and "the user's API key reached the test" in exposed.stdout, exposed.stdout
