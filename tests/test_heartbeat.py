"""A statement run while heartbeating is cancelled on the server when its activity is cancelled."""

from __future__ import annotations

import asyncio

import asyncpg

from core.heartbeat import run_heartbeating


async def test_cancelling_the_caller_cancels_the_statement_on_the_server(pool: asyncpg.Pool) -> None:
    beats = 0
    started = asyncio.Event()

    def beat() -> None:
        nonlocal beats
        beats += 1
        started.set()

    async def blocked_batch() -> None:
        async with pool.acquire() as conn, conn.transaction():
            await run_heartbeating(conn.fetchval("SELECT pg_sleep(600)"), beat, 0.05)

    task = asyncio.create_task(blocked_batch())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert beats >= 1
    running = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND query LIKE 'SELECT pg_sleep(600)%' AND state = 'active'"
    )
    assert running == 0, "the statement kept running after its activity was cancelled"
