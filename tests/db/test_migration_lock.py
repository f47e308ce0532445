"""Two processes migrating one empty database at the same moment (what docker compose does on its first
start: the API and the runner both migrate) both succeed, one after the other under the migration lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

from db.engine import make_engine
from db.migrate import VERSION_TABLE, current_revision, head_revision

# Each migrator imports everything first, then waits for the go file, so both start migrating together.
MIGRATOR = """
import os, sys, time
from db.migrate import upgrade
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
upgrade(sys.argv[1])
print("migrated")
"""


def _migrate_twice_at_once(db_url: str, tmp_path: Path) -> list[subprocess.CompletedProcess]:
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", MIGRATOR, db_url, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)  # unrelated to correctness: only makes it likelier that both are waiting at the go file
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_two_migrators_on_an_empty_database_both_succeed_and_the_schema_is_at_head(db_url, tmp_path):
    results = _migrate_twice_at_once(db_url, tmp_path)
    for r in results:
        assert r.returncode == 0 and "migrated" in r.stdout, r.stderr[-2000:]
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            versions = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
        assert versions == [head_revision()]  # one row: the second migrator found the work done
        assert {"jobs", "trials", "owners"} <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_the_lock_is_held_for_the_whole_migration(db_url):
    """While one holder has the lock, a second migrator waits (the lock is no advisory decoration)."""
    import threading

    from db.migrate import migration_lock, upgrade

    upgrade(db_url)  # the SQLite file / schema exists
    entered = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with migration_lock(db_url):
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(30)
    second_in = threading.Event()

    def second() -> None:
        with migration_lock(db_url):
            second_in.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    try:
        assert not second_in.wait(1.0)  # blocked while the first holds it
    finally:
        release.set()
        holder.join(30)
    assert second_in.wait(30)  # and gets it once released
    waiter.join(30)
