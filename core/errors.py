"""The platform's errors (the base of all, bad input, unavailable services, lost connections), the
activities' retry policy, and how a database error is judged (transient or deterministic). Each
job's own failures live in its package (cleanup.errors, ledger.errors, outbox.errors).

No asyncpg import here: workflows import this module (through the sandbox's pass-through).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from pydantic import ValidationError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError


class DeadlineCleanupError(Exception):
    """The base of every error this project raises on purpose (platform and jobs alike)."""


class ErrorType(StrEnum):
    """The platform's failure types, by name; each job names its own (cleanup.errors,
    ledger.errors, outbox.errors). Activities raise them through `failure()`."""

    VALIDATION = "ValidationError"  # a payload that does not validate (pydantic)
    JOIN_INCOMPLETE = "JoinIncomplete"  # settle before every partition or shard reported: retried
    HANDED_BACK = "HandedBackOnShutdown"  # a gracefully stopping worker hands its work back: retried at once
    DATABASE_UNAVAILABLE = "DatabaseUnavailable"  # connection lost or refused: retried (core.outage)


def step_retry(non_retryable: Iterable[str] = ()) -> RetryPolicy:
    """The retry policy of a job's activities: quick first retries, capped back-off, and no retry
    of a failure that can only recur (a payload that does not validate, and the job's own)."""
    return RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=30),
        non_retryable_error_types=sorted({ErrorType.VALIDATION.value, *(str(t) for t in non_retryable)}),
    )


def failure(
    type: str, message: str, *, non_retryable: bool = False, next_retry_delay: timedelta | None = None
) -> ApplicationError:
    """The typed failure an activity raises (a job passes its own type and whether a retry can fix
    it). `next_retry_delay` overrides the retry policy's back-off for this one failure."""
    return ApplicationError(message, type=str(type), non_retryable=non_retryable, next_retry_delay=next_retry_delay)


# Work handed back by a worker shutting down is retried this soon (not the policy's back-off).
HAND_BACK_RETRY_DELAY = timedelta(milliseconds=100)


def handed_back(message: str) -> ApplicationError:
    """What an activity raises at a batch boundary when its worker is shutting down gracefully
    (SIGTERM, a deploy), its cursor heartbeated: another worker resumes the work at once instead of
    waiting out the heartbeat timeout."""
    return failure(ErrorType.HANDED_BACK, f"worker shutting down: {message}", next_retry_delay=HAND_BACK_RETRY_DELAY)


class InputError(DeadlineCleanupError, ValueError):
    """Bad input from a user: reported plainly, nothing is started (the CLI exits 2)."""


class Unavailable(DeadlineCleanupError):
    """A service the command needs cannot be reached: nothing is wrong with the input, trying again
    later can succeed (the CLI exits 75, EX_TEMPFAIL)."""


class TemporalUnavailable(Unavailable):
    """The Temporal server cannot be reached or refused the client: one line that names the setting
    (TEMPORAL_ADDRESS / --temporal-address), the address and what to check."""


class DatabaseUnavailable(Unavailable):
    """The application's database cannot be reached (down, restarting, refusing connections).

    The message names the database (its URL without the password) and says it is unavailable."""


class DatabaseMisconfigured(InputError):
    """The database refused the configured connection for good (no such database or role, a wrong
    password, a host name that does not resolve): trying again cannot help, DATABASE_URL must be
    fixed (exit 2). One sentence naming the setting; never the password."""


class DatabaseConnectionLost(DeadlineCleanupError, ConnectionError):
    """The database connection of a transaction closed under it (core.db.transaction). A
    ConnectionError, so it is judged a lost connection and retried like one."""


class ConnectionLostBeforeCommit(DatabaseConnectionLost):
    """The connection was already closed when the transaction was to be committed: the COMMIT was
    never sent and the server rolled the transaction back. Retrying the work is safe."""


class ConnectionLostInTransaction(DatabaseConnectionLost):
    """A statement of the transaction failed because its connection was closing (asyncpg may then
    report a confused protocol state instead of the lost connection); the error it raised is the
    cause. Nothing of the transaction was committed."""


def validation_message(err: ValidationError) -> str:
    """A pydantic error as one line a user can act on: `field: problem; field: problem`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in err.errors())


# --- database errors during cleanup ----------------------------------------------------------------

# SQLSTATE classes whose error depends on the data of a row: the same account fails the same way on
# every attempt, so retrying the batch can never succeed. 22 data exception, 23 integrity
# constraint violation, 27 triggered data change violation, 2F SQL routine exception, 38/39
# external routine (invocation) exception, 44 WITH CHECK OPTION violation, P0 PL/pgSQL
# (P0001 raise_exception from a trigger, P0004 assert_failure, ...).
DETERMINISTIC_CLASSES = frozenset({"22", "23", "27", "2F", "38", "39", "44", "P0"})
# For the record (everything not deterministic is treated as transient, i.e. retried as before):
# 08 connection exception, 40001 serialization failure, 40P01 deadlock, 55P03 lock not available
# (lock_timeout), 57014 query_canceled (statement_timeout), 57P01-57P05 admin/crash shutdown,
# 53 insufficient resources, 58 system error. An error that is neither data-dependent nor listed
# (e.g. 42501 insufficient_privilege) concerns every account alike, so isolating accounts would
# only send the whole cohort to review: it is retried too, and shows up in the activity's failures.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "57P04", "57P05"})


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (asyncpg's `PostgresError.sqlstate`), None for anything else."""
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) and len(state) == 5 else None


def is_deterministic(exc: BaseException) -> bool:
    """True if the error comes from the data of some account and would recur on every retry."""
    state = sqlstate_of(exc)
    return state is not None and state[:2] in DETERMINISTIC_CLASSES and state not in TRANSIENT_SQLSTATES


def is_schema_error(exc: BaseException) -> bool:
    """SQLSTATE class 42 (an undefined or mistyped column or table, 42501 insufficient privilege):
    the schema or the role, alike for every account. Retried a bounded number of times (a migration
    or a GRANT may be on its way), then surfaced: the accounts are recorded as failed."""
    state = sqlstate_of(exc)
    return state is not None and state[:2] == "42"


def parse_instant(text: str, flag: str | None = None) -> datetime:
    """An ISO-8601 instant with an explicit offset, in UTC: a naive time is ambiguous, so it is
    refused. `flag` names the option it came from in the message."""
    prefix, label = (f"{flag}: ", flag) if flag else ("", "datetime")
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InputError(f"{prefix}not an ISO-8601 datetime: {text!r} (example: 2026-11-01T09:00:00Z)") from None
    if value.tzinfo is None:
        raise InputError(f"{label} {text!r} has no timezone; add 'Z' or an offset such as +02:00")
    return value.astimezone(UTC)
