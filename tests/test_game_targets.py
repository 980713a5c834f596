"""Targets on a game's own tables (tests/game_server): the start-up check under the worker's own
role, and each target comparing with its column's own type, so its index is used."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from datetime import timedelta

import asyncpg
import pytest
from pydantic import SecretStr

from activities.cleanup import CleanupActivities
from cleanup.batches import CompiledCleanup
from cleanup.planner import _targets_missing_index
from cleanup.review import preview_cleanup
from cleanup.target_check import TINY_TABLE_ROWS, TargetsRefused
from cleanup.targets import ANONYMIZE_KEY_ENV, CleanupTargets, load_targets
from core.config import PROJECT_ROOT, CleanupSettings
from tests.game_schema import (
    ANONYMIZE_KEY,
    PROFILES_TARGETS_FILE,
    add_profiles,
    create_game_schema,
    game_targets,
    seed_game_users,
    worker_role_pool,
)
from tests.helpers import claim_one_partition, deadline_in

# The key the workers run with: their settings' CLEANUP_ANONYMIZE_KEY, read once at start.
KEYED = CleanupSettings(anonymize_key=SecretStr(ANONYMIZE_KEY))


@pytest.fixture(autouse=True)
def anonymize_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)


def with_targets(*entries: Mapping[str, object]) -> CleanupTargets:
    return CleanupTargets.model_validate({"target": list(entries)})


async def refused(pool: asyncpg.Pool, targets: CleanupTargets, settings: CleanupSettings = KEYED) -> str:
    with pytest.raises(TargetsRefused) as err:
        await CompiledCleanup.compile(pool, targets, settings)
    return str(err.value)


async def test_the_game_schema_compiles_under_its_worker_role(pool, db_url):
    await create_game_schema(pool)
    async with worker_role_pool(db_url) as worker:
        compiled = await CompiledCleanup.compile(worker, game_targets(), KEYED)
    assert "::uuid[]" in compiled.batch_sql  # each target compares with its column's own type
    assert "OVERRIDING SYSTEM VALUE" in compiled.batch_sql  # the LIKE ... INCLUDING ALL archive's identity
    assert '"ratio"' not in compiled.batch_sql.split("matches_archive")[1].split("FROM")[0]  # generated: recomputed


async def test_a_missing_delete_privilege_is_named_at_start_up(pool, db_url):
    await create_game_schema(pool)
    async with worker_role_pool(db_url, without=("DELETE", "friends")) as worker:
        message = await refused(worker, game_targets())
    assert "game_server.friends (user_a)" in message and "lacks DELETE on game_server.friends" in message
    assert "GRANT DELETE ON game_server.friends TO game_worker_" in message


async def test_the_service_own_tables_are_refused_as_targets(pool):
    for table in ("outbox", "cleanup_applied", "renewals"):
        message = await refused(pool, with_targets({"table": table, "action": "delete"}))
        assert f"{table} is one of the service's own tables" in message


async def test_lossy_casts_into_an_archive_are_refused(pool):
    await pool.execute(
        """
        CREATE TABLE public.scores (account_id text NOT NULL, points numeric NOT NULL, seen timestamptz NOT NULL);
        CREATE TABLE public.scores_archive (account_id text NOT NULL, points integer NOT NULL, seen date NOT NULL);
        """
    )
    target = {"table": "scores", "action": "archive", "archive_table": "scores_archive"}
    message = await refused(pool, with_targets(target))
    assert "column 'points' is integer, the source's is numeric" in message
    assert "ALTER TABLE public.scores_archive ALTER COLUMN points TYPE numeric" in message
    assert "column 'seen' is date, the source's is timestamp with time zone" in message


async def test_a_like_including_all_archive_is_accepted_and_widening_too(pool):
    await pool.execute(
        """
        CREATE TABLE public.scores (id bigint GENERATED ALWAYS AS IDENTITY, account_id text, points integer,
                                    double_points bigint GENERATED ALWAYS AS (points * 2) STORED, rank smallint);
        CREATE TABLE public.scores_archive (LIKE public.scores INCLUDING ALL);
        ALTER TABLE public.scores_archive ALTER COLUMN rank TYPE integer;
        """
    )
    target = {"table": "scores", "action": "archive", "archive_table": "scores_archive"}
    compiled = await CompiledCleanup.compile(pool, with_targets(target), KEYED)
    assert "OVERRIDING SYSTEM VALUE" in compiled.batch_sql


async def test_a_cascade_no_target_counts_is_refused_naming_the_fix(pool):
    await create_game_schema(pool)
    targets = game_targets()
    without_inventory = CleanupTargets(target=[t for t in targets.target if t.table != "game_server.inventory"])
    message = await refused(pool, without_inventory)
    assert "deleting its rows removes rows of game_server.inventory by ON DELETE CASCADE" in message
    assert "declare a target on game_server.inventory with match_column = 'user_id' before it" in message
    parents_first = CleanupTargets(target=[targets.target[1], targets.target[0], *targets.target[2:]])
    assert "game_server.inventory" in await refused(pool, parents_first)


async def test_anonymize_refuses_a_not_null_column_and_a_short_hash_column(pool):
    await create_game_schema(pool)
    await pool.execute("ALTER TABLE game_server.users ADD COLUMN tag varchar(20)")
    target = {"table": "game_server.users", "match_column": "id", "action": "anonymize"}
    message = await refused(pool, with_targets(target | {"null_columns": ["username"], "hash_columns": ["tag"]}))
    assert "column 'username' is NOT NULL" in message
    assert "column 'tag' is character varying(20)" in message


async def test_hash_columns_need_the_key_setting(pool, monkeypatch):
    await create_game_schema(pool)
    message = await refused(pool, game_targets(), CleanupSettings(anonymize_key=SecretStr("short")))
    assert ANONYMIZE_KEY_ENV in message and "short" not in message.replace("shorter", "")


async def test_a_uuid_key_is_found_by_its_index_on_a_million_rows(pool):
    """The batch statement's target reaches a 1M-row UUID-keyed table by its index, never a scan."""
    await pool.execute(
        """
        CREATE TABLE public.sessions (id bigint PRIMARY KEY, player uuid NOT NULL, data text);
        INSERT INTO public.sessions SELECT g, gen_random_uuid(), 'x' FROM generate_series(1, 1000000) g;
        CREATE INDEX sessions_player_idx ON public.sessions (player);
        ANALYZE public.sessions;
        """
    )
    targets = with_targets({"table": "sessions", "match_column": "player", "action": "delete"})
    compiled = await CompiledCleanup.compile(pool, targets, KEYED)
    async with pool.acquire() as conn, conn.transaction():
        subset = compiled.subset_args(cleanup_id="c", partition_no=0, account_ids=["x"])
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + compiled.subset_sql, *subset))
    sessions = [line for line in plan.splitlines() if "sessions" in line]
    assert any("Index" in line and "sessions_player_idx" in line for line in sessions), plan
    assert not any("Seq Scan" in line for line in sessions), plan
    print(plan)


def test_a_table_may_appear_in_several_targets_only_with_different_match_columns():
    friends = {"table": "game_server.friends", "action": "delete"}
    with_targets(friends | {"match_column": "user_a"}, friends | {"match_column": "user_b"})
    with pytest.raises(ValueError, match="different match_columns"):
        with_targets(friends | {"match_column": "user_a"}, friends | {"match_column": "user_a"})


async def test_a_connection_lost_during_the_start_up_check_refuses_nothing_and_is_checked_again(pool, monkeypatch):
    """A connection ended under the trial (a restarting database, an idle-in-transaction timeout on a
    starved machine) is the connection's fault, not a target's: the check runs again on a new one."""
    trial = CompiledCleanup._trial
    ended: list[int] = []

    async def trial_on_a_connection_ended_once(self, conn, targets, preview_sql):
        if not ended:
            ended.append(conn.get_server_pid())
            await pool.execute("SELECT pg_terminate_backend($1)", ended[0])
        return await trial(self, conn, targets, preview_sql)

    monkeypatch.setattr(CompiledCleanup, "_trial", trial_on_a_connection_ended_once)
    await create_game_schema(pool)
    compiled = await CompiledCleanup.compile(pool, game_targets(), KEYED)
    assert ended and compiled.fingerprint == game_targets().fingerprint


# --- a server's shape: JSON profiles NOT NULL, a unique username, an unindexed match column ----------


async def profiled_game(pool: asyncpg.Pool, users: int = 5, notifications: int = 20_000) -> list[str]:
    await create_game_schema(pool)
    ids = await seed_game_users(pool, users)
    await add_profiles(pool, ids, notifications)
    return ids


async def clean_now(pool: asyncpg.Pool, ids: list[str], targets: CleanupTargets) -> asyncpg.Record:
    """The batch statement over these accounts, registered and claimed as the game and a cleanup would."""
    deadline = deadline_in(-60)
    outcomes = await pool.fetch("SELECT deadline_cleanup.set_deadline(u, $2) FROM unnest($1::text[]) u", ids, deadline)
    assert len(outcomes) == len(ids)
    await claim_one_partition(pool, "profiles", deadline)
    compiled = await CompiledCleanup.compile(pool, targets, KEYED)
    async with pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(
            compiled.batch_sql,
            *compiled.batch_args(cleanup_id="profiles", partition_no=0, after_account_id="", batch_size=1000),
        )
    assert row is not None and row["cleaned"] == len(ids)
    return row


async def test_a_json_profile_is_erased_and_a_unique_username_replaced_at_random(pool):
    ids = await profiled_game(pool, users=6, notifications=100)
    cleaned, kept = ids[:4], ids[4:]
    await clean_now(pool, cleaned, load_targets(PROFILES_TARGETS_FILE))
    rows = await pool.fetch(
        "SELECT id::text, username, email, profile, metadata::text FROM game_server.users ORDER BY id"
    )
    by_id = {r["id"]: r for r in rows}
    for user in cleaned:
        r = by_id[user]
        assert r["metadata"] == "{}" and r["email"] is None and r["profile"] is None
        assert r["username"].startswith("anon-") and user not in r["username"]
    assert len({by_id[u]["username"] for u in cleaned}) == len(cleaned)  # still unique
    for user in kept:
        assert "Real Name" in by_id[user]["metadata"] and by_id[user]["username"] == f"player_{user}"
    left = await pool.fetchval(
        "SELECT count(*) FROM game_server.notifications"
        " WHERE recipient_id = ANY($1::uuid[]) OR sender_id = ANY($1::uuid[])",
        cleaned,
    )
    assert left == 0


async def test_the_receipt_names_each_targets_match_column(pool):
    ids = await profiled_game(pool, users=2, notifications=10)
    await clean_now(pool, ids, load_targets(PROFILES_TARGETS_FILE))
    receipt = await pool.fetchval(
        "SELECT targets::text FROM deadline_cleanup.erasure_receipts WHERE account_id = $1", ids[0]
    )
    entries = json.loads(receipt)
    notifications = [(e["match_column"], e["rows"]) for e in entries if e["target"] == "game_server.notifications"]
    assert notifications == [("recipient_id", 1), ("sender_id", 1)]


async def test_a_set_constant_is_a_value_never_sql(pool):
    """A constant from the file is quoted as a literal: quotes and backslashes stay characters."""
    ids = await profiled_game(pool, users=1, notifications=10)
    value = "x'); DROP TABLE game_server.friends; -- \\' \\\\"
    target = {"table": "game_server.users", "match_column": "id", "action": "anonymize"}
    await clean_now(
        pool, ids, with_targets(target | {"set_columns": {"email": value, "created_at": {"default": True}}})
    )
    assert await pool.fetchval("SELECT email FROM game_server.users") == value
    assert await pool.fetchval("SELECT to_regclass('game_server.friends') IS NOT NULL")


async def test_the_new_column_kinds_are_checked_at_start_up(pool):
    await profiled_game(pool, users=1, notifications=10)
    await pool.execute("ALTER TABLE game_server.users ADD COLUMN level integer NOT NULL DEFAULT 1")
    users = {"table": "game_server.users", "match_column": "id", "action": "anonymize"}
    message = await refused(pool, with_targets(users | {"null_columns": ["metadata"]}))
    assert "column 'metadata' is NOT NULL (fix: erase it with set_columns = { metadata = <a constant> }" in message
    message = await refused(pool, with_targets(users | {"hash_columns": ["metadata"]}))
    assert (
        "column 'metadata' is jsonb: a keyed hash is 64 hex characters of text (fix: erase it by set_columns" in message
    )
    message = await refused(pool, with_targets(users | {"set_columns": {"metadata": "{not json", "level": "high"}}))
    assert "column 'metadata' is jsonb, which refuses the constant '{not json'" in message
    assert "column 'level' is integer, which refuses the constant 'high'" in message
    message = await refused(pool, with_targets(users | {"set_columns": {"metadata": {"default": True}}}))
    assert "column 'metadata' has no DEFAULT and is NOT NULL" in message
    message = await refused(pool, with_targets(users | {"random_columns": ["level", "nickname"]}))
    assert "column 'level' is integer: a random replacement is a uuid" in message
    assert "column 'nickname' does not exist in game_server.users" in message
    compiled = await CompiledCleanup.compile(pool, with_targets(users | {"set_columns": {"level": 0}}), KEYED)
    assert "\"level\" = E'0'" in compiled.batch_sql


async def test_a_match_column_without_an_index_is_reported_with_its_fix_until_built(pool):
    await profiled_game(pool, users=2, notifications=20_000)
    compiled = await CompiledCleanup.compile(pool, load_targets(PROFILES_TARGETS_FILE), KEYED)
    [missing] = compiled.missing_indexes
    assert (missing.table, missing.match_column) == ("game_server.notifications", "sender_id")
    assert missing.row_estimate >= TINY_TABLE_ROWS
    fix = "CREATE INDEX CONCURRENTLY IF NOT EXISTS notifications_sender_id_idx ON game_server.notifications (sender_id)"
    assert missing.fix == fix
    # Recorded by a worker, shown by `planner status` for as long as it lasts.
    targets = load_targets(PROFILES_TARGETS_FILE)
    await pool.execute(
        "INSERT INTO deadline_cleanup.cleanup_target_sets (fingerprint, targets) VALUES ($1, $2::jsonb)",
        targets.fingerprint,
        targets.model_dump_json(),
    )
    assert [line.endswith(fix) for line in await _targets_missing_index(pool)] == [True]
    await pool.execute(fix)
    assert not (await CompiledCleanup.compile(pool, targets, KEYED)).missing_indexes
    assert await _targets_missing_index(pool) == []


async def test_a_tiny_table_needs_no_index(pool):
    await profiled_game(pool, users=2, notifications=100)
    assert not (await CompiledCleanup.compile(pool, load_targets(PROFILES_TARGETS_FILE), KEYED)).missing_indexes


def run(argv: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)


async def test_targets_check_prints_what_a_cleanup_does_per_account(pool, db_url):
    await profiled_game(pool, users=2, notifications=20_000)
    env = os.environ | {"DATABASE_URL": db_url, ANONYMIZE_KEY_ENV: ANONYMIZE_KEY}
    argv = [sys.executable, "starter.py", "targets", "check", "--file", str(PROFILES_TARGETS_FILE)]
    done = await asyncio.to_thread(run, [*argv, "--json"], env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    by = {(t["table"], t["match_column"]): t for t in report["targets"]}
    assert by[("game_server.notifications", "recipient_id")]["index"] == "notifications_recipient_idx"
    assert by[("game_server.notifications", "sender_id")]["index"] is None
    assert by[("game_server.inventory", "user_id")]["covers_cascades"] == [
        "game_server.characters ON DELETE CASCADE (inventory_character_id_user_id_fkey)"
    ]
    users = by[("game_server.users", "id")]
    assert users["unchanged_columns"] == ["created_at"]
    assert users["changed_columns"]["username"] == "random (anonymous)"
    assert [m["match_column"] for m in report["missing_indexes"]] == ["sender_id"]
    human = await asyncio.to_thread(run, argv, env)
    assert human.returncode == 0, human.stderr
    assert "leaves unchanged: created_at" in human.stdout
    assert "WARNING: target game_server.notifications (sender_id)" in human.stdout
    assert "CREATE INDEX CONCURRENTLY IF NOT EXISTS notifications_sender_id_idx" in human.stdout


async def test_the_dry_run_takes_a_window_of_deadlines_and_names_each_match_column(pool, db_url):
    """Deadlines a microsecond apart, found by a window given to the second; per target its column."""
    ids = await profiled_game(pool, users=4, notifications=10)
    first = deadline_in(3600).replace(microsecond=123456)
    for n, user in enumerate(ids):
        await pool.execute("SELECT deadline_cleanup.set_deadline($1, $2)", user, first + timedelta(microseconds=n))
    targets = load_targets(PROFILES_TARGETS_FILE)
    start = first.replace(microsecond=0)
    preview = await preview_cleanup(pool, targets, window=(start, start + timedelta(seconds=1)))
    assert (preview.scope, preview.accounts_in_scope, preview.deadline) == ("window", 4, None)
    rows = {(t.table, t.match_column): t.rows for t in preview.targets}
    assert rows[("game_server.notifications", "recipient_id")] == 4
    assert rows[("game_server.notifications", "sender_id")] == 4
    assert rows[("game_server.users", "id")] == 4
    later = await preview_cleanup(pool, targets, window=(first + timedelta(microseconds=2), None))
    assert later.accounts_in_scope == 2
    env = os.environ | {"DATABASE_URL": db_url, "CLEANUP_TARGETS_FILE": str(PROFILES_TARGETS_FILE)}
    argv = [sys.executable, "starter.py", "cleanup", "--dry-run", "--from", start.isoformat()]
    done = await asyncio.to_thread(run, [*argv, "--to", (start + timedelta(seconds=1)).isoformat(), "--json"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["targets"] == preview.model_dump(mode="json")["targets"]
    refused = await asyncio.to_thread(run, [*argv[:-2], "--deadline", start.isoformat(), "--to", "2030-01-01Z"], env)
    assert refused.returncode == 2 and "--to ends a window that --from starts" in refused.stderr


async def test_a_worker_warns_of_a_missing_index_at_start_up(pool, caplog):
    await profiled_game(pool, users=2, notifications=20_000)
    with caplog.at_level(logging.WARNING, logger="cleanup"):
        await CleanupActivities.create(pool, load_targets(PROFILES_TARGETS_FILE), settings=KEYED)
    [warning] = [r.getMessage() for r in caplog.records if "no index" in r.getMessage()]
    assert warning.startswith("target game_server.notifications (sender_id): no index on game_server.notifications")
    assert "fix: CREATE INDEX CONCURRENTLY IF NOT EXISTS notifications_sender_id_idx" in warning
