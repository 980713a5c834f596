"""Inputs and outputs of the outbox relay workflow and its activity.

Kept apart from cleanup/models.py (the cleanup's models). Like those, these carry settings and counts
only: no event payloads, no addresses, and never the provider's token, so histories stay small and
free of secrets. Imported by workflows/outbox_relay.py, so nothing here may import asyncpg.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import AwareDatetime, Field, model_validator

from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from core.model import Model, Report

# Failure kinds counted toward dead-lettering (`failure_counts` keys besides the HTTP status, e.g. "503").
FAILURE_TIMEOUT = "timeout"
FAILURE_CONNECTION = "connection error"
# A batch answer the relay cannot read per event (not JSON, or no result for an event it carried).
FAILURE_BATCH_ANSWER = "bad batch answer"
# Outcomes that never count as failures: the provider's rate limit, and rows released unsent.
NOT_SENT_LEASE_SHORT = "not sent: lease ran short"
NOT_SENT_SHUTDOWN = "not sent: worker shutting down"


# Names the Temporal layer registers and the operations call (one definition each).
RELAY_WORKFLOW = "OutboxRelayWorkflow"
RELAY_NUDGE_SIGNAL = "nudge"
RELAY_STOP_SIGNAL = "stop"
RELAY_STATUS_QUERY = "status"
RELAY_OUTBOX_BATCH = "relay_outbox_batch"


class RelayBatchSettings(Model):
    """How one relay talks to the provider. Defaults suit production; tests shorten the times."""

    batch_size: int = Field(default=200, ge=1, le=20_000, description="events per claim")
    claims_per_batch: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="claims one activity makes back to back while each comes back full (fewer Temporal "
        "round trips per event); each claim has its own lease and records its own outcomes",
    )
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
        description="a batch whose worker died is retried elsewhere after this long without a heartbeat; "
        "None: OUTBOX_HEARTBEAT_TIMEOUT_SECONDS or 7, filled in when the relay starts",
    )

    @property
    def heartbeat_timeout(self) -> float:
        """The batch's heartbeat timeout (None when set neither by the caller nor the environment: the default)."""
        return self.heartbeat_timeout_seconds or DEFAULT_HEARTBEAT_TIMEOUT_SECONDS

    @model_validator(mode="after")
    def _lease_covers_a_request(self) -> Self:
        # The activity stops sending at lease - margin, so the lease must leave room for one request.
        if self.lease_seconds < self.request_timeout_seconds + 2:
            raise ValueError("lease_seconds must exceed request_timeout_seconds by at least 2 seconds")
        return self


class RelayBatchInput(Model):
    relay_id: str = Field(min_length=1, max_length=200)
    settings: RelayBatchSettings = RelayBatchSettings()


class RelayBatchResult(Model):
    claims: int = Field(default=1, ge=0, description="claims the activity made (the last one short: drained)")
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    fenced: int = Field(default=0, description="outcomes not recorded because the lease was lost")
    # Only filled when the batch came back short (the outbox may be drained):
    pending: int | None = None
    due: int | None = None
    next_due_in_seconds: float | None = None

    def add(self, r: RelayBatchResult) -> RelayBatchResult:
        """This result and another claim's (the pending summary is only ever the last claim's)."""
        return self.model_copy(
            update={
                "claims": self.claims + r.claims,
                "claimed": self.claimed + r.claimed,
                "delivered": self.delivered + r.delivered,
                "retried": self.retried + r.retried,
                "dead": self.dead + r.dead,
                "fenced": self.fenced + r.fenced,
            }
        )


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
    # A nudge carried across continue-as-new (received by the previous run, not yet acted on).
    nudged: bool = False


RelayPhase = Literal["relaying", "idle", "stopping", "drained"]


class OutboxRelayStatus(Model):
    relay_id: str
    phase: RelayPhase
    totals: RelayTotals
    last_batch: RelayBatchResult | None = None


# --- the outbox's Python API (outbox.operations): what status, redeliver and relay start return ---


class RunningRelay(Model):
    """A running relay workflow, with its progress from its memo."""

    workflow_id: str
    task_queue: str
    # From the relay's memo (updated after each batch); None before its first batch.
    delivered: int | None = None
    dead: int | None = None
    batches: int | None = None


class DeadLetter(Model):
    """An event the relay gave up on, and why (no payload, no address)."""

    event_key: str
    account_id: str | None
    attempts: int
    failures: int
    last_http_status: int | None
    dead_at: AwareDatetime | None
    dead_reason: str | None


class OutboxStatus(Model):
    """Counts by state, the newest dead letters and why, and the running relays."""

    total: int
    pending: int
    due_now: int
    leased: int
    retrying: int
    delivered: int
    dead: int
    oldest_pending_created_at: AwareDatetime | None
    next_attempt_at: AwareDatetime | None
    last_delivered_at: AwareDatetime | None
    dead_letters: list[DeadLetter] = []
    relays: list[RunningRelay] | None = None  # None: not asked (no client), or Temporal did not answer
    relays_error: str | None = None


class RedeliveredEvent(Model):
    """An event made due again by `redeliver_event`, and what it was before."""

    event_key: str
    status: str
    attempts: int
    next_attempt_at: AwareDatetime
    redeliveries: int
    last_error: str | None
    previous_status: str
    previous_error: str | None
    nudged: list[str] | None = None  # the relays told to look now; None: no client given


class StartedRelay(Model):
    """A relay `start_relays` started (`run_id`) or found running."""

    workflow_id: str
    run_id: str | None


class DeadRedelivery(Report):
    """The dead letters an operator's filter selects: counted, and redelivered once confirmed."""

    matching: int
    oldest_dead_at: AwareDatetime | None
    newest_dead_at: AwareDatetime | None
    dead_since: AwareDatetime | None
    reason: str | None
    redelivered: int
    confirmed: bool
    nudged: list[str] | None = None  # the relays told to look now; only when some were redelivered
