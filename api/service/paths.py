"""Server paths an API user names (a training's ``data_path`` and ``checkpoint_dir``), confined to that
owner's own directory under the service's data root: ``<FOLDTUNE_DATA_ROOT>/<owner>/``.

The rule (``path_in_owner_root``): the path, relative ones taken relative to the owner's directory, is
resolved with ``os.path.realpath`` (every ``..`` and every symbolic link of the parts that exist) and must
then be that directory or lie below it. Anything else is refused with one answer that depends only on
the text the user sent, never on what the server holds: an outside path that exists and one that does
not read alike, and the resolved target of a symbolic link is never shown. So no user can probe the
server's files, read another owner's data or write into (and resume from) another owner's checkpoints.

The data root itself belongs to the operator: an owner who could replace their own directory with a link
could point it anywhere, so owners must not have write access to the data root (only below their own
directory). The HTTP service checks at submission and stores the resolved path; the runner checks the stored path
again before it trains (a link swapped in after submission is refused there). The local CLI
(``foldtune train``, a local user on their own machine) trusts the paths it is given and skips both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from api.service.errors import RuleViolation
from api.env_settings import FoldtuneEnv
from db.settings import default_data_dir

DEFAULT_DATA_ROOT_NAME = "users"  # under FOLDTUNE_DATA_DIR (default ~/.foldtune)
PATH_RULE = "path_in_owner_root"

# Owner names that are used as their directory's name as they are: lower-case, no separators, no dot
# first (no "." or ".."), so that no two owners share a directory even on a case-insensitive file system.
_PLAIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")


class DataRootEnv(FoldtuneEnv):
    """``FOLDTUNE_DATA_ROOT`` (None: ``users`` in the data directory)."""

    what = "service"
    data_root: str | None = None


def default_data_root(environ: Mapping[str, str] | None = None) -> Path:
    """``FOLDTUNE_DATA_ROOT``, else ``<FOLDTUNE_DATA_DIR or ~/.foldtune>/users`` (the service's home: the
    data directory of the SQLite database)."""
    given = DataRootEnv.read(environ).data_root
    return Path(given).expanduser() if given else default_data_dir(environ) / DEFAULT_DATA_ROOT_NAME


def owner_dir_name(owner_name: str, owner_id: int) -> str:
    """The name of an owner's directory under the data root: the owner's name when it is a plain lower-case
    name (``alice``), else ``_owner-<id>`` (a name with ``/``, dots, capitals or other characters; the
    leading underscore keeps it apart from every plain name)."""
    return owner_name if _PLAIN_NAME.match(owner_name) else f"_owner-{owner_id}"


def owner_root(data_root: str | Path, owner_name: str, owner_id: int) -> Path:
    """The owner's directory: ``<data_root>/<owner_dir_name>``, the data root itself resolved."""
    return Path(os.path.realpath(data_root)) / owner_dir_name(owner_name, owner_id)


def confine(given: str, root: Path, loc: str) -> str:
    """``given`` resolved inside ``root`` (an owner's directory, see :func:`owner_root`), as an absolute path;
    RuleViolation ``path_in_owner_root`` at ``loc`` when it resolves anywhere else. The message repeats only
    ``given``: it reads the same whether or not the outside path exists."""
    real_root = os.path.realpath(root)
    try:
        resolved = os.path.realpath(os.path.join(real_root, given))  # an absolute ``given`` replaces the root
    except (ValueError, OSError):  # NUL or unencodable text (the schemas refuse both first): outside alike
        resolved = ""
    if not resolved or (resolved != real_root and not resolved.startswith(real_root.rstrip(os.sep) + os.sep)):
        raise RuleViolation(loc, PATH_RULE, f"{given!r} is not inside your data directory; give a path relative "
                                            "to it (or an absolute one below it) that stays inside it, "
                                            "through every '..' and symbolic link")
    return resolved
