"""Ending the sessions of this service that a paused client left holding locks.

`idle_in_transaction_session_timeout` (core.db.create_pool) ends a session whose client paused
*between* statements of a transaction. A client paused *within* a statement's exchange (after
asyncpg's Parse/Describe, before its Bind/Execute/Sync) leaves the backend 'active', reading from
the client, and no server timeout below PostgreSQL 17 applies there: a worker frozen at that
instant kept the load budget's advisory lock, and every batch of every job waited for it (the
harness's zombie scenario caught it). Each worker ends such sessions once they have stalled for the
idle timeout and block someone: the rule the server applies to an idle transaction. On PostgreSQL
17+, `transaction_timeout` on the service's role bounds every transaction, paused or not, and makes
this check unnecessary (DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS=0 turns it off with the idle timeout).

Only sessions this service opened are candidates: their application_name starts with
`core.db.APPLICATION_NAME` (set by its pools), whatever the login; a game sharing the login is
never touched, and another session's SQL is never logged. The check runs on a connection of its
own, so a pool drained by the very waiters it is meant to free cannot starve it.

Platform code: no job is imported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

from core.db import APPLICATION_NAME
from core.queries import load

SQL = load(__file__, "sessions.sql")
log = logging.getLogger("sessions")

# Bounds the check's connect and statement: a check that cannot run is retried at the next tick.
CHECK_TIMEOUT_SECONDS = 10.0


class StalledSessions:
    """The only caller of core/sessions.sql."""

    def __init__(self, url: str, stalled_after_seconds: float, application_prefix: str = APPLICATION_NAME) -> None:
        self.url = url
        self.after = stalled_after_seconds
        self.prefix = application_prefix
        self._conn: asyncpg.Connection | None = None

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(
                self.url,
                timeout=CHECK_TIMEOUT_SECONDS,
                command_timeout=CHECK_TIMEOUT_SECONDS,
                server_settings={"application_name": f"{self.prefix} stalled-session check"},
            )
        return self._conn

    async def end_stalled_lock_holders(self) -> list[dict[str, Any]]:
        """End this service's stalled sessions others wait on; returns what was ended."""
        conn = await self._connection()
        stalled = SQL.bind("end_stalled_lock_holders", stalled_seconds=self.after, application_prefix=self.prefix)
        rows = [dict(r) for r in await conn.fetch(SQL.end_stalled_lock_holders, *stalled)]
        for r in rows:
            log.warning(
                "ended session %s (%s): its client stalled %.1f s inside a statement's exchange while "
                "holding locks %d session(s) wait for",
                r["pid"],
                r["application_name"],
                r["stalled_seconds"],
                r["waiters"],
            )
        return rows

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def watch(self) -> None:
        """Check every half idle timeout (at least every 0.5 s) until cancelled; a failed check is
        logged and tried again on a new connection (the database may be restarting)."""
        interval = max(0.5, self.after / 2)
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.end_stalled_lock_holders()
                except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
                    log.debug("stalled-session check failed: %s", err)
                    await self.close()
        finally:
            await self.close()
