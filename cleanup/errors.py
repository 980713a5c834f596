"""The cleanup's failures: what its activities and workflows raise, and which no retry can fix.

No asyncpg import here: the workflows import this module (through the sandbox's pass-through).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from temporalio.exceptions import ApplicationError

from core.errors import DeadlineCleanupError, failure, step_retry


class CleanupFailure(StrEnum):
    UNKNOWN_ACCOUNT = "UnknownAccount"
    FAILED_TOLERANCE_EXCEEDED = "FailedToleranceExceeded"
    # Retried: a scheduled bucket cleanup held at its claim by the planner's pause.
    HELD_BY_PAUSE = "HeldByPlannerPause"
    # Retried: the timer is far ahead of the database clock (the claim waits for the database's time).
    DATABASE_CLOCK_BEHIND = "DatabaseClockBehind"
    # Retried: a worker compiled from another target set than the cleanup's cannot run it.
    TARGETS_MISMATCH = "TargetsMismatch"


NON_RETRYABLE = frozenset({CleanupFailure.UNKNOWN_ACCOUNT, CleanupFailure.FAILED_TOLERANCE_EXCEEDED})
# The retry policy of every activity of the cleanup and planner workflows.
CLEANUP_RETRY = step_retry(NON_RETRYABLE)


def cleanup_failure(type: CleanupFailure, message: str) -> ApplicationError:
    return failure(type, message, non_retryable=type in NON_RETRYABLE)


class AccountCleanupFailed(DeadlineCleanupError):
    """One account whose cleanup failed deterministically, isolated from its batch."""

    def __init__(self, account_id: str, sqlstate: str, message: str, target: str | None) -> None:
        super().__init__(f"{account_id}: [{sqlstate}] {message}")
        self.account_id = account_id
        self.sqlstate = sqlstate
        self.message = message
        self.target = target


class FailedToleranceExceeded(ApplicationError, DeadlineCleanupError):
    """More accounts failed than the cleanup's `--max-failed` tolerates: the workflow fails loudly
    (non-retryable), after the settlement is written."""

    TYPE = CleanupFailure.FAILED_TOLERANCE_EXCEEDED.value

    def __init__(self, failed: int, tolerance: str, reasons: Sequence[str]) -> None:
        first = "; ".join(reasons) if reasons else "(no reasons recorded)"
        super().__init__(
            f"{failed} account(s) failed cleanup, more than the tolerance {tolerance}; first reasons: {first}",
            type=self.TYPE,
            non_retryable=True,
        )
        self.failed = failed
