"""Ray's token authentication for the Ray clusters foldtune starts or joins.

Ray (>= 2.52) checks a shared bearer token on every control-plane RPC when ``RAY_AUTH_MODE=token`` is set
on every node and in every driver. A process without the token (or with another one) cannot connect:
on Ray 2.60, measured here, ``ray.init(address=...)`` fails with 'Failed to connect to Ray cluster' after
about 20 s, so nobody who merely reaches the ports can run code on the cluster.

:func:`configure` must run before the process first imports ``ray``, which reads the mode and the token
once, at import: executor.launch_ray calls it before its ``import ray``. ``python -m executor.ray_auth`` runs it
in ``python -m executor.ray_auth``
the containers before ``ray start``. It

* keeps ``RAY_AUTH_MODE=disabled`` when the operator set it explicitly (the test suite does, see
  tests/conftest.py), and otherwise sets ``RAY_AUTH_MODE=token``;
* uses the token the operator gave (``RAY_AUTH_TOKEN``, or the file ``RAY_AUTH_TOKEN_PATH``), else the
  cluster's token file ``FOLDTUNE_RAY_AUTH_TOKEN_FILE`` (default ``<data dir>/ray_auth_token``), generated
  on first use (256 random bits, mode 0600 in a 0700 directory) and handed to Ray as
  ``RAY_AUTH_TOKEN_PATH``. The Ray processes ``ray.init`` starts inherit this process's environment, and
  the nodes that join a cluster must be given the same file (docker compose: a shared volume).

A token file that others can read is refused rather than used: whoever reads it owns the cluster.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from collections.abc import MutableMapping
from pathlib import Path

from spec.errors import SpecError

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE_ENV = "FOLDTUNE_RAY_AUTH_TOKEN_FILE"
DATA_DIR_ENV = "FOLDTUNE_DATA_DIR"
DEFAULT_DATA_DIR = "~/.foldtune"
TOKEN_FILE_NAME = "ray_auth_token"
TOKEN_BYTES = 32


def token_file(environ: MutableMapping[str, str] | None = None) -> Path:
    """Where this service keeps its cluster's token: FOLDTUNE_RAY_AUTH_TOKEN_FILE, else in the data dir."""
    env = os.environ if environ is None else environ
    if env.get(TOKEN_FILE_ENV):
        return Path(env[TOKEN_FILE_ENV]).expanduser()
    return Path(env.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR).expanduser() / TOKEN_FILE_NAME


def ensure_token_file(path: Path) -> Path:
    """``path`` holding a token: created (0600, its directory 0700 when new) if missing, checked if present."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass  # another process made it first (or an earlier run): use theirs, after the checks below
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(TOKEN_BYTES))
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SpecError(f"Ray token file {path} is readable by others (mode {mode:04o}); chmod 600 it")
    if not path.read_text().strip():
        raise SpecError(f"Ray token file {path} is empty; delete it to have a new token generated")
    return path


def configure(environ: MutableMapping[str, str] | None = None) -> str:
    """Set up token authentication in ``environ`` (default: this process's environment, which Ray and the
    processes it starts read); returns the mode, 'token' or 'disabled' (only when set so explicitly)."""
    env = os.environ if environ is None else environ
    mode = (env.get(AUTH_MODE_ENV) or "token").strip().lower()
    if mode == "disabled":
        return mode
    if mode != "token":
        raise SpecError(f"{AUTH_MODE_ENV}={env[AUTH_MODE_ENV]!r}: use 'token' (the default) or 'disabled'")
    env[AUTH_MODE_ENV] = "token"
    if env.get(TOKEN_ENV):
        return mode
    if env.get(TOKEN_PATH_ENV):
        given = Path(env[TOKEN_PATH_ENV]).expanduser()
        if not given.is_file():
            raise SpecError(f"{TOKEN_PATH_ENV}={given} is not a file")
        return mode
    env[TOKEN_PATH_ENV] = str(ensure_token_file(token_file(env)))
    return mode


def main(argv: list[str] | None = None) -> int:
    """``python -m executor.ray_auth``: make sure the cluster's token file exists and print its path (the
    Ray nodes of docker compose run it before ``ray start``)."""
    del argv
    try:
        if configure() == "disabled":
            print(f"{AUTH_MODE_ENV}=disabled: no token", file=sys.stderr)
            return 0
    except SpecError as exc:
        print(f"foldtune: error: {exc}", file=sys.stderr)
        return 2
    print(os.environ.get(TOKEN_PATH_ENV) or f"{TOKEN_ENV} (from the environment)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
