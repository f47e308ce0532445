"""executor/safe_load.py is the only code that turns file bytes into objects: no other module of the
product packages (or bench/) calls torch.load, pickle.load(s) or DCP's FileSystemReader, or asks for
weights_only=False, and every dcp.load names its storage_reader (else DCP reads .metadata with plain pickle)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("spec", "costmodel", "planner", "executor", "api", "db", "bench")
THE_READER = ROOT / "executor" / "safe_load.py"
FORBIDDEN = re.compile(r"torch\.load\(|pickle\.loads?\(|Unpickler\(|FileSystemReader\(|weights_only\s*=\s*False")


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != THE_READER:
                yield path, path.read_text()


def test_no_module_but_the_safe_reader_unpickles():
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for path, text in _sources() for m in FORBIDDEN.finditer(text)]
    assert found == []


def test_every_dcp_load_names_the_safe_storage_reader():
    calls = [(path, text[m.start():text.find("\n", m.start())])  # the call's line
             for path, text in _sources() for m in re.finditer(r"dcp\.load\(", text)]
    assert calls, "the checkpoint loaders call dcp.load"
    assert [f"{path.relative_to(ROOT)}: {call}" for path, call in calls if "storage_reader=SafeReader(" not in call] == []
