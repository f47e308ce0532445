"""The ``FOLDTUNE_*`` settings groups (pydantic-settings, api/env_settings.py): the process environment and a
given mapping read alike, empty means unset, a bad value is one line naming the variable, docs/settings.md
lists every variable with its default, and neither the executor, the spec layer nor db/ imports pydantic."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from api.cli.settings import ClientEnv
from api.http.settings import ApiSettings, ServiceEnv
from api.service.paths import DataRootEnv
from api.service.quotas import QuotaEnv, Quotas
from api.worker.runner import RunnerSettings
from api.worker.settings import RunnerEnv, TrialEnv
from api.env_settings import FoldtuneEnv
from db import settings as db_settings
from db.settings import database_settings
from spec.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
GROUPS = (DataRootEnv, ServiceEnv, QuotaEnv, RunnerEnv, TrialEnv, ClientEnv)


@pytest.fixture(autouse=True)
def _no_foldtune_variables(monkeypatch):
    """Each test sees only the variables it sets (a developer's own FOLDTUNE_* must not leak in)."""
    import os
    for name in list(os.environ):
        if name.startswith("FOLDTUNE_"):
            monkeypatch.delenv(name)


def test_every_group_is_found_by_the_docs_test():
    assert set(GROUPS) == set(_subclasses(FoldtuneEnv))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_the_environment_and_a_mapping_read_alike(monkeypatch):
    given = {"FOLDTUNE_PORT": "9000", "FOLDTUNE_TRUSTED_PROXIES": "10.0.0.5, 172.18.0.0/16",
             "FOLDTUNE_QUOTA_PROFILES": "3", "FOLDTUNE_HEARTBEAT_S": "2.5", "FOLDTUNE_DATA_DIR": "/var/ft"}
    from_mapping = ApiSettings.from_env("sqlite://", given)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    assert ApiSettings.from_env("sqlite://") == from_mapping
    assert (from_mapping.port, from_mapping.trusted_proxies, from_mapping.quotas.profiles) == (
        9000, ("10.0.0.5", "172.18.0.0/16"), 3)
    assert str(from_mapping.data_root) == "/var/ft/users"
    assert RunnerSettings.from_env(runner_id="r").heartbeat_s == 2.5
    # a mapping is all there is: the process environment does not leak into it
    assert ApiSettings.from_env("sqlite://", {}).port == 8321


def test_an_empty_variable_is_unset():
    env = {"FOLDTUNE_PORT": "", "FOLDTUNE_DATA_DIR": "", "FOLDTUNE_GPUS_PER_NODE": "", "FOLDTUNE_URL": ""}
    assert ServiceEnv.read(env).port == 8321 and RunnerEnv.read(env).gpus_per_node is None
    assert database_settings(None, env).url.endswith("/.foldtune/foldtune.sqlite3")
    assert ClientEnv.read(env).url == "http://127.0.0.1:8321"


@pytest.mark.parametrize("env, message", [
    ({"FOLDTUNE_PORT": "eighty"},
     "bad service setting in the environment: FOLDTUNE_PORT='eighty': Input should be a valid integer"),
    ({"FOLDTUNE_RATE_LIMIT_PER_S": "nan"},
     "bad service setting in the environment: FOLDTUNE_RATE_LIMIT_PER_S='nan': Input should be a finite number"),
    ({"FOLDTUNE_QUOTA_PROFILES": "many"}, "bad service setting in the environment: FOLDTUNE_QUOTA_PROFILES='many'"),
    ({"FOLDTUNE_QUOTA_PROFILES": "0"}, "bad service setting in the environment: FOLDTUNE_QUOTA_PROFILES must be at "
                                       "least 1"),
    ({"FOLDTUNE_PLAN_SECONDS": "0"}, "FOLDTUNE_PLAN_SECONDS and FOLDTUNE_PLAN_CONCURRENCY must be positive"),
    ({"FOLDTUNE_TRUSTED_PROXIES": "proxy.example"},
     "FOLDTUNE_TRUSTED_PROXIES: 'proxy.example' is not an IP address or network"),
    ({"FOLDTUNE_PUBLIC_URL": "x.org"}, "FOLDTUNE_PUBLIC_URL must start with http:// or https://"),
])
def test_bad_service_settings_are_one_line_naming_the_variable(env, message):
    with pytest.raises(SpecError) as info:
        ApiSettings.from_env("sqlite://", env)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("bad service setting in the environment: ")
    assert str(info.value).count("setting in the environment") == 1


@pytest.mark.parametrize("env, message", [
    ({"FOLDTUNE_HEARTBEAT_S": "soon"}, "bad runner setting in the environment: FOLDTUNE_HEARTBEAT_S='soon'"),
    ({"FOLDTUNE_GPUS_PER_NODE": "0"}, "bad runner setting in the environment: FOLDTUNE_GPUS_PER_NODE must be >= 1, "
                                      "got 0"),
    ({"FOLDTUNE_RUNNER_HEALTH_PORT": "http"}, "FOLDTUNE_RUNNER_HEALTH_PORT='http' is not a port number"),
    ({"FOLDTUNE_RUNNER_SHUTDOWN_SECONDS": "-1"}, "FOLDTUNE_RUNNER_SHUTDOWN_SECONDS='-1' is not a number of seconds"),
    ({"FOLDTUNE_RUNNER_SHUTDOWN_SECONDS": "nan"}, "FOLDTUNE_RUNNER_SHUTDOWN_SECONDS='nan' is not a number of seconds"),
    ({"FOLDTUNE_TRIAL_STEPS": "x"}, "bad trial setting in the environment: FOLDTUNE_TRIAL_STEPS='x'"),
    ({"FOLDTUNE_TRIAL_STEPS": "0"}, "bad trial setting in the environment: trial budget needs"),
    ({"FOLDTUNE_AUTO_CALIBRATE": "always"}, "auto_calibrate must be one of"),
])
def test_bad_runner_settings_are_one_line_naming_the_variable(env, message):
    with pytest.raises(SpecError) as info:
        RunnerSettings.from_env("sqlite://", "r", env)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).count("setting in the environment") == 1


def test_runner_process_settings():
    env = RunnerEnv.read({"FOLDTUNE_RUNNER_HEALTH_PORT": "8080", "FOLDTUNE_RUNNER_SHUTDOWN_SECONDS": "4.5",
                          "FOLDTUNE_RUNNER_HEALTH_HOST": "0.0.0.0"})
    assert (env.runner_health_port, env.runner_shutdown_seconds, env.runner_health_host) == (8080, 4.5, "0.0.0.0")
    assert RunnerEnv.read({}).runner_health_port is None and RunnerEnv.read({}).runner_shutdown_seconds == 30.0
    trial = RunnerSettings.from_env("sqlite://", "r", {"FOLDTUNE_RANK_MEMORY_BYTES": "1.5e9",
                                                        "FOLDTUNE_REUSE_RANKS": "Off"}).trial
    assert trial.rank_memory_bytes == 1_500_000_000 and trial.reuse_ranks is False


@pytest.mark.parametrize("value, message", [("0", "greater than or equal to 1"), ("21", "less than or equal to 20"),
                                            ("four", "valid integer")])
def test_client_settings(value, message):
    assert ClientEnv.read({"FOLDTUNE_HTTP_ATTEMPTS": "2", "FOLDTUNE_URL": "http://h:1"}).http_attempts == 2
    with pytest.raises(SpecError) as info:
        ClientEnv.read({"FOLDTUNE_HTTP_ATTEMPTS": value})
    assert str(info.value).startswith(f"bad client setting in the environment: FOLDTUNE_HTTP_ATTEMPTS={value!r}: ")
    assert message in str(info.value)


def _documented() -> dict[str, str]:
    """docs/settings.md's first table (the pydantic-settings groups): variable -> default column."""
    rows = {}
    text = (ROOT / "docs" / "settings.md").read_text()
    for line in text[:text.index("Read as they are")].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(FOLDTUNE_[A-Z0-9_]+)`", cells[0]) if len(cells) == 4 else None
        if match:
            rows[match.group(1)] = cells[3]
    return rows


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_docs_list_every_variable_with_its_default():
    documented = _documented()
    quota_defaults = Quotas()
    listed = set()
    for group in GROUPS:
        for name, field in group.model_fields.items():
            variable = group.variable(name)
            listed.add(variable)
            assert variable in documented, f"{variable} missing from docs/settings.md"
            default = getattr(quota_defaults, name) if group is QuotaEnv else field.default
            if group is ServiceEnv and name == "trusted_proxies":
                default = None  # an empty tuple: none trusted
            shown = documented[variable]
            if default in (None, ""):
                assert shown.startswith("none"), (variable, shown)
            else:
                assert shown == f"`{_shown(default)}`", (variable, shown, default)
    # db/ reads its two variables without pydantic (it needs SQLAlchemy alone); the same table lists them
    for variable, default in db_settings.VARIABLES.items():
        listed.add(variable)
        assert variable in documented, f"{variable} missing from docs/settings.md"
        assert documented[variable].startswith("none") if default is None else documented[variable] == f"`{default}`"
    assert set(documented) == listed  # and nothing documented that no group reads


def _imports(top: str) -> set[str]:
    names = set()
    for path in (ROOT / top).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_the_executor_the_spec_layer_and_the_database_stay_free_of_pydantic():
    for top in ("executor", "spec", "db"):
        assert "pydantic_settings" not in _imports(top) and "pydantic" not in _imports(top), top
