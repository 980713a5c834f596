"""Ending the sessions a paused client left holding locks, where Postgres' own timeout does not.

`idle_in_transaction_session_timeout` (core.db.create_pool) ends a session whose client paused
*between* statements of a transaction. A client paused *within* a statement's exchange (after
asyncpg's Parse/Describe, before its Bind/Execute/Sync) leaves the backend 'active', reading from
the client, and no server timeout applies there: a worker frozen at that instant kept the load
budget's advisory lock, and every batch of every job waited for it (the harness's zombie scenario
caught it). Each worker ends such sessions of its own role once they have stalled for the idle
timeout and block someone: the same rule the server applies to an idle transaction.

Platform code: no job is imported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

from core.queries import load

SQL = load(__file__, "sessions.sql")
log = logging.getLogger("sessions")


class StalledSessions:
    """The only caller of core/sessions.sql."""

    def __init__(self, pool: asyncpg.Pool, stalled_after_seconds: float) -> None:
        self.pool = pool
        self.after = stalled_after_seconds

    async def end_stalled_lock_holders(self) -> list[dict[str, Any]]:
        """End the stalled sessions others wait on; returns what was ended (pid, seconds, query)."""
        rows = [dict(r) for r in await self.pool.fetch(SQL.end_stalled_lock_holders, self.after)]
        for r in rows:
            log.warning(
                "ended session %s: its client stalled %.1f s inside a statement's exchange while holding "
                "locks others wait for (%s)",
                r["pid"],
                r["stalled_seconds"],
                " ".join(str(r["query"]).split()),
            )
        return rows

    async def watch(self) -> None:
        """Check every half idle timeout (at least every 0.5 s) until cancelled; a failed check is
        logged and tried again (the database may be restarting)."""
        interval = max(0.5, self.after / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.end_stalled_lock_holders()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
                log.debug("stalled-session check failed: %s", err)
