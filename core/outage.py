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
  without its IDs), reports lost connections and successes to `OUTAGE`, and fails an attempt that
  lost its connection with a short, retryable `DatabaseUnavailable` failure naming the cause (the
  full asyncpg chain exceeds the size Temporal keeps for an attempt's last failure).
"""

from __future__ import annotations

import contextvars
import logging
import time
from datetime import UTC, datetime
from typing import Any

from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
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
        self.outages = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def lost(self, err: BaseException) -> None:
        if self.down_since is not None:
            return
        self.down_since = self._clock()
        self.retried = 0
        self.outages += 1
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


class _ActivityInbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        with logs.work_scope():
            try:
                result = await super().execute_activity(input)
            except Exception as err:
                lost = None if isinstance(err, ApplicationError) else lost_connection_in(err)
                if lost is None:
                    raise
                OUTAGE.lost(lost)
                # A short typed failure instead of asyncpg's chain of tracebacks: Temporal keeps it whole
                # (a large one reaches the UI as "Failure exceeds size limit.") and it names the cause.
                raise failure(ErrorType.DATABASE_UNAVAILABLE, f"database connection lost: {describe(lost)}") from None
            OUTAGE.back()
            return result


class OutageInterceptor(Interceptor):
    """Every activity in a log-context scope of its own; lost connections and recoveries noticed."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ActivityInbound(next)
