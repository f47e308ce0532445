"""Read and write a HardwareProfile as JSON (what ``foldtune calibrate`` saves, ``--profile FILE`` loads).

A file is either a bare ``HardwareProfile.to_dict()``, or ``{"profile": {...}, "raw": {...}}`` as
written by :func:`save_profile` (the raw microbenchmark timings kept beside the profile), or a
catalog file holding exactly one ``hardware`` entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spec.catalog import register_hardware
from spec.errors import CatalogError, FoldtuneError
from spec.hardware import HardwareProfile


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str], raw: dict[str, Any] | None = None) -> Path:
    """Write ``profile`` (and the ``raw`` timings it came from, if given) to ``path``; returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"profile": profile.to_dict()}
    if raw is not None:
        data["raw"] = raw
    p.write_text(json.dumps(data, indent=1) + "\n")
    return p


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """The HardwareProfile stored in ``path``; CatalogError naming the file when it holds none."""
    p = Path(path).expanduser()
    data = _read_json(p)
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    elif isinstance(data, dict) and isinstance(data.get("hardware"), dict):
        entries = data["hardware"]
        if len(entries) != 1:
            raise CatalogError(f"{str(p)!r} holds {len(entries)} hardware entries; a profile file needs exactly one")
        (name, fields), = entries.items()
        data = {"name": str(name), **fields} if isinstance(fields, dict) else fields
    if not isinstance(data, dict) or "gpu" not in data:
        raise CatalogError(f"{str(p)!r} is not a hardware profile (no 'gpu' entry)")
    try:
        return HardwareProfile.from_dict(data)
    except (FoldtuneError, TypeError, ValueError, KeyError) as exc:
        raise CatalogError(f"hardware profile {str(p)!r}: {exc}") from None


def load_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw microbenchmark timings :func:`save_profile` kept beside the profile in ``path``; CatalogError
    naming the file when it holds none (a bare profile, a catalog file, not JSON)."""
    p = Path(path).expanduser()
    data = _read_json(p)
    raw = data.get("raw") if isinstance(data, dict) else None
    if not isinstance(raw, dict) or "gemm" not in raw:
        raise CatalogError(f"{str(p)!r} holds no raw calibration timings (a file written by foldtune calibrate)")
    return raw


def _read_json(p: Path) -> Any:
    """The JSON in ``p``; CatalogError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(p.read_text())
    except OSError as exc:
        raise CatalogError(f"cannot read hardware profile {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CatalogError(f"hardware profile {str(p)!r} is not valid JSON: {exc.msg} (line {exc.lineno})") from None


def use_profile_file(path: str | os.PathLike[str]) -> HardwareProfile:
    """Load ``path`` and register it in this process's catalog under its own name (so a command that
    resolves hardware by name prices with it); returns the profile."""
    profile = load_profile(path)
    register_hardware(profile)
    return profile
