"""A client paused inside a statement's exchange keeps its locks; the workers end such sessions.

Real Postgres, real asyncpg. The stall is made as a frozen worker makes it: `Connection.prepare`
sends Parse/Describe with a Flush and no Sync (as asyncpg does for every statement it has not
cached), and the client then sends nothing more.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from core import db
from core.budget import SQL as BUDGET_SQL
from core.budget import BudgetSettings, LoadBudget
from core.sessions import StalledSessions
from tests.helpers import wait_until

IDLE_TIMEOUT = 0.5
YOUNG_TIMEOUT = 60.0


async def stall_holding(conn: asyncpg.Connection, lock_sql: str) -> int:
    """Open a transaction, take a lock, then stop between Parse and Bind; returns the backend's pid."""
    await conn.execute("BEGIN")
    await conn.execute(lock_sql)
    await conn.prepare("SELECT $1::int AS next_statement")  # Parse/Describe/Flush: the backend waits for Bind
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
    zombie = await asyncpg.connect(db_url)
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

        ended = await StalledSessions(pool, IDLE_TIMEOUT).end_stalled_lock_holders()
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
    conns = [await asyncpg.connect(db_url) for _ in range(4)]
    try:
        alone, young, idle, waiter = conns
        alone_pid = await stall_holding(alone, "SELECT pg_advisory_xact_lock(1)")
        await idle.execute("BEGIN")
        await idle.execute("SELECT pg_advisory_xact_lock(2)")
        idle_pid = idle.get_server_pid()
        waiting = asyncio.create_task(waiter.execute("SELECT pg_advisory_lock(2)"))
        await asyncio.sleep(IDLE_TIMEOUT * 3)
        await wait_until(lambda: blocked(pool, waiter.get_server_pid()), within=10, interval=0.05)
        assert await StalledSessions(pool, IDLE_TIMEOUT * 2).end_stalled_lock_holders() == []
        young_pid = await stall_holding(young, "SELECT pg_advisory_xact_lock(3)")
        waiting_young = asyncio.create_task(pool.execute("SELECT pg_advisory_lock(3), pg_advisory_unlock(3)"))
        await wait_until(lambda: waited_on(pool, young_pid), within=10, interval=0.05)
        # Younger than the timeout: a timeout no loaded machine outlasts between the stall and the check.
        assert await StalledSessions(pool, YOUNG_TIMEOUT).end_stalled_lock_holders() == []
        for pid, state in ((alone_pid, "active"), (idle_pid, "idle in transaction"), (young_pid, "active")):
            found = await state_of(pool, pid)
            assert found is not None and found[0] == state, (pid, found)
        assert not waiting.done() and not waiting_young.done()
        # Once old enough, the young one is ended (someone waits on it); the others still are not.
        await asyncio.sleep(IDLE_TIMEOUT * 2)
        ended = await StalledSessions(pool, IDLE_TIMEOUT * 2).end_stalled_lock_holders()
        assert [r["pid"] for r in ended] == [young_pid]
        await asyncio.wait_for(waiting_young, 10)
        assert await state_of(pool, alone_pid) is not None and await state_of(pool, idle_pid) is not None
        await idle.execute("ROLLBACK")
        await asyncio.wait_for(waiting, 10)
    finally:
        for c in conns:
            c.terminate()
