"""The built wheel is the whole service: it ships every static file the server serves, and a clean venv
with the wheel installed (the project from the wheel alone; its dependencies from this interpreter) serves
the dashboard (/), /docs and /redoc with every asset those pages load, plotly.js from the plotly package."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from api.http.routes.dashboard import STATIC_DIR

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("spec", "costmodel", "planner", "executor", "api", "db")

pytestmark = pytest.mark.slow  # builds a wheel and a venv, starts a server


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (so no build files land in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "-w", str(out), str(src)], check=True, cwd=src, timeout=300)
    [built] = out.glob("foldtune-*.whl")
    return built


def test_the_wheel_ships_every_static_file_the_server_serves(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    served = sorted(str(p.relative_to(ROOT)) for p in STATIC_DIR.rglob("*") if p.is_file())
    assert served and [name for name in served if name not in names] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.status == 200, url
        return answer.read()


def test_a_wheel_install_serves_the_dashboard_docs_and_redoc_with_their_assets(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # --ignore-installed: this interpreter may hold the project too (an editable install); the venv gets its own
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--ignore-installed",
                    str(wheel)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv provides foldtune
    env.update(FOLDTUNE_DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}", FOLDTUNE_DATA_ROOT=str(tmp_path))
    where = subprocess.run([str(python), "-c", "import api; print(api.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), f"the project came from {where}, not the wheel"
    port = _free_port()
    server = subprocess.Popen([str(venv / "bin" / "foldtune"), "serve", "--port", str(port), "--log-level", "warning"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(f"{base}/healthz")
                break
            except (urllib.error.URLError, OSError):
                assert server.poll() is None and time.monotonic() < deadline, server.communicate()[0]
                time.sleep(0.2)
        assets = set()
        for page in ("/", "/docs", "/redoc"):
            html = _get(base + page).decode()
            assets |= set(re.findall(r"""["'](/static/[^"'?#]+)""", html))
        assert {a.split("/")[2] for a in assets} == {"dashboard", "swagger-ui", "redoc"}
        for asset in sorted(assets):
            assert _get(base + asset) == (STATIC_DIR / asset.removeprefix("/static/")).read_bytes(), asset
        # the dashboard's plotting library comes from the plotly package the venv sees, not from the wheel
        import plotly

        assert '"/vendor/plotly.min.js"' in _get(base + "/").decode()
        assert _get(base + "/vendor/plotly.min.js") == (Path(plotly.__file__).parent / "package_data" /
                                                        "plotly.min.js").read_bytes()
    finally:
        server.kill()
        server.wait()
