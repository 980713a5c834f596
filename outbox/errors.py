"""The outbox relay's failures, and which no retry can fix.

No asyncpg import here: the relay workflow imports this module (through the sandbox's pass-through).
"""

from __future__ import annotations

from enum import StrEnum

from temporalio.exceptions import ApplicationError

from core.errors import DeadlineCleanupError, failure, step_retry


class OutboxFailure(StrEnum):
    RELAY_NOT_CONFIGURED = "RelayNotConfigured"


NON_RETRYABLE = frozenset(OutboxFailure)
# The retry policy of the relay's batch activity.
OUTBOX_RETRY = step_retry(NON_RETRYABLE)


def outbox_failure(type: OutboxFailure, message: str) -> ApplicationError:
    return failure(type, message, non_retryable=type in NON_RETRYABLE)


class HeaderInjectionError(DeadlineCleanupError, ValueError):
    """A header name or value built from data would break the request (CR/LF, control characters).

    The message names the header, never its value (it may be a credential)."""
