"""The local API key: the key ``foldtune tune`` stores its jobs under, kept in ``<data dir>/api-key`` (mode 0600),
so that ``foldtune jobs`` and ``foldtune best`` (which go through the API) see those jobs without a flag.

The key used is, in order: ``--api-key``, ``FOLDTUNE_API_KEY``, the key file. ``foldtune tune`` creates the key
file on first use (owner ``local``) when neither of the first two is set, and says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.orm import Session

from api.cli.settings import ClientEnv
from db.keys import create_api_key, owner_for_token
from db.models import Owner
from db.settings import default_data_dir
from spec.errors import SpecError

KEY_FILE = "api-key"
LOCAL_OWNER = "local"


def key_file() -> Path:
    return default_data_dir() / KEY_FILE


def read_local_key() -> str | None:
    """The key in the key file, or None when there is none (an unreadable file is an error, not a silent None)."""
    path = key_file()
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SpecError(f"cannot read the local API key {str(path)!r}: {exc.strerror}") from None
    return text or None


def given_key(explicit: str | None = None) -> str | None:
    """``explicit`` (``--api-key``), else ``FOLDTUNE_API_KEY``, else the key file's key, else None."""
    return explicit or ClientEnv.read().api_key or read_local_key()


def owner_of_local_key(session: Session, say=print) -> Owner:
    """The owner of the key the CLI uses, in ``session``'s database; with no key at all (no flag, no
    FOLDTUNE_API_KEY, no key file) a new key of owner ``local`` is created, written to the key file and announced
    through ``say``. A key that this database does not know is an error naming where it came from. Commits."""
    env_key = ClientEnv.read().api_key
    token, source = (env_key, "FOLDTUNE_API_KEY") if env_key else (read_local_key(), str(key_file()))
    if token is not None:
        owner = owner_for_token(session, token)
        if owner is None:
            raise SpecError(f"the API key in {source} is not a key of this database (revoked, or made for another "
                            f"one): unset it or delete the file, and foldtune creates a new local key")
        return owner
    owner, token = create_api_key(session, LOCAL_OWNER)
    path = key_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by other users
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    say(f"created an API key for owner {owner.name!r} in {path} (foldtune jobs/best/trainings use it when "
        f"FOLDTUNE_API_KEY is unset; `export FOLDTUNE_API_KEY=$(cat {path})` for other clients)")
    return owner
