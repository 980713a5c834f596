"""Inputs and outputs of the cleanup workflow and its activities.

Payloads carry IDs, versions and counts only, never account data, so histories stay small.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field

ACCOUNT_ID_PATTERN = r"^acct_[A-Za-z0-9_-]{1,60}$"
MAX_PARTITIONS = 256
_ACCOUNT_ID = re.compile(ACCOUNT_ID_PATTERN)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


AccountId = Annotated[str, Field(pattern=ACCOUNT_ID_PATTERN, examples=["acct_123"])]
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_utc)]


def is_account_id(value: str) -> bool:
    return bool(_ACCOUNT_ID.match(value))


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _instant(deadline: datetime) -> str:
    """Compact UTC instant; sub-second digits only when present, so distinct deadlines never share an ID."""
    d = _utc(deadline)
    return f"{d:%Y%m%dT%H%M%S}{f'.{d:%f}' if d.microsecond else ''}Z"


def cohort_cleanup_id(deadline: datetime) -> str:
    """Workflow ID from the business key, so starting the same cleanup twice finds the same run."""
    return f"cleanup-cohort-{_instant(deadline)}"


def account_cleanup_id(account_id: str, deadline: datetime) -> str:
    return f"cleanup-account-{account_id}-{_instant(deadline)}"


def bucket_cleanup_id(start: datetime, width_ms: int) -> str:
    """The planner's cohort of one deadline bucket [start, start + width): started twice, one run."""
    return f"cleanup-bucket-{_instant(start)}-{width_ms}ms"


def sweep_cleanup_id(cutoff: datetime) -> str:
    """The planner's safety-net cohort: every active account whose deadline is before `cutoff`."""
    return f"cleanup-sweep-{_instant(cutoff)}"


class RenewalCleanupInput(Model):
    cleanup_id: str = Field(min_length=1, max_length=200)
    deadline: UtcDatetime
    account_id: AccountId | None = None
    expected_version: int | None = Field(default=None, ge=1)
    partitions: int = Field(default=16, ge=1, le=MAX_PARTITIONS)
    max_parallel_partitions: int = Field(default=8, ge=1, le=MAX_PARTITIONS)
    batch_size: int = Field(default=1000, ge=1, le=20_000)
    heartbeat_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    step_timeout_seconds: float = Field(default=300.0, gt=0, le=86_400)
    note: str = ""
    # A deadline range [deadline, deadline_until) instead of one instant (the planner's buckets and
    # sweeps); the run sleeps until deadline_until. None (and in every older history): one instant.
    deadline_until: UtcDatetime | None = None
    # Accounts per claim statement (the chunked claim, runs started after the `chunked-claim` patch).
    claim_chunk_size: int = Field(default=10_000, ge=1, le=100_000)

    @property
    def wake_at(self) -> datetime:
        return self.deadline_until or self.deadline


class RenewalSignal(Model):
    account_id: AccountId
    version_after: int = Field(ge=1)
    new_deadline: UtcDatetime | None = None


class AccountRenewalCheck(Model):
    account_id: AccountId
    expected_version: int = Field(ge=1)


class ClaimCleanupInput(Model):
    cleanup_id: str
    deadline: UtcDatetime
    account_id: AccountId | None = None
    expected_version: int | None = None
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)


class ClaimChunkedInput(Model):
    """The cohort claim of a deadline range [deadline_from, deadline_until), in bounded chunks."""

    cleanup_id: str
    deadline_from: UtcDatetime
    deadline_until: UtcDatetime
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)
    chunk_size: int = Field(default=10_000, ge=1, le=100_000)


class ClaimResult(Model):
    claimed_per_partition: list[int]
    skipped_renewed: int
    skipped_stale: int

    @property
    def claimed(self) -> int:
        return sum(self.claimed_per_partition)


class CleanupPartitionInput(Model):
    cleanup_id: str
    partition_no: int = Field(ge=0, lt=MAX_PARTITIONS)
    batch_size: int = Field(default=1000, ge=1, le=20_000)


class PartitionCounts(Model):
    cleaned: int = 0
    skipped_renewed: int = 0
    skipped_stale: int = 0
    already_applied: int = 0

    def __add__(self, other: PartitionCounts) -> PartitionCounts:
        return PartitionCounts(
            cleaned=self.cleaned + other.cleaned,
            skipped_renewed=self.skipped_renewed + other.skipped_renewed,
            skipped_stale=self.skipped_stale + other.skipped_stale,
            already_applied=self.already_applied + other.already_applied,
        )


class PartitionCheckpoint(Model):
    """Heartbeat details: where a retried partition resumes, and what it had counted so far."""

    last_account_id: str = ""
    counts: PartitionCounts = PartitionCounts()
    batches: int = 0


class PartitionReport(Model):
    partition_no: int
    counts: PartitionCounts
    batches: int


class SettleCleanupInput(Model):
    cleanup_id: str
    deadline: UtcDatetime
    account_id: AccountId | None = None
    partitions: int
    claim: ClaimResult
    reports: list[PartitionReport]


class CleanupSettlement(Model):
    cleanup_id: str
    claimed: int
    cleaned: int
    reminders: int
    skipped_renewed: int
    skipped_stale: int
    already_applied: int
    settled_at: UtcDatetime


CleanupOutcome = Literal["cleaned", "renewed", "stale", "nothing_to_clean"]
CleanupPhase = Literal["sleeping", "claiming", "cleaning", "settling", "settled", "renewed"]


class CleanupResult(Model):
    cleanup_id: str
    outcome: CleanupOutcome
    settlement: CleanupSettlement | None = None


class CleanupStatus(Model):
    cleanup_id: str
    phase: CleanupPhase
    deadline: UtcDatetime
    account_id: str | None
    partitions_total: int
    partitions_done: int
    settled: bool
    renewal_signals: int
    counts: PartitionCounts
    claimed: int | None = None
