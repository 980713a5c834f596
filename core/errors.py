"""Errors a user can act on, and how a database error is judged (transient or deterministic).

No asyncpg import here: workflows import this module (through the sandbox's pass-through).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from enum import StrEnum

from pydantic import ValidationError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError


class ErrorType(StrEnum):
    """Every failure type an activity raises, by name. Activities raise them through `failure()`;
    workflows retry with `STEP_RETRY`, whose non-retryable list is built from this enum, so a typo
    fails at import time instead of silently retrying a permanent error forever."""

    VALIDATION = "ValidationError"  # a payload that does not validate (pydantic)
    UNKNOWN_ACCOUNT = "UnknownAccount"
    JOIN_INCOMPLETE = "JoinIncomplete"  # settle before every partition or shard reported: retried
    INVALID_LEDGER_INPUT = "InvalidLedgerInput"
    LEDGER_CONFLICT = "LedgerConflict"  # a batch raced another writer: rolled back, retried
    LEDGER_UNBALANCED = "LedgerUnbalanced"
    RELAY_NOT_CONFIGURED = "RelayNotConfigured"
    FAILED_TOLERANCE_EXCEEDED = "FailedToleranceExceeded"
    HANDED_BACK = "HandedBackOnShutdown"  # a gracefully stopping worker hands its work back: retried at once
    DATABASE_UNAVAILABLE = "DatabaseUnavailable"  # connection lost or refused: retried (core.outage)
    HELD_BY_PAUSE = "HeldByPlannerPause"  # a scheduled bucket cleanup held at its claim: retried
    DATABASE_CLOCK_BEHIND = "DatabaseClockBehind"  # the timer is far ahead of the database clock: retried
    TARGETS_MISMATCH = "TargetsMismatch"  # a worker compiled from another target set than the cleanup's: retried


NON_RETRYABLE: frozenset[ErrorType] = frozenset(
    {
        ErrorType.VALIDATION,
        ErrorType.UNKNOWN_ACCOUNT,
        ErrorType.INVALID_LEDGER_INPUT,
        ErrorType.LEDGER_UNBALANCED,
        ErrorType.RELAY_NOT_CONFIGURED,
        ErrorType.FAILED_TOLERANCE_EXCEEDED,
    }
)

# The retry policy of every activity the workflows run: quick first retries, capped back-off, and
# no retry of a failure that can only recur.
STEP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=sorted(t.value for t in NON_RETRYABLE),
)


def failure(type: ErrorType, message: str, *, next_retry_delay: timedelta | None = None) -> ApplicationError:
    """The typed failure an activity raises: non-retryable exactly when its type is in NON_RETRYABLE.
    `next_retry_delay` overrides the retry policy's back-off for this one failure."""
    return ApplicationError(
        message, type=type.value, non_retryable=type in NON_RETRYABLE, next_retry_delay=next_retry_delay
    )


# Work handed back by a worker shutting down is retried this soon (not the policy's back-off).
HAND_BACK_RETRY_DELAY = timedelta(milliseconds=100)


def handed_back(message: str) -> ApplicationError:
    """What an activity raises at a batch boundary when its worker is shutting down gracefully
    (SIGTERM, a deploy), its cursor heartbeated: another worker resumes the work at once instead of
    waiting out the heartbeat timeout."""
    return failure(ErrorType.HANDED_BACK, f"worker shutting down: {message}", next_retry_delay=HAND_BACK_RETRY_DELAY)


class InputError(ValueError):
    """Bad input from a user: reported plainly, nothing is started."""


class TemporalUnavailable(InputError):
    """The Temporal server cannot be reached or refused the client: the CLI exits 2 with one line
    that names the setting (TEMPORAL_ADDRESS / --temporal-address), the address and what to check."""


class DatabaseUnavailable(Exception):
    """The application's database cannot be reached (down, restarting, refusing connections).

    The message names the database (its URL without the password) and says it is unavailable; the
    CLI exits 2 with it."""


class DatabaseConnectionLost(ConnectionError):
    """The database connection of a transaction closed under it (core.db.transaction). A
    ConnectionError, so it is judged a lost connection and retried like one."""


class ConnectionLostBeforeCommit(DatabaseConnectionLost):
    """The connection was already closed when the transaction was to be committed: the COMMIT was
    never sent and the server rolled the transaction back. Retrying the work is safe."""


class ConnectionLostInTransaction(DatabaseConnectionLost):
    """A statement of the transaction failed because its connection was closing (asyncpg may then
    report a confused protocol state instead of the lost connection); the error it raised is the
    cause. Nothing of the transaction was committed."""


class HeaderInjectionError(ValueError):
    """A header name or value built from data would break the request (CR/LF, control characters).

    The message names the header, never its value (it may be a credential)."""


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


def is_transient(exc: BaseException) -> bool:
    """Connection lost, serialization failure, deadlock, lock or statement timeout, shutdown, ...:
    retrying the same work later can succeed. Everything that is not deterministic."""
    return not is_deterministic(exc)


class AccountCleanupFailed(Exception):
    """One account whose cleanup failed deterministically, isolated from its batch."""

    def __init__(self, account_id: str, sqlstate: str, message: str, target: str | None) -> None:
        super().__init__(f"{account_id}: [{sqlstate}] {message}")
        self.account_id = account_id
        self.sqlstate = sqlstate
        self.message = message
        self.target = target


class FailedToleranceExceeded(ApplicationError):
    """More accounts failed than the cleanup's `--max-failed` tolerates: the workflow fails loudly
    (non-retryable), after the settlement is written."""

    TYPE = ErrorType.FAILED_TOLERANCE_EXCEEDED.value

    def __init__(self, failed: int, tolerance: str, reasons: Sequence[str]) -> None:
        first = "; ".join(reasons) if reasons else "(no reasons recorded)"
        super().__init__(
            f"{failed} account(s) failed cleanup, more than the tolerance {tolerance}; first reasons: {first}",
            type=self.TYPE,
            non_retryable=True,
        )
        self.failed = failed
