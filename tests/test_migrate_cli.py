"""`starter.py migrate`: the worker role a deployment grants (--grant-worker-role), the status of each
file, and the pending DDL printed for a DBA to review (`migrate sql`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid

import asyncpg
import pytest

from core import db
from tests.test_cleanup_input import run_cli


async def test_migrate_grants_the_worker_role_to_an_existing_login(pool, settings):
    login = f"worker_login_{uuid.uuid4().hex[:8]}"
    await pool.execute(f"CREATE ROLE {login} LOGIN")
    try:
        done = run_cli(settings, "migrate", "--grant-worker-role", login, "--json")
        assert done.returncode == 0, done.stderr
        assert await pool.fetchval("SELECT pg_has_role($1, 'cleanup_worker', 'member')", login)
        assert not await pool.fetchval("SELECT has_table_privilege($1, 'accounts', 'TRUNCATE')", login), (
            "membership gives rows, not DDL"
        )

        missing = run_cli(settings, "migrate", "--grant-worker-role", "no_such_login_xyz")
        assert missing.returncode == 2 and "no database role named 'no_such_login_xyz'" in missing.stderr
        bad = run_cli(settings, "migrate", "--grant-worker-role", 'x"; DROP TABLE accounts; --')
        assert bad.returncode == 2 and "not a role name" in bad.stderr
        assert await pool.fetchval("SELECT count(*) FROM accounts") == 0
    finally:
        await pool.execute(f"REVOKE cleanup_worker FROM {login}")
        await pool.execute(f"DROP ROLE {login}")


async def test_migrate_status_lists_files_with_checksums_and_refuses_a_changed_applied_file(pool, settings):
    shown = run_cli(settings, "migrate", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    files = db.migration_files()
    assert [r["name"] for r in rows] == [p.name for p in files]
    assert all(r["state"] == "applied" and r["checksum"] == db.checksum(p) for r, p in zip(rows, files, strict=True))

    # A file applied, then edited: the recorded checksum no longer matches the file.
    first = files[0].name
    await pool.execute("UPDATE schema_migrations SET checksum = 'edited-since' WHERE name = $1", first)
    changed = run_cli(settings, "migrate", "status")
    assert changed.returncode == 2 and f"changed since they were applied: {first}" in changed.stderr, changed.stderr
    refused = run_cli(settings, "migrate")
    assert refused.returncode == 2 and first in refused.stderr, refused.stderr
    worker_side = run_cli(settings, "planner", "status")
    assert worker_side.returncode == 2 and first in worker_side.stderr, worker_side.stderr


async def test_other_commands_never_migrate_and_say_run_migrate_when_behind(pool, settings):
    last = db.migration_files()[-1].name
    await pool.execute("DELETE FROM schema_migrations WHERE name = $1", last)
    for args in (["cleanup", "--deadline", "2026-11-01T09:00:00Z"], ["hold", "x", "--reason", "r"], ["budget", "show"]):
        done = run_cli(settings, *args)
        assert done.returncode == 2 and "run migrate" in done.stderr, (args, done.stderr)
    assert await pool.fetchval("SELECT count(*) FROM schema_migrations WHERE name = $1", last) == 0

    shown = json.loads(run_cli(settings, "migrate", "status", "--json").stdout)
    assert [r["name"] for r in shown if r["state"] == "pending"] == [last]


async def test_each_migration_runs_in_its_own_transaction_under_a_lock_timeout(pool, db_url, tmp_path, monkeypatch):
    """A file that waits for a lock held by the game fails after the lock timeout, alone: the files
    before it stay applied; a `-- no-transaction` file builds its index concurrently."""
    for path in db.migration_files():
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "900_index.sql").write_text(
        "-- no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS accounts_game_idx ON accounts (game);\n"
    )
    (tmp_path / "901_column.sql").write_text("ALTER TABLE accounts ADD COLUMN note text;\n")
    monkeypatch.setattr(db, "MIGRATIONS_DIR", tmp_path)
    monkeypatch.setattr(db, "MIGRATION_LOCK_TIMEOUT", "300ms")

    game = await asyncpg.connect(db_url, server_settings=db.service_settings())
    try:
        await game.execute("BEGIN")
        await game.execute("SELECT 1 FROM accounts LIMIT 1")  # a player's open transaction: ACCESS SHARE
        conn = await asyncpg.connect(db_url)
        try:
            with pytest.raises(asyncpg.exceptions.LockNotAvailableError):
                await db.migrate(conn)
        finally:
            await conn.close()
        await game.execute("ROLLBACK")
    finally:
        await game.close()
    applied = {r[0] for r in await pool.fetch("SELECT name FROM schema_migrations")}
    assert "900_index.sql" in applied and "901_column.sql" not in applied
    assert await pool.fetchval("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('accounts_game_idx')")
    assert not await pool.fetchval(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'accounts' AND column_name = 'note'"
    )


async def test_migrate_sql_prints_the_ddl_migrate_runs_and_nothing_when_current(admin_db_url, settings):
    """The printed script is the DDL itself: run by psql on an empty database, it leaves every file
    applied with its checksum, exactly as `migrate apply` would; on a current database nothing is pending."""
    name = f"migrate_sql_{uuid.uuid4().hex[:8]}"
    empty = await db.create_database(admin_db_url, name, migrate=False)
    try:
        on_empty = settings.model_copy(update={"database_url": empty})
        printed = run_cli(on_empty, "migrate", "sql", "--json")
        assert printed.returncode == 0, printed.stderr
        shown = json.loads(printed.stdout)
        assert shown["pending"] == [p.name for p in db.migration_files()]
        applied = await asyncio.to_thread(
            subprocess.run,
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty, "-f", "-"],
            input=shown["sql"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert applied.returncode == 0, applied.stderr
        status = run_cli(on_empty, "migrate", "status", "--json")
        assert status.returncode == 0, status.stderr
        assert {r["state"] for r in json.loads(status.stdout)} == {"applied"}
        again = run_cli(on_empty, "migrate", "sql", "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["pending"] == [], again.stderr
    finally:
        await db.drop_database(admin_db_url, name)


def test_migrate_sql_all_prints_every_file_without_a_database(settings):
    refused = settings.model_copy(update={"database_url": "postgresql://nobody@127.0.0.1:1/none"})
    printed = run_cli(refused, "migrate", "sql", "--all")
    assert printed.returncode == 0, printed.stderr
    assert [line[3:] for line in printed.stdout.splitlines() if line.startswith("-- 0")] == [
        p.name for p in db.migration_files()
    ]
