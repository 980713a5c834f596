"""Inputs and outputs of the cleanup workflow and its activities.

Payloads carry IDs, versions and counts only, never account data, so histories stay small.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, AwareDatetime, Field, model_validator

from core.config import MAX_PARTITIONS, CleanupDefaults
from core.model import Model

# The game's own account key printed as text (text, UUID or bigint): 1-200 characters, none of them
# a control character (the same rule as the CHECK on accounts.account_id).
ACCOUNT_ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]{1,200}$"
# Each default of a cleanup (partitions, parallelism, batch size, claim chunks and streams,
# heartbeats) has one home: core.config.CleanupDefaults, the planner's and an operator's alike.
DEFAULTS = CleanupDefaults()
# A stream deals its claims to its partitions in runs of this many consecutive accounts, not one by
# one: rows of neighbouring accounts share pages (accounts, saves, items, matches), and partitions
# dealt one account each would all lock and write every page at once (LWLock:BufferContent).
CLAIM_RUN_ACCOUNTS = 64


def following_partitions(partitions: int, max_parallel: int) -> int:
    """How many partitions a cohort that cleans while it claims runs: no more than may run at once.
    A partition that follows the claim ends only when the claim does, so partitions beyond the
    parallelism would start then, in a second wave, with every account claimed for them still to
    clean (half the cohort at 16 partitions 8 at a time: the run's tail)."""
    return min(partitions, max_parallel)


MAX_CLAIM_STREAMS = 16
_ACCOUNT_ID = re.compile(ACCOUNT_ID_PATTERN)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


AccountId = Annotated[
    str, Field(pattern=ACCOUNT_ID_PATTERN, examples=["acct_123", "6f1c2a9e-3b5d-4e1f-9a7c-2d8e0b4f6a13", "4411290"])
]
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_utc)]


def is_account_id(value: str) -> bool:
    return bool(_ACCOUNT_ID.fullmatch(value))


# Names the Temporal layer registers and the operations call: one definition each, so a misspelt
# reference fails at import time instead of starting nothing in production.
CLEANUP_WORKFLOW = "RenewalCleanupWorkflow"
RENEWED_SIGNAL = "renewed"
STATUS_QUERY = "status"
CLAIM_CLEANUP = "claim_cleanup"
CLAIM_CLEANUP_IN_CHUNKS = "claim_cleanup_in_chunks"
CHECK_ACCOUNT_RENEWED = "check_account_renewed"
CLEANUP_PARTITION = "cleanup_partition"
SETTLE_CLEANUP = "settle_cleanup"
CLEAN_SMALL_COHORT = "clean_small_cohort"
CLEANUP_ID_PATTERN = r"cleanup-.+"


def _instant(deadline: datetime) -> str:
    """Compact UTC instant; sub-second digits only when present, so distinct deadlines never share an ID."""
    d = _utc(deadline)
    return f"{d:%Y%m%dT%H%M%S}{f'.{d:%f}' if d.microsecond else ''}Z"


def cohort_cleanup_id(deadline: datetime) -> str:
    """Workflow ID from the business key, so starting the same cleanup twice finds the same run."""
    return f"cleanup-cohort-{_instant(deadline)}"


def account_cleanup_id(account_id: str, deadline: datetime) -> str:
    return f"cleanup-account-{account_id}-{_instant(deadline)}"


def claim_stream_id(cleanup_id: str, stream: int) -> str:
    """The progress row of one claim stream: stream 0 keeps the cleanup's own ID (as every claim
    had before streams existed)."""
    return cleanup_id if stream == 0 else f"{cleanup_id}#claim-{stream}"


BUCKET_ID_PREFIX = "cleanup-bucket-"


def bucket_cleanup_id(start: datetime, width_ms: int, task_queue: str) -> str:
    """The planner's cohort of one deadline bucket [start, start + width): started twice, one run.
    Like the planner's own ID, it names the task queue unless it is the default one, so planners of
    other deployments on the same Temporal namespace (the demo's, a test's) never share a bucket."""
    return f"{BUCKET_ID_PREFIX}{_instant(start)}-{width_ms}ms{_queue_suffix(task_queue)}"


def sweep_cleanup_id(cutoff: datetime, task_queue: str) -> str:
    """The planner's safety-net cohort: every active account whose deadline is before `cutoff`."""
    return f"cleanup-sweep-{_instant(cutoff)}{_queue_suffix(task_queue)}"


def _queue_suffix(task_queue: str) -> str:
    return "" if task_queue == DEFAULT_TASK_QUEUE else f"-{task_queue}"


class RenewalCleanupInput(Model):
    cleanup_id: str = Field(min_length=1, max_length=200)
    # The first deadline the cleanup covers: with `deadline_until` None the one instant of all its
    # accounts (one account's deadline, or a cohort's), else the start of the range
    # [deadline_from, deadline_until). Recorded histories of 1.0 name it `deadline`.
    deadline_from: UtcDatetime = Field(validation_alias=AliasChoices("deadline_from", "deadline"))
    account_id: AccountId | None = None
    expected_version: int | None = Field(default=None, ge=1)
    # Set by the one builder, cleanup.inputs.cleanup_input, from the caller's request and the
    # settings' CleanupDefaults: no default here, so no second home of one.
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)
    max_parallel_partitions: int = Field(ge=1, le=MAX_PARTITIONS)
    batch_size: int = Field(ge=1, le=20_000)
    heartbeat_timeout_seconds: float = Field(gt=0, le=3600)
    step_timeout_seconds: float = Field(default=300.0, gt=0, le=86_400)
    note: str = ""
    # Tolerance of accounts whose cleanup failed deterministically (cleanup_failed); beyond it the
    # workflow fails after settling. None: no tolerance.
    max_failed: int | None = Field(default=None, ge=0)
    max_failed_percent: float | None = Field(default=None, ge=0, le=100)

    def failed_tolerance(self) -> str | None:
        """The tolerance as given (`3`, `5%`), None when there is none."""
        if self.max_failed is not None:
            return str(self.max_failed)
        if self.max_failed_percent is not None:
            return f"{self.max_failed_percent:g}%"
        return None

    def failed_exceeds_tolerance(self, failed: int, claimed: int) -> bool:
        if self.max_failed is not None and failed > self.max_failed:
            return True
        return self.max_failed_percent is not None and failed * 100 > self.max_failed_percent * claimed

    # A deadline range [deadline_from, deadline_until) instead of one instant (the planner's buckets
    # and sweeps); the run sleeps until deadline_until. None: one instant.
    deadline_until: UtcDatetime | None = None
    # Accounts per claim statement of a cohort's chunked claim.
    claim_chunk_size: int = Field(ge=1, le=100_000)

    # How often a partition heartbeats while a batch runs; None: a third
    # of the heartbeat timeout.
    heartbeat_interval_seconds: float | None = Field(default=None, gt=0, le=3600)

    # Wake this long before the end of the range (the planner's buckets): the timer, the workflow
    # task and the claim's dispatch then happen before the deadline, and the claim itself waits
    # for the database clock to pass the range (it never takes an account before its deadline).
    # 0: wake at the end of the range.
    wake_early_seconds: float = Field(default=0.0, ge=0, le=10)

    # Claim streams of a cohort of one instant whose partitions follow the claim (at most the
    # partitions). 1: one claim activity.
    claim_streams: int = Field(ge=1, le=MAX_CLAIM_STREAMS)

    # A cohort of one instant and one partition claims, cleans and settles in one activity (the
    # planner's cohort that fits one batch). A range of one partition always does; an operator's
    # cohort of one instant keeps its claim, partition and settlement steps.
    one_activity: bool = False

    @model_validator(mode="after")
    def _interval_below_timeout(self) -> RenewalCleanupInput:
        interval = self.heartbeat_interval_seconds
        if interval is not None and interval >= self.heartbeat_timeout_seconds:
            raise ValueError("heartbeat interval must be shorter than the heartbeat timeout")
        return self

    @property
    def wake_at(self) -> datetime:
        if self.deadline_until is None:
            return self.deadline_from
        return self.deadline_until - timedelta(seconds=self.wake_early_seconds)


class RenewalSignal(Model):
    account_id: AccountId
    version_after: int = Field(ge=1)
    new_deadline: UtcDatetime | None = None


class AccountRenewalCheck(Model):
    account_id: AccountId
    expected_version: int = Field(ge=1)


class ClaimCleanupInput(Model):
    """The claim of one account's cleanup; a cohort claims in chunks (`ClaimChunkedInput`)."""

    cleanup_id: str
    deadline: UtcDatetime
    account_id: AccountId
    expected_version: int | None = None
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)


class ClaimChunkedInput(Model):
    """The cohort claim of a deadline range [deadline_from, deadline_until), in bounded chunks."""

    cleanup_id: str
    deadline_from: UtcDatetime
    deadline_until: UtcDatetime
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)
    chunk_size: int = Field(default=DEFAULTS.claim_chunk_size, ge=1, le=100_000)
    # Stream `stream` of `streams` claims the accounts whose ID hashes to it, for the partitions p
    # with p % streams == stream. One stream: the whole range.
    stream: int = Field(default=0, ge=0, lt=MAX_CLAIM_STREAMS)
    streams: int = Field(default=1, ge=1, le=MAX_CLAIM_STREAMS)

    @model_validator(mode="after")
    def _stream_in_range(self) -> ClaimChunkedInput:
        if self.stream >= self.streams or self.streams > self.partitions:
            raise ValueError("claim stream must be below streams, and streams at most the partitions")
        return self

    @property
    def progress_id(self) -> str:
        return claim_stream_id(self.cleanup_id, self.stream)

    @property
    def stream_partitions(self) -> int:
        """How many partitions this stream feeds (p % streams == stream)."""
        return len(range(self.stream, self.partitions, self.streams))


class ClaimResult(Model):
    claimed_per_partition: list[int]
    skipped_renewed: int
    skipped_stale: int

    @property
    def claimed(self) -> int:
        return sum(self.claimed_per_partition)

    def __add__(self, other: ClaimResult) -> ClaimResult:
        """Two claim streams of one cohort: each counted its own partitions and renewals."""
        a, b = self.claimed_per_partition, other.claimed_per_partition
        size = max(len(a), len(b))
        return ClaimResult(
            claimed_per_partition=[(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)],
            skipped_renewed=self.skipped_renewed + other.skipped_renewed,
            skipped_stale=self.skipped_stale + other.skipped_stale,
        )


class CleanupPartitionInput(Model):
    cleanup_id: str
    partition_no: int = Field(ge=0, lt=MAX_PARTITIONS)
    batch_size: int = Field(default=DEFAULTS.batch_size, ge=1, le=20_000)
    heartbeat_interval_seconds: float | None = Field(default=None, gt=0, le=3600)
    # Started while the cohort's claim still runs (a cohort of one instant): a short batch is not
    # the end until the claim's progress row says it is done. False: the claim had finished before
    # the partition started.
    follow_claim: bool = False
    # The claim streams of the cohort: a partition that follows the claim follows stream
    # partition_no % claim_streams, the only one that claims for it.
    claim_streams: int = Field(default=1, ge=1, le=MAX_CLAIM_STREAMS)


class PartitionCounts(Model):
    cleaned: int = 0
    skipped_renewed: int = 0
    skipped_stale: int = 0
    already_applied: int = 0
    failed: int = 0  # isolated and recorded in cleanup_failed (a deterministic error)

    def __add__(self, other: PartitionCounts) -> PartitionCounts:
        return PartitionCounts(
            cleaned=self.cleaned + other.cleaned,
            skipped_renewed=self.skipped_renewed + other.skipped_renewed,
            skipped_stale=self.skipped_stale + other.skipped_stale,
            already_applied=self.already_applied + other.already_applied,
            failed=self.failed + other.failed,
        )

    def __sub__(self, other: PartitionCounts) -> PartitionCounts:
        return PartitionCounts(
            cleaned=self.cleaned - other.cleaned,
            skipped_renewed=self.skipped_renewed - other.skipped_renewed,
            skipped_stale=self.skipped_stale - other.skipped_stale,
            already_applied=self.already_applied - other.already_applied,
            failed=self.failed - other.failed,
        )


class PartitionCheckpoint(Model):
    """Heartbeat details: where a retried partition resumes, and what it had counted so far."""

    last_account_id: str = ""
    counts: PartitionCounts = PartitionCounts()
    batches: int = 0


class PartitionReport(Model):
    """`counts` is what the activity counted along its heartbeated cursor (the last attempt, plus
    what earlier attempts heartbeated); `claimed` and `applied` are what the database says about
    the partition (cleanup_claims, cleanup_applied), as the settlement counts them, however many
    attempts it took; `attempt_counts` is the reporting attempt's own work."""

    partition_no: int
    counts: PartitionCounts
    batches: int
    claimed: int = 0
    applied: int = 0
    attempt: int = 1
    attempt_counts: PartitionCounts = PartitionCounts()


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
    failed: int = 0  # accounts in cleanup_failed for this cleanup when it settled
    # The first few failures, "account_id: [SQLSTATE] message", for the tolerance error and status.
    failed_reasons: list[str] = Field(default_factory=list)


CleanupOutcome = Literal["cleaned", "renewed", "stale", "nothing_to_clean"]
CleanupPhase = Literal["sleeping", "claiming", "cleaning", "settling", "settled", "renewed"]


class SmallCohortInput(Model):
    """A range cohort of one partition (the planner's cohort that fits one batch): its claim, its
    partition and its settlement, run one after the other by one activity."""

    claim: ClaimChunkedInput
    partition: CleanupPartitionInput
    deadline: UtcDatetime


class SmallCohortResult(Model):
    claim: ClaimResult
    report: PartitionReport
    settlement: CleanupSettlement


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
    applied: int = 0  # per the database, summed over the partitions that reported


# --- the deadline planner -----------------------------------------------------------------------------
# Every account whose deadline passes is cleaned (or renewed) exactly once, with no operator action:
# the planner ensures one sleeping cohort cleanup per upcoming deadline bucket, sweeps overdue
# accounts and recovers stranded claims (cleanup/planner.py, workflows/deadline_planner.py).

PLANNER_WORKFLOW = "DeadlinePlannerWorkflow"
PLANNER_PAUSE_SIGNAL = "pause"
PLANNER_RESUME_SIGNAL = "resume"
PLANNER_NUDGE_SIGNAL = "nudge"
PLAN_DEADLINE_BUCKETS = "plan_deadline_buckets"
SWEEP_OVERDUE_ACCOUNTS = "sweep_overdue_accounts"
PLANNER_ID = "deadline-planner"
DEFAULT_TASK_QUEUE = "deadline-cleanup"
# At most this many overdue accounts are counted per sweep (the count is a bounded scan).
OVERDUE_COUNT_CAP = 100_000
RELEASE_CHUNK = 10_000


def planner_workflow_id(task_queue: str) -> str:
    """One planner per deployment (task queue): `deadline-planner` on the default queue."""
    return PLANNER_ID if task_queue == DEFAULT_TASK_QUEUE else f"{PLANNER_ID}-{task_queue}"
