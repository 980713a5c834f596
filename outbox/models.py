"""Inputs and outputs of the outbox relay workflow and its activity.

Kept apart from cleanup/models.py (the cleanup's models). Like those, these carry settings and counts
only: no event payloads, no addresses, and never the provider's token, so histories stay small and
free of secrets. Imported by workflows/outbox_relay.py, so nothing here may import asyncpg.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from core.model import Model

# Workflow patch: a nudge that arrives while a batch runs is kept for the idle that follows it.
RELAY_PATCH_KEEP_NUDGES = "relay-keep-nudges-during-batch"

# Failure kinds counted toward dead-lettering (`failure_counts` keys besides the HTTP status, e.g. "503").
FAILURE_TIMEOUT = "timeout"
FAILURE_CONNECTION = "connection error"
# Outcomes that never count as failures: the provider's rate limit, and rows released unsent.
NOT_SENT_LEASE_SHORT = "not sent: lease ran short"


# Names the Temporal layer registers and the operations call (one definition each).
RELAY_WORKFLOW = "OutboxRelayWorkflow"
RELAY_NUDGE_SIGNAL = "nudge"
RELAY_STOP_SIGNAL = "stop"
RELAY_STATUS_QUERY = "status"
RELAY_OUTBOX_BATCH = "relay_outbox_batch"


class RelayBatchSettings(Model):
    """How one relay talks to the provider. Defaults suit production; tests shorten the times."""

    batch_size: int = Field(default=200, ge=1, le=5000)
    concurrency: int = Field(default=16, ge=1, le=256, description="requests in flight per batch")
    lease_seconds: float = Field(default=120.0, gt=0, le=3600)
    request_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_attempts: int = Field(
        default=25,
        ge=1,
        le=1000,
        description="real failures (5xx, 408, 401/403, timeouts, broken connections) before an event is "
        "dead-lettered; 429 answers and sends skipped because the lease ran short never count",
    )
    backoff_initial_seconds: float = Field(default=2.0, ge=0, le=3600)
    backoff_max_seconds: float = Field(default=600.0, ge=0, le=86_400)
    retry_after_max_seconds: float = Field(default=3600.0, ge=0, le=86_400)
    heartbeat_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="how soon a batch whose worker went silent (died, froze, lost Temporal) is retried "
        "elsewhere; None: request_timeout_seconds + 10",
    )

    @model_validator(mode="after")
    def _lease_covers_a_request(self) -> Self:
        # The activity stops sending at lease - margin, so the lease must leave room for one request.
        if self.lease_seconds < self.request_timeout_seconds + 2:
            raise ValueError("lease_seconds must exceed request_timeout_seconds by at least 2 seconds")
        # The batch heartbeats after each answer, so one request must fit in the heartbeat timeout.
        if (
            self.heartbeat_timeout_seconds is not None
            and self.heartbeat_timeout_seconds < self.request_timeout_seconds + 1
        ):
            raise ValueError("heartbeat_timeout_seconds must exceed request_timeout_seconds by at least 1 second")
        return self

    @property
    def heartbeat_timeout(self) -> float:
        return self.heartbeat_timeout_seconds or self.request_timeout_seconds + 10


class RelayBatchInput(Model):
    relay_id: str = Field(min_length=1, max_length=200)
    settings: RelayBatchSettings = RelayBatchSettings()


class RelayBatchResult(Model):
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    fenced: int = Field(default=0, description="outcomes not recorded because the lease was lost")
    # Only filled when the batch came back short (the outbox may be drained):
    pending: int | None = None
    due: int | None = None
    next_due_in_seconds: float | None = None


class RelayTotals(Model):
    batches: int = 0
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    fenced: int = 0
    runs: int = 1

    def add(self, r: RelayBatchResult) -> RelayTotals:
        return self.model_copy(
            update={
                "batches": self.batches + 1,
                "claimed": self.claimed + r.claimed,
                "delivered": self.delivered + r.delivered,
                "retried": self.retried + r.retried,
                "dead": self.dead + r.dead,
                "fenced": self.fenced + r.fenced,
            }
        )


class OutboxRelayInput(Model):
    relay_id: str = Field(min_length=1, max_length=200)
    settings: RelayBatchSettings = RelayBatchSettings()
    idle_sleep_seconds: float = Field(default=5.0, gt=0, le=3600)
    stop_when_drained: bool = Field(
        default=False, description="finish once no pending event is left (tests, one-off drains)"
    )
    batches_per_run: int = Field(default=500, ge=1, le=10_000, description="then continue-as-new")
    totals: RelayTotals = RelayTotals()
    # Signals carried across continue-as-new (received by the previous run, not yet acted on).
    stop_requested: bool = False
    nudged: bool = False


RelayPhase = Literal["relaying", "idle", "stopping", "drained"]


class OutboxRelayStatus(Model):
    relay_id: str
    phase: RelayPhase
    totals: RelayTotals
    last_batch: RelayBatchResult | None = None
