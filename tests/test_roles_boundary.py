"""The contract as a security boundary, attacked under the real roles (docs/security.md).

Each test logs in as a member of one of the service's roles, the way a deployment does, and tries
what that credential must not do; the legitimate calls still work."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

import cleanup
from cleanup.anonymize_key import store_key
from cleanup.batches import CompiledCleanup, run_keyset_batch
from cleanup.operations import dismiss_account
from cleanup.review import list_failed, retry_failed
from cleanup.target_check import TargetsRefused
from cleanup.targets import ANONYMIZE_KEY_ENV, CleanupTargets, anonymize_key_pads, load_targets
from core import db
from core.config import PROJECT_ROOT, Settings
from core.errors import InputError
from core.queries import load
from core.roles import ServiceRoles
from tests.game_schema import ANONYMIZE_KEY, create_game_schema, game_targets, seed_game_users
from tests.helpers import claim_one_partition, deadline_in, seed
from tests.test_cleanup_poison import poison_by_archive_check

ROLES = ServiceRoles.named("cleanup")
CLEANUP_SQL = load(cleanup.__file__)


@asynccontextmanager
async def login(db_url: str, role: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection as a fresh LOGIN that is a member of `role`, as the DBA makes them."""
    name = f"login_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(db_url)
    await admin.execute(f"CREATE ROLE {name} LOGIN IN ROLE {role}")
    try:
        conn = await asyncpg.connect(db_url, user=name, server_settings=db.service_settings())
        try:
            yield conn
        finally:
            await conn.close()
    finally:
        await admin.execute(f"DROP OWNED BY {name}; DROP ROLE {name}")
        await admin.close()


async def refused(conn: asyncpg.Connection, sql: str, *args: object) -> asyncpg.PostgresError:
    with pytest.raises(asyncpg.PostgresError) as caught:
        await conn.execute(sql, *args)
    return caught.value


async def test_the_game_role_registers_and_renews_and_nothing_else(pool, db_url):
    future = datetime.now(UTC) + timedelta(days=30)
    async with login(db_url, ROLES.game) as game:
        assert await game.fetchval("SELECT deadline_cleanup.set_deadline('p-1', $1)", future) == "registered"
        assert await game.fetchval("SELECT deadline_cleanup.set_deadline('p-2', $1)", future) == "registered"
        assert await game.fetchval("SELECT deadline_cleanup.renew('p-1', $1)", future + timedelta(days=1)) == "in_time"
        # An SQL injection in the game: every deadline into the past, holds released, the audit erased.
        moved = await refused(game, "SELECT deadline_cleanup.set_deadline('p-2', now() - interval '1 day')")
        assert moved.sqlstate == "DC001" and "not after the database's now" in str(moved)
        for sql in (
            "UPDATE deadline_cleanup.accounts SET renewal_deadline = now() - interval '1 day'",
            "DELETE FROM deadline_cleanup.account_events",
            "DELETE FROM deadline_cleanup.renewals",
            "INSERT INTO deadline_cleanup.outbox (event_key, kind, account_id, payload)"
            " VALUES ('forged', 'renewal_reminder', 'p-1', '{}')",
            "SELECT * FROM deadline_cleanup.accounts",
            "SELECT * FROM deadline_cleanup.anonymize_key",
            "SELECT deadline_cleanup.hold('p-1', 'not mine to say')",
            "SELECT deadline_cleanup.release('p-1')",
            "SELECT * FROM deadline_cleanup.renew_account('p-1', NULL)",
        ):
            err = await refused(game, sql)
            assert err.sqlstate == "42501", (sql, err)
        err = await refused(game, "CREATE TABLE deadline_cleanup.shadow (x int)")
        assert err.sqlstate == "42501"
    assert await pool.fetchval("SELECT count(*) FROM account_events") == 2  # registered twice, nothing else
    assert await pool.fetchval("SELECT count(*) FROM renewals") == 1


async def test_the_compliance_role_holds_and_releases_and_nothing_else(pool, db_url):
    await pool.execute("SELECT set_deadline('p-1', now() + interval '30 days')")
    async with login(db_url, ROLES.compliance) as compliance:
        assert await compliance.fetchval("SELECT deadline_cleanup.hold('p-1', 'legal case 17')") == "held"
        assert await compliance.fetchval("SELECT deadline_cleanup.release('p-1')") == "released"
        for sql in (
            "SELECT deadline_cleanup.set_deadline('p-1', now() + interval '1 day', true)",
            "SELECT deadline_cleanup.renew('p-1')",
            "DELETE FROM deadline_cleanup.account_events",
        ):
            assert (await refused(compliance, sql)).sqlstate == "42501", sql


async def test_the_worker_role_appends_to_the_audit_tables_and_rewrites_none(pool, db_url):
    await pool.execute("SELECT set_deadline('p-1', now() + interval '30 days')")
    await pool.execute("SELECT renew('p-1')")
    async with login(db_url, ROLES.worker) as worker:
        assert await worker.fetchval("SELECT count(*) FROM account_events") == 1
        for sql in (
            "DELETE FROM erasure_receipts",
            "UPDATE erasure_receipts SET targets = '[]'",
            "DELETE FROM account_events",
            "UPDATE account_events SET reason = 'x'",
            "DELETE FROM renewals",
            "UPDATE renewals SET outcome = 'too_late'",
            "DELETE FROM cleanup_failed",
            "TRUNCATE accounts",
            "UPDATE schema_migrations SET checksum = NULL",
            "UPDATE account_key_type SET key_type = 'uuid'",
        ):
            assert (await refused(worker, sql)).sqlstate == "42501", sql
        assert await worker.fetchval("SELECT set_deadline('p-2', now() + interval '1 day')") == "registered"


async def test_set_deadline_follows_the_renewal_rules_each_refusal_its_own_sqlstate(pool):
    deadline = datetime.now(UTC) + timedelta(days=30)
    assert await pool.fetchval("SELECT set_deadline('p-1', $1)", deadline) == "registered"
    past = await refused(pool, "SELECT set_deadline('p-1', now() - interval '1 second')")
    earlier = await refused(pool, "SELECT set_deadline('p-1', $1)", deadline - timedelta(days=1))
    assert (past.sqlstate, earlier.sqlstate) == ("DC001", "DC002")
    assert "allow_earlier" in (earlier.as_dict().get("hint") or "")
    later = deadline + timedelta(days=1)
    assert await pool.fetchval("SELECT set_deadline('p-1', $1)", later) == "moved"
    assert await pool.fetchval("SELECT set_deadline('p-1', $1, allow_earlier => true)", deadline) == "moved"

    assert await pool.fetchval("SELECT renew('p-1')") == "in_time"  # renewed for good
    rearmed = await refused(pool, "SELECT set_deadline('p-1', $1)", later)
    assert rearmed.sqlstate == "DC003" and "renewed for good" in str(rearmed)
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = 'p-1'") == "renewed"
    assert await pool.fetchval("SELECT set_deadline('p-1', $1, rearm => true)", later) == "moved"
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = 'p-1'") == "active"


async def test_the_contract_functions_run_as_the_owner_with_a_pinned_search_path(pool):
    rows = await pool.fetch(
        "SELECT p.proname::text AS name, p.prosecdef, pg_get_userbyid(p.proowner) AS owner, p.proconfig,"
        " has_function_privilege('public', p.oid, 'EXECUTE') AS public_may"
        " FROM pg_proc p WHERE p.pronamespace = 'deadline_cleanup'::regnamespace"
        " AND p.proname IN ('set_deadline', 'renew', 'renew_account', 'hold', 'release')"
    )
    assert len(rows) == 13  # with the uuid and bigint overloads of all but renew_account
    for r in rows:
        assert r["prosecdef"] and r["owner"] == ROLES.owner, dict(r)
        assert r["proconfig"] == ["search_path=deadline_cleanup, pg_temp"], dict(r)
        assert not r["public_may"], dict(r)
    assert not await pool.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", ROLES.owner), (
        "nobody logs in as the owner"
    )


async def test_a_second_database_with_its_own_roles_is_unreachable_from_the_first_logins(pool, db_url, admin_db_url):
    other = f"other_{uuid.uuid4().hex[:8]}"
    prefix = f"t{uuid.uuid4().hex[:6]}"
    other_url = await db.create_database(admin_db_url, other, settings=Settings(database_role_prefix=prefix))
    try:
        async with login(db_url, ROLES.game) as game, login(db_url, ROLES.worker) as worker:
            for role in (game, worker):
                name = await role.fetchval("SELECT current_user")
                conn = await asyncpg.connect(other_url, user=name)
                try:
                    for sql in (
                        "SELECT deadline_cleanup.set_deadline('p-1', now() + interval '1 day')",
                        "SELECT count(*) FROM deadline_cleanup.accounts",
                        "DELETE FROM deadline_cleanup.accounts",
                    ):
                        assert (await refused(conn, sql)).sqlstate == "42501", (name, sql)
                finally:
                    await conn.close()
        # The other database's own game role works there.
        async with login(other_url, f"{prefix}_game") as theirs:
            assert await theirs.fetchval("SELECT deadline_cleanup.set_deadline('p-1', now() + interval '1 day')")
    finally:
        await db.drop_database(admin_db_url, other)
        admin = await asyncpg.connect(admin_db_url)
        for suffix in ("game", "compliance", "worker", "owner"):
            await admin.execute(f"DROP ROLE IF EXISTS {prefix}_{suffix}")
        await admin.close()


async def test_migrate_by_a_database_owner_without_createrole_exits_2_naming_the_privilege(admin_db_url):
    name, owner = f"own_{uuid.uuid4().hex[:8]}", f"dbowner_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_db_url)
    await admin.execute(f"CREATE ROLE {owner} LOGIN")
    await admin.execute(f"CREATE DATABASE {name} OWNER {owner}")
    try:
        url = db.with_database(admin_db_url, name)
        conn = await asyncpg.connect(url, user=owner)
        try:
            with pytest.raises(InputError) as err:
                await db.migrate(conn, Settings(database_role_prefix=f"r{uuid.uuid4().hex[:6]}"))
        finally:
            await conn.close()
        assert "needs CREATEROLE" in str(err.value) and "CREATE ROLE" in str(err.value)
    finally:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.execute(f"DROP ROLE {owner}")
        await admin.close()


async def test_a_failed_account_may_be_held_and_retry_failed_skips_it_while_held(pool):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 3)
    bad = accounts[1]
    await claim_one_partition(pool, "held-failed", deadline)
    await poison_by_archive_check(pool, bad)
    compiled = await CompiledCleanup.compile(pool, load_targets())
    assert (await run_keyset_batch(pool, compiled, "held-failed", 0, "", 100)).counts.failed == 1
    assert await pool.fetchval("SELECT hold($1, 'legal case 18')", bad) == "held"

    await pool.execute("ALTER TABLE demo_game.match_history_archive DROP CONSTRAINT archive_score_sane")
    assert (await retry_failed(pool, load_targets(), "held-failed")).cleaned == 0
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", bad) == "cleanup_failed"
    # Even a batch that reaches the account (a retry listed before the hold) leaves it alone.
    result = await compiled_subset(pool, compiled, "held-failed", [bad])
    assert result == 0
    assert [r.account_id for r in await list_failed(pool, "held-failed")] == [bad]

    assert await pool.fetchval("SELECT release($1)", bad) == "released"
    assert (await retry_failed(pool, load_targets(), "held-failed")).cleaned == 1


async def compiled_subset(pool: asyncpg.Pool, compiled: CompiledCleanup, cleanup_id: str, accounts: list[str]) -> int:
    async with pool.acquire() as conn, conn.transaction():
        subset = compiled.subset_args(cleanup_id=cleanup_id, partition_no=0, account_ids=accounts)
        row = await conn.fetchrow(compiled.subset_sql, *subset)
    assert row is not None
    return int(row["cleaned"])


async def test_a_game_trigger_message_never_reaches_the_failure_record(pool):
    deadline = deadline_in(-60)
    await seed(pool, deadline, 2)
    email = "real.person@example.org"
    await pool.execute(
        f"""
        CREATE FUNCTION demo_game.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'owner {email} objects'; END $$;
        CREATE TRIGGER refuse BEFORE DELETE ON demo_game.cloud_saves FOR EACH ROW EXECUTE FUNCTION demo_game.refuse();
        """
    )
    await claim_one_partition(pool, "trigger-text", deadline)
    compiled = await CompiledCleanup.compile(pool, load_targets())
    assert (await run_keyset_batch(pool, compiled, "trigger-text", 0, "", 100)).counts.failed == 2
    stored = await pool.fetch("SELECT message, detail, sqlstate FROM cleanup_failed")
    assert {r["sqlstate"] for r in stored} == {"P0001"}
    assert not [r for r in stored if email in f"{r['message']} {r['detail']}"]
    bound = CLEANUP_SQL.bind("failed_reasons", cleanup_id="trigger-text", most=5)
    reasons = [r["reason"] for r in await pool.fetch(CLEANUP_SQL.failed_reasons, *bound)]
    assert reasons == ["2 account(s): [P0001] raised by a trigger or function in demo_game.cloud_saves"]


async def test_a_stored_anonymize_key_is_kept_and_another_is_refused_until_rotated(pool):
    async with pool.acquire() as conn:
        assert await store_key(conn, ANONYMIZE_KEY) == "stored"
        assert await store_key(conn, ANONYMIZE_KEY) == "kept"
        with pytest.raises(TargetsRefused) as refused_key:
            await store_key(conn, "another-key-of-at-least-32-bytes-long!")
        assert "rotate-key" in str(refused_key.value) and ANONYMIZE_KEY not in str(refused_key.value)
        assert await store_key(conn, "another-key-of-at-least-32-bytes-long!", rotate=True) == "stored"


async def test_the_anonymize_key_never_reaches_the_server_log(pool, db_url, monkeypatch):
    """Every statement and its parameters logged: the start-up check and a cleanup that hashes."""
    log_file = await server_log(pool)
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)
    await create_game_schema(pool)
    users = await seed_game_users(pool, 10)
    deadline = deadline_in(-60)
    await pool.execute("SELECT set_deadline(u, $2) FROM unnest($1::text[]) u", users, deadline)
    database = await pool.fetchval("SELECT current_database()")
    await pool.execute(f"ALTER DATABASE {database} SET log_statement = 'all'")
    await pool.execute(f"ALTER DATABASE {database} SET log_min_duration_statement = 0")
    await pool.expire_connections()
    start = log_file.stat().st_size
    try:
        await claim_one_partition(pool, "logged", deadline)
        compiled = await CompiledCleanup.compile(pool, game_targets(), Settings.from_env().cleanup)
        assert (await run_keyset_batch(pool, compiled, "logged", 0, "", 100)).counts.cleaned == 10
        assert await pool.fetchval("SELECT 'a statement the log must show'")
    finally:
        await pool.execute(f"ALTER DATABASE {database} RESET log_statement")
        await pool.execute(f"ALTER DATABASE {database} RESET log_min_duration_statement")
        await pool.expire_connections()
    with open(log_file, "rb") as f:
        f.seek(start)
        logged = f.read().decode(errors="replace")
    assert "a statement the log must show" in logged, "the log is the server's, and it logs statements"
    assert "inner_pad FROM anonymize_key" in logged, "the cleanup's hashing statement was logged"
    inner, outer = anonymize_key_pads(ANONYMIZE_KEY)
    for secret in (ANONYMIZE_KEY, inner.hex(), outer.hex(), ANONYMIZE_KEY.encode().hex()):
        assert secret not in logged.replace("\\x", ""), "the key or its pads reached the server log"


async def server_log(pool: asyncpg.Pool) -> Path:
    """The file the server writes its log to (the embedded Postgres: `<data_directory>/log`)."""
    data = Path(await pool.fetchval("SHOW data_directory"))
    current = await pool.fetchval("SELECT pg_current_logfile()")
    path = data / current if current else data / "log"
    if not path.exists():
        pytest.skip(f"the server's log is not a file here ({path}); the embedded Postgres writes one")
    return path


@pytest.mark.parametrize("where", ["dsn", "database"])
async def test_a_worker_refuses_to_start_where_a_clock_offset_is_set(pool, db_url, where):
    """The deletion clock is the database's: a DSN parameter or a database setting that would move
    it makes the worker exit 2 naming it, before it polls anything."""
    url = db_url
    database = await pool.fetchval("SELECT current_database()")
    if where == "dsn":
        url = f"{db_url}{'&' if '?' in db_url else '?'}cleanup.clock_offset=7%20days"
    else:
        await pool.execute(f"ALTER DATABASE {database} SET cleanup.clock_offset = '7 days'")
    env = {**os.environ, "DATABASE_URL": url, "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "worker.py"],
            cwd=PROJECT_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        await pool.execute(f"ALTER DATABASE {database} RESET cleanup.clock_offset")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cleanup.clock_offset is set" in done.stderr and "Traceback" not in done.stderr


async def test_a_registration_that_can_never_be_cleaned_is_dismissed_and_never_claimed_again(pool):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 2)
    bad = accounts[0]
    await claim_one_partition(pool, "dismissal", deadline)
    await poison_by_archive_check(pool, bad)
    compiled = await CompiledCleanup.compile(pool, load_targets())
    assert (await run_keyset_batch(pool, compiled, "dismissal", 0, "", 100)).counts.failed == 1
    assert (await dismiss_account(pool, bad, "its data was erased by hand")).result == "dismissed"
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", bad) == "dismissed"
    assert [r.resolution for r in await list_failed(pool, "dismissal", include_resolved=True)] == ["dismissed"]
    assert (await retry_failed(pool, load_targets(), "dismissal")).retried == 0
    assert await pool.fetchval("SELECT renew($1)", bad) == "too_late"
    assert (await dismiss_account(pool, accounts[1], "cleaned already")).result == "not_dismissable"
    events = await pool.fetch("SELECT kind, reason FROM account_events WHERE account_id = $1", bad)
    assert [(e["kind"], e["reason"]) for e in events][-1] == ("dismissed", "its data was erased by hand")


async def test_retry_failed_with_the_current_targets_when_said_so_keeps_the_set_it_ran_with(pool):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 3)
    targets = load_targets()
    await claim_one_partition(pool, "adopt", deadline)
    await pool.execute(
        CLEANUP_SQL.record_cleanup_target_set,
        *CLEANUP_SQL.bind("record_cleanup_target_set", cleanup_id="adopt", fingerprint=targets.fingerprint),
    )
    await poison_by_archive_check(pool, accounts[1])
    compiled = await CompiledCleanup.compile(pool, targets)
    assert (await run_keyset_batch(pool, compiled, "adopt", 0, "", 100)).counts.failed == 1
    await pool.execute("ALTER TABLE demo_game.match_history_archive DROP CONSTRAINT archive_score_sane")

    fixed = CleanupTargets(target=targets.target[:-1])  # the operator's corrected file: another set
    with pytest.raises(InputError, match="target set mismatch"):
        await retry_failed(pool, fixed, "adopt")
    assert (await retry_failed(pool, fixed, "adopt", adopt_targets=True)).cleaned == 1
    run = await pool.fetchrow("SELECT * FROM cleanup_target_runs WHERE cleanup_id = 'adopt'")
    assert run is not None
    assert (run["fingerprint"], run["replaced_fingerprints"]) == (fixed.fingerprint, [targets.fingerprint])


async def test_rotate_key_from_the_cli_replaces_the_stored_key(pool, db_url, monkeypatch):
    async with pool.acquire() as conn:
        await store_key(conn, ANONYMIZE_KEY)
    new_key = "a-new-anonymize-key-of-at-least-32-bytes"
    env = {**os.environ, "DATABASE_URL": db_url, ANONYMIZE_KEY_ENV: new_key}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "starter.py", "targets", "rotate-key", "--json"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert new_key not in done.stdout + done.stderr
    async with pool.acquire() as conn:
        assert await store_key(conn, new_key) == "kept"
