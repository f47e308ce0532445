"""A runner's GET /healthz: 200 while it runs and its database answers, 503 naming the check otherwise."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from runner_env import make_runner

from api.worker.health import HealthServer


def _get(port: int, path: str = "/healthz") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_healthz_follows_the_runner_and_its_database(db_url):
    runner = make_runner(db_url, runner_id="probed")
    health = HealthServer("127.0.0.1", 0, runner.health_checks(), {"runner_id": "probed"}).start()
    try:
        assert _get(health.port) == (200, {"status": "ok", "runner_id": "probed"})
        assert _get(health.port, "/other")[0] == 404
        runner.stop()
        status, body = _get(health.port)
        assert status == 503 and body["check"] == "runner" and "shutting down" in body["detail"]
    finally:
        health.close()
        runner.close()


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_healthz_is_503_when_the_database_is_gone(db_url, tmp_path):
    runner = make_runner(db_url, runner_id="probed")
    health = HealthServer("127.0.0.1", 0, runner.health_checks(), {"runner_id": "probed"}).start()
    try:
        runner.engine.dispose()
        (tmp_path / "foldtune.sqlite3").unlink()
        (tmp_path / "foldtune.sqlite3").mkdir()  # the file is replaced by something no database can open
        status, body = _get(health.port)
        assert status == 503 and body["check"] == "database"
    finally:
        health.close()
        runner.close()
