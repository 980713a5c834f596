"""The ledger reconciliation's failures, and which no retry can fix.

No asyncpg import here: the workflows import this module (through the sandbox's pass-through).
"""

from __future__ import annotations

from enum import StrEnum

from temporalio.exceptions import ApplicationError

from core.errors import failure, step_retry


class LedgerFailure(StrEnum):
    INVALID_LEDGER_INPUT = "InvalidLedgerInput"
    LEDGER_CONFLICT = "LedgerConflict"  # a batch raced another writer: rolled back, retried
    LEDGER_UNBALANCED = "LedgerUnbalanced"


NON_RETRYABLE = frozenset({LedgerFailure.INVALID_LEDGER_INPUT, LedgerFailure.LEDGER_UNBALANCED})
# The retry policy of every activity of the ledger workflows.
LEDGER_RETRY = step_retry(NON_RETRYABLE)


def ledger_failure(type: LedgerFailure, message: str) -> ApplicationError:
    return failure(type, message, non_retryable=type in NON_RETRYABLE)
