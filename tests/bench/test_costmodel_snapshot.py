"""bench.costmodel_snapshot: the snapshot is the same in two processes (no hash-order or cache-state effect),
covers the MTP model's blocks, and --check reports a changed number."""

from __future__ import annotations

import json


def test_two_runs_agree_and_a_changed_number_is_reported(script, tmp_path):
    first = script("costmodel_snapshot")
    assert first.returncode == 0, first.stderr
    snapshot = json.loads(first.stdout)
    assert any(name.startswith("deepseek-v3/") and "act.mtp.blocks" in value["memory_bytes"]["details"]
               for name, value in snapshot.items() if isinstance(value, dict))
    path = tmp_path / "before.json"
    path.write_text(first.stdout)
    same = script("costmodel_snapshot", "--check", str(path))
    assert same.returncode == 0 and same.stdout.strip() == "identical"
    snapshot["deepseek-v3/flops"] *= 1 + 1e-12
    path.write_text(json.dumps(snapshot, sort_keys=True, indent=1))
    changed = script("costmodel_snapshot", "--check", str(path))
    assert changed.returncode == 1 and changed.stdout.strip() == "different"
