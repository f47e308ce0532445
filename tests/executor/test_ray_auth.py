"""The Ray token of a foldtune cluster: generated once, private (0600), handed to Ray through the
environment; an explicit RAY_AUTH_MODE=disabled or a token the operator gave is kept."""

from __future__ import annotations

import os
import stat

import pytest

from executor import ray_auth
from spec.errors import SpecError


def test_a_token_file_is_generated_private_and_reused(tmp_path):
    env = {"FOLDTUNE_DATA_DIR": str(tmp_path / "home")}
    assert ray_auth.configure(env) == "token"
    path = tmp_path / "home" / "ray_auth_token"
    assert env == {"FOLDTUNE_DATA_DIR": str(tmp_path / "home"), "RAY_AUTH_MODE": "token",
                   "RAY_AUTH_TOKEN_PATH": str(path)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    again = {"FOLDTUNE_DATA_DIR": str(tmp_path / "home")}
    ray_auth.configure(again)
    assert path.read_text() == token  # the cluster keeps its token across restarts


def test_a_token_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("x" * 64)
    os.chmod(path, 0o644)
    with pytest.raises(SpecError, match="readable by others"):
        ray_auth.configure({"FOLDTUNE_RAY_AUTH_TOKEN_FILE": str(path)})


def test_an_explicit_disabled_mode_and_given_tokens_are_kept(tmp_path):
    env = {"RAY_AUTH_MODE": "disabled", "FOLDTUNE_DATA_DIR": str(tmp_path)}
    assert ray_auth.configure(env) == "disabled" and "RAY_AUTH_TOKEN_PATH" not in env
    assert not (tmp_path / "ray_auth_token").exists()
    env = {"RAY_AUTH_TOKEN": "given", "FOLDTUNE_DATA_DIR": str(tmp_path)}
    assert ray_auth.configure(env) == "token" and "RAY_AUTH_TOKEN_PATH" not in env
    with pytest.raises(SpecError, match="is not a file"):
        ray_auth.configure({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
    with pytest.raises(SpecError, match="use 'token'"):
        ray_auth.configure({"RAY_AUTH_MODE": "password"})
