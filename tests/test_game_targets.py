"""Targets on a game's own tables (tests/game_server): the start-up check under the worker's own
role, and each target comparing with its column's own type, so its index is used."""

from __future__ import annotations

from collections.abc import Mapping

import asyncpg
import pytest

from cleanup.batches import CompiledCleanup
from cleanup.target_check import TargetsRefused
from cleanup.targets import ANONYMIZE_KEY_ENV, CleanupTargets
from tests.game_schema import ANONYMIZE_KEY, create_game_schema, game_targets, worker_role_pool


@pytest.fixture(autouse=True)
def anonymize_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)


def with_targets(*entries: Mapping[str, object]) -> CleanupTargets:
    return CleanupTargets.model_validate({"target": list(entries)})


async def refused(pool: asyncpg.Pool, targets: CleanupTargets) -> str:
    with pytest.raises(TargetsRefused) as err:
        await CompiledCleanup.compile(pool, targets)
    return str(err.value)


async def test_the_game_schema_compiles_under_its_worker_role(pool, db_url):
    await create_game_schema(pool)
    async with worker_role_pool(db_url) as worker:
        compiled = await CompiledCleanup.compile(worker, game_targets())
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
    compiled = await CompiledCleanup.compile(pool, with_targets(target))
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
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, "short")
    message = await refused(pool, game_targets())
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
    compiled = await CompiledCleanup.compile(pool, targets)
    async with pool.acquire() as conn, conn.transaction():
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + compiled.subset_sql, "c", 0, ["x"], 1))
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
    compiled = await CompiledCleanup.compile(pool, game_targets())
    assert ended and compiled.fingerprint == game_targets().fingerprint
