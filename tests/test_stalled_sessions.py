"""A client paused inside a statement's exchange keeps its locks; the workers end such sessions.

Real Postgres, real asyncpg. The stall is made as a frozen worker makes it: `Connection.prepare`
sends Parse/Describe with a Flush and no Sync (as asyncpg does for every statement it has not
cached), and the client then sends nothing more.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import asyncpg
import pytest

from budget.controller import SQL as BUDGET_SQL
from budget.controller import BudgetSettings, LoadBudget
from core import db
from core.sessions import StalledSessions
from tests.helpers import wait_until

IDLE_TIMEOUT = 0.5
YOUNG_TIMEOUT = 60.0


async def ours(db_url: str) -> asyncpg.Connection:
    """A session as this service's pools open it (their application_name)."""
    return await asyncpg.connect(
        db_url, server_settings={"application_name": db.APPLICATION_NAME, **db.service_settings()}
    )


async def game(db_url: str) -> asyncpg.Connection:
    """A game server's session under the same login as the service."""
    return await asyncpg.connect(db_url, server_settings={"application_name": "game-server", **db.service_settings()})


async def end_stalled(db_url: str, after: float) -> list[dict[str, Any]]:
    check = StalledSessions(db_url, after)
    try:
        return await check.end_stalled_lock_holders()
    finally:
        await check.close()


async def stall_holding(conn: asyncpg.Connection, lock_sql: str, next_sql: str = "SELECT $1::int AS next") -> int:
    """Open a transaction, take a lock, then stop between Parse and Bind of `next_sql` (what
    pg_stat_activity then shows as the session's query); returns the backend's pid."""
    await conn.execute("BEGIN")
    await conn.execute(lock_sql)
    await conn.prepare(next_sql)  # Parse/Describe/Flush: the backend waits for Bind
    return int(conn.get_server_pid())


async def state_of(pool: asyncpg.Pool, pid: int) -> tuple[str, str] | None:
    row = await pool.fetchrow("SELECT state, wait_event FROM pg_stat_activity WHERE pid = $1", pid)
    return None if row is None else (row["state"], row["wait_event"])


async def blocked(pool: asyncpg.Pool, pid: int) -> bool:
    return bool(await pool.fetchval("SELECT cardinality(pg_blocking_pids($1)) > 0", pid))


async def waited_on(pool: asyncpg.Pool, pid: int) -> bool:
    waiting = "SELECT count(*) > 0 FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))"
    return bool(await pool.fetchval(waiting, pid))


async def test_the_idle_timeout_does_not_end_a_client_stalled_inside_a_statement(db_url: str, pool: asyncpg.Pool):
    """The premise: past idle_in_transaction_session_timeout the stalled session still holds its lock."""
    holders = await db.create_pool(db_url, min_size=1, max_size=1, idle_in_transaction_timeout=IDLE_TIMEOUT)
    try:
        async with holders.acquire() as conn:
            pid = await stall_holding(conn, "SELECT pg_advisory_xact_lock(4242)")
            await asyncio.sleep(IDLE_TIMEOUT * 4)
            assert await state_of(pool, pid) == ("active", "ClientRead")
            with pytest.raises(asyncpg.LockNotAvailableError):
                async with pool.acquire() as other, other.transaction():
                    await other.execute("SET LOCAL lock_timeout = '300ms'")
                    await other.execute("SELECT pg_advisory_xact_lock(4242)")
            await conn.close()  # the client goes away: the lock goes with it
    finally:
        await holders.close()


async def test_a_stalled_holder_of_the_budget_lock_is_ended_and_the_budget_moves_on(db_url: str, pool: asyncpg.Pool):
    """The harness's zombie, reduced: a worker frozen between the budget's lock and its acquire
    statement. Every other acquire waits; one check ends the stalled session; the acquire goes on."""
    zombie = await ours(db_url)
    try:
        pid = await stall_holding(zombie, BUDGET_SQL.lock_budget)
        budget = LoadBudget(pool, BudgetSettings(quiet_seconds=0))

        async def one_batch() -> int | None:
            async with budget.batch("ledger", 10) as grant:
                grant.rows_done = 10
                return grant.slot

        acquire = asyncio.create_task(one_batch())

        async def acquire_waits_on_the_zombie() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event = 'advisory' AND $1 = ANY (pg_blocking_pids(pid))",
                    pid,
                )
            )

        await wait_until(acquire_waits_on_the_zombie, within=10, interval=0.05)
        await asyncio.sleep(IDLE_TIMEOUT * 3)
        assert not acquire.done(), "the acquire waits on the stalled session's lock"

        ended = await end_stalled(db_url, IDLE_TIMEOUT)
        assert [r["pid"] for r in ended] == [pid] and all(r["ended"] for r in ended), ended
        assert ended[0]["stalled_seconds"] >= IDLE_TIMEOUT * 3
        assert await asyncio.wait_for(acquire, 10) is not None, "the batch had its slot"
        await wait_until(lambda: _gone(pool, pid), within=10, interval=0.05)
        with pytest.raises((asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError, OSError)):
            await zombie.execute("SELECT 1")  # the zombie's late statement finds its session ended
    finally:
        await zombie.close()


async def _gone(pool: asyncpg.Pool, pid: int) -> bool:
    return await state_of(pool, pid) is None


async def test_sessions_that_are_not_stalled_lock_holders_are_left_alone(db_url: str, pool: asyncpg.Pool):
    """Not ended: a stalled session nobody waits on; a stalled one younger than the timeout; a
    session idle in its transaction (the server's own timeout decides that one); a waiter."""
    conns = [await ours(db_url) for _ in range(4)]
    try:
        alone, young, idle, waiter = conns
        alone_pid = await stall_holding(alone, "SELECT pg_advisory_xact_lock(1)")
        await idle.execute("BEGIN")
        await idle.execute("SELECT pg_advisory_xact_lock(2)")
        idle_pid = idle.get_server_pid()
        waiting = asyncio.create_task(waiter.execute("SELECT pg_advisory_lock(2)"))
        await asyncio.sleep(IDLE_TIMEOUT * 3)
        await wait_until(lambda: blocked(pool, waiter.get_server_pid()), within=10, interval=0.05)
        assert await end_stalled(db_url, IDLE_TIMEOUT * 2) == []
        young_pid = await stall_holding(young, "SELECT pg_advisory_xact_lock(3)")
        waiting_young = asyncio.create_task(pool.execute("SELECT pg_advisory_lock(3), pg_advisory_unlock(3)"))
        await wait_until(lambda: waited_on(pool, young_pid), within=10, interval=0.05)
        # Younger than the timeout: a timeout no loaded machine outlasts between the stall and the check.
        assert await end_stalled(db_url, YOUNG_TIMEOUT) == []
        for pid, state in ((alone_pid, "active"), (idle_pid, "idle in transaction"), (young_pid, "active")):
            found = await state_of(pool, pid)
            assert found is not None and found[0] == state, (pid, found)
        assert not waiting.done() and not waiting_young.done()
        # Once old enough, the young one is ended (someone waits on it); the others still are not.
        await asyncio.sleep(IDLE_TIMEOUT * 2)
        ended = await end_stalled(db_url, IDLE_TIMEOUT * 2)
        assert [r["pid"] for r in ended] == [young_pid]
        await asyncio.wait_for(waiting_young, 10)
        assert await state_of(pool, alone_pid) is not None and await state_of(pool, idle_pid) is not None
        await idle.execute("ROLLBACK")
        await asyncio.wait_for(waiting, 10)
    finally:
        for c in conns:
            c.terminate()


async def test_a_game_session_under_the_same_login_is_left_alone(db_url: str, pool: asyncpg.Pool, caplog):
    """Same login, same stall, someone waiting on each: only the service's own session is ended,
    and no session's SQL (literals included) reaches the log."""
    game_conn, our_conn = await game(db_url), await ours(db_url)
    try:
        literal = "player-secret-4711"
        next_sql = f"SELECT $1::int, '{literal}' AS next"
        game_pid = await stall_holding(game_conn, "SELECT pg_advisory_xact_lock(7)", next_sql)
        our_pid = await stall_holding(our_conn, "SELECT pg_advisory_xact_lock(8)", next_sql)
        lock_and_release = "SELECT pg_advisory_lock($1), pg_advisory_unlock($1)"
        waiting = [asyncio.create_task(pool.execute(lock_and_release, k)) for k in (7, 8)]
        for pid in (game_pid, our_pid):
            await wait_until(functools.partial(_has_waiters, db_url, pid), within=10, interval=0.05)
        await asyncio.sleep(IDLE_TIMEOUT * 3)

        with caplog.at_level(logging.WARNING, logger="sessions"):
            ended = await end_stalled(db_url, IDLE_TIMEOUT)
        assert [r["pid"] for r in ended] == [our_pid]
        assert await state_of(pool, game_pid) == ("active", "ClientRead"), "the game's session is not ours to end"
        assert str(our_pid) in caplog.text and literal not in caplog.text
        await asyncio.wait_for(waiting[1], 10)
        assert not waiting[0].done()
    finally:
        game_conn.terminate()
        our_conn.terminate()
    await asyncio.wait_for(waiting[0], 10)


async def test_a_pool_drained_by_waiters_does_not_starve_the_check(db_url: str):
    """The worker's pool is drained: the load budget's session holds one connection and two budgeted
    batches the rest, both waiting on a stalled holder of the budget's lock. The check runs on a
    connection of its own, so it ends the holder and both batches go on within its timeout, not
    after the pool's command_timeout (300 s)."""
    small = await db.create_pool(db_url, min_size=3, max_size=3)
    zombie = await ours(db_url)
    watcher: asyncio.Task[None] | None = None
    try:
        pid = await stall_holding(zombie, BUDGET_SQL.lock_budget)
        budget = LoadBudget(small, BudgetSettings(quiet_seconds=0))

        async def one_batch() -> int | None:
            async with budget.batch("ledger", 10) as grant:
                grant.rows_done = 10
                return grant.slot

        batches = [asyncio.create_task(one_batch()) for _ in range(2)]

        async def both_wait_on_the_zombie() -> bool:
            return await waiters_on(db_url, pid) == 2

        await wait_until(both_wait_on_the_zombie, within=10, interval=0.05)
        watcher = asyncio.create_task(StalledSessions(db_url, IDLE_TIMEOUT).watch())
        # Generous against the check's cadence (every 0.5 s, after 0.5 s stalled), far below 300 s.
        slots = await asyncio.wait_for(asyncio.gather(*batches), 60)
        assert all(slot is not None for slot in slots)
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        zombie.terminate()
        await small.close()


async def _has_waiters(db_url: str, pid: int) -> bool:
    return await waiters_on(db_url, pid) > 0


async def waiters_on(db_url: str, pid: int) -> int:
    """Sessions waiting on `pid`, counted on a connection outside any pool under test."""
    conn = await asyncpg.connect(db_url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND $1 = ANY (pg_blocking_pids(pid))",
                pid,
            )
        )
    finally:
        await conn.close()
