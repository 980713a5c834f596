"""What a worker says while its database is down: one line when the outage starts, one when it ends.

During an outage every activity attempt, every pool reconnect and every relay batch fails with a
connection error and is retried; each used to write a WARNING with a traceback. Here:

- `OUTAGE` notices the first lost connection and writes one WARNING, `database unavailable at
  09:00:01 (ConnectionRefusedError: ...), retrying`, and, when a connection works again (a new pool
  connection, or an activity that completes), one INFO line `database back after 3.4 s (N retried
  errors logged below WARNING)`.
- `RetriedErrorFilter` (on the worker's log handler) turns every log record whose exception is a
  lost connection into an INFO line without a traceback, at most one per logger every
  `every_seconds`; the others are counted and dropped. The cause stays in the line.
- `OutageInterceptor` runs every activity inside `logs.work_scope()` (so tasks that outlive it log
  without its IDs), reports lost connections and successes to `OUTAGE`, runs an attempt that lost
  its connection again as soon as the database answers (bounded), and otherwise fails it with a
  short, retryable `DatabaseUnavailable` failure naming the cause (the full asyncpg chain exceeds
  the size Temporal keeps for an attempt's last failure).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from core import logs
from core.db import connection_lost
from core.errors import ErrorType, failure

log = logging.getLogger("database")


def lost_connection_in(err: BaseException | None) -> BaseException | None:
    """The first lost-connection error in `err`'s chain (itself, its cause, its context), or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if connection_lost(err) or _unavailable_failure(err):
            return err
        err = err.__cause__ or err.__context__
    return None


def _unavailable_failure(err: BaseException) -> bool:
    return isinstance(err, ApplicationError) and err.type == ErrorType.DATABASE_UNAVAILABLE.value


def describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class Outage:
    """The database's state as this process sees it: up, or down since a moment."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self.down_since: float | None = None
        self.retried = 0  # retried errors logged below WARNING (or dropped) during this outage

    def lost(self, err: BaseException) -> None:
        if self.down_since is not None:
            return
        self.down_since = self._clock()
        self.retried = 0
        at = datetime.now(UTC).strftime("%H:%M:%S")
        _process_wide(log.warning, "database unavailable at %s (%s), retrying", at, describe(err))

    def back(self) -> None:
        if self.down_since is None:
            return
        took = self._clock() - self.down_since
        self.down_since = None
        _process_wide(
            log.info, "database back after %.1f s (%d retried errors logged below WARNING)", took, self.retried
        )


def _process_wide(write: Any, *args: Any) -> None:
    """The outage is the process's, not the activity's that noticed it: logged with no Temporal IDs."""
    contextvars.Context().run(write, *args)


OUTAGE = Outage()


class RetriedErrorFilter(logging.Filter):
    """Lost-connection tracebacks become one INFO line per logger every `every_seconds`."""

    def __init__(self, outage: Outage = OUTAGE, every_seconds: float = 30.0, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.outage = outage
        self.every_seconds = every_seconds
        self._clock = clock
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == log.name or not record.exc_info or record.levelno > logging.WARNING:
            return True
        err = lost_connection_in(record.exc_info[1])
        if err is None:
            return True
        self.outage.lost(err)
        self.outage.retried += 1
        now = self._clock()
        last = self._last.get(record.name)
        if last is not None and now - last < self.every_seconds:
            return False
        self._last[record.name] = now
        record.msg = f"{record.getMessage()} ({describe(err)}); retried"
        record.args = None
        record.exc_info = None
        record.exc_text = None
        record.levelno = logging.INFO
        record.levelname = logging.getLevelName(logging.INFO)
        return True


class _Outbound(ActivityOutboundInterceptor):
    """Remembers the activity's last heartbeat details, to repeat them while waiting for the database."""

    def __init__(self, next: ActivityOutboundInterceptor) -> None:
        super().__init__(next)
        self.last_details: tuple[Any, ...] = ()

    def heartbeat(self, *details: Any) -> None:
        self.last_details = details
        super().heartbeat(*details)


# The heartbeat details an attempt last sent before a lost connection, for the run of the same
# attempt again: `info.heartbeat_details` are the attempt's starting ones, and resuming from them
# would re-run (and count again) every batch the first run committed.
_RERUN_DETAILS: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "rerun_heartbeat_details", default=None
)


def resume_details() -> tuple[Any, ...]:
    """Where an activity resumes from: its last heartbeat details when this is the same attempt run
    again after a lost connection, else the attempt's starting details (those of the previous
    attempt). An activity that checkpoints in its heartbeat reads these instead of
    `activity.info().heartbeat_details`."""
    rerun = _RERUN_DETAILS.get()
    return rerun if rerun else tuple(activity.info().heartbeat_details)


class _ActivityInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, probe: Probe | None, max_wait: float) -> None:
        super().__init__(next)
        self._probe = probe
        self._max_wait = max_wait
        self._outbound: _Outbound | None = None

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        self._outbound = _Outbound(outbound)
        super().init(self._outbound)

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        with logs.work_scope():
            reruns = 0
            while True:
                try:
                    result = await super().execute_activity(input)
                except Exception as err:
                    lost = None if isinstance(err, ApplicationError) else lost_connection_in(err)
                    if lost is None:
                        raise
                    OUTAGE.lost(lost)
                    if reruns < MAX_RERUNS and await self._database_back():
                        reruns += 1  # the same attempt again: every step is idempotent, and no back-off
                        if self._outbound is not None and self._outbound.last_details:
                            _RERUN_DETAILS.set(self._outbound.last_details)  # from its last checkpoint
                        continue
                    # A short typed failure instead of asyncpg's chain of tracebacks: Temporal keeps it
                    # whole (a large one reaches the UI as "Failure exceeds size limit.") and it names the cause.
                    message = f"database connection lost: {describe(lost)}"
                    raise failure(ErrorType.DATABASE_UNAVAILABLE, message) from None
                OUTAGE.back()
                return result

    async def _database_back(self) -> bool:
        """True once the database, found unreachable, answers again (the attempt may run again).

        Heartbeats the last details while it waits. False when the database answers at once (one
        connection was lost, not the database: the attempt fails and Temporal retries it, visibly),
        for a local activity, and when out of time."""
        if self._probe is None or self._outbound is None:
            return False
        info = activity.info()
        if info.is_local:
            return False
        loop = asyncio.get_running_loop()
        budget = self._max_wait
        if info.start_to_close_timeout is not None:
            elapsed = (datetime.now(UTC) - info.started_time).total_seconds()
            budget = min(budget, info.start_to_close_timeout.total_seconds() - elapsed - 5.0)
        deadline = loop.time() + budget
        pause = 0.2
        unreachable = False
        while loop.time() < deadline:
            try:
                await asyncio.wait_for(self._probe(), timeout=min(5.0, max(deadline - loop.time(), 0.1)))
            except Exception as err:
                if not (lost_connection_in(err) or isinstance(err, TimeoutError)):
                    return False
                unreachable = True
            else:
                if unreachable:
                    OUTAGE.back()
                return unreachable
            if info.heartbeat_timeout is not None:
                self._outbound.heartbeat(*self._outbound.last_details)  # alive; the cursor unchanged
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
        return False


Probe = Callable[[], Awaitable[object]]
MAX_RERUNS = 20  # per attempt: beyond it the attempt fails and Temporal's retry policy takes over


class OutageInterceptor(Interceptor):
    """Every activity in a log-context scope of its own; lost connections and recoveries noticed.

    With a `probe` (a cheap statement on the worker's pool), an attempt that lost its database
    connection while the database itself is unreachable waits for it (up to `max_wait` seconds,
    within its start-to-close timeout, heartbeating its last details) and runs again as soon as the
    probe answers, instead of failing into Temporal's back-off (up to 30 s after a few failures).
    Safe because every activity is idempotent: a re-run absorbs what the first run committed.
    Otherwise (one connection lost while the database answers, a local activity, out of time) the
    attempt fails with a retryable `DatabaseUnavailable`, visible in its history.
    """

    def __init__(self, probe: Probe | None = None, max_wait: float = 60.0) -> None:
        self.probe = probe
        self.max_wait = max_wait

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ActivityInbound(next, self.probe, self.max_wait)
