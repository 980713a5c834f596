"""Inputs and outputs of the nightly ledger reconciliation.

Payloads carry dates, shard numbers, cursors and counts only, never payment amounts.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

from pydantic import Field

from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from core.model import Model, Report

MAX_SHARDS = 256
DEFAULT_SHARDS = 16
DEFAULT_ID_PREFIX = "ledger-reconciliation"
# Keys per batch statement: large enough that a batch's fixed cost (its transaction, the shard lock,
# planning) is small next to its keys, small enough that it still commits within about a second.
DEFAULT_BATCH_SIZE = 5000
SCHEDULE_ID = "ledger-reconciliation-nightly"


# Names the Temporal layer registers and the operations call (one definition each).
LEDGER_WORKFLOW = "LedgerReconciliationWorkflow"
SCHEDULED_LEDGER_WORKFLOW = "ScheduledLedgerReconciliationWorkflow"
STATUS_QUERY = "status"
CHECK_LEDGER_DAY = "check_ledger_day"
RECONCILE_SHARD = "reconcile_shard"
SETTLE_LEDGER_DATE = "settle_ledger_date"


def ledger_workflow_id(business_date: date, prefix: str = DEFAULT_ID_PREFIX) -> str:
    """The workflow ID is the business key: one reconciliation per date, whoever starts it."""
    return f"{prefix}-{business_date.isoformat()}"


class RunOptions(Model):
    """How to run one date; shared by manual runs and the scheduled action."""

    shards: int = Field(default=DEFAULT_SHARDS, ge=1, le=MAX_SHARDS)
    max_parallel: int = Field(default=8, ge=1, le=MAX_SHARDS)
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, ge=1, le=20_000)
    tolerance_cents: int = Field(default=50, ge=0, le=1_000_000)
    heartbeat_timeout_seconds: float = Field(default=DEFAULT_HEARTBEAT_TIMEOUT_SECONDS, gt=0, le=3600)


class LedgerReconciliationInput(RunOptions):
    business_date: date
    # A re-check of a date already reconciled (its own workflow ID): judges what changed since and
    # records a new settlement revision if anything did.
    recheck: bool = False

    @classmethod
    def of(cls, options: RunOptions, business_date: date, recheck: bool = False) -> LedgerReconciliationInput:
        """The one builder of a date's input, for a manual run and the scheduled one alike: the
        options as given, at most `shards` shards at once."""
        run = options.model_dump(include=set(RunOptions.model_fields))
        run["max_parallel"] = min(options.max_parallel, options.shards)
        return cls(business_date=business_date, recheck=recheck, **run)


class ScheduledLedgerInput(RunOptions):
    """The schedule's fixed arguments: the business date is derived from the scheduled time."""

    days_before: int = Field(default=1, ge=0, le=31)
    id_prefix: str = Field(default=DEFAULT_ID_PREFIX, min_length=1, max_length=100)
    business_date: date | None = None  # only to run the parent by hand; the schedule leaves it unset
    # The IANA zone of the game's business day, the schedule's own (ledger.schedule keeps the two
    # equal). Defaulted: runs recorded before zones existed computed their dates in UTC.
    time_zone: str = Field(default="UTC", min_length=1, max_length=64)


def business_date_at(scheduled: datetime, time_zone: str, days_before: int) -> date:
    """The business date a night scheduled at `scheduled` reconciles: its calendar date in the
    game's zone, minus `days_before`. A night of 23 or 25 hours is still one date."""
    return scheduled.astimezone(ZoneInfo(time_zone)).date() - timedelta(days=days_before)


class LedgerDayCheck(Model):
    business_date: date
    shards: int = Field(ge=1, le=MAX_SHARDS)


class LedgerDay(Model):
    business_date: date
    shards: int
    payments: int


class ReconcileShardInput(Model):
    business_date: date
    shard: int = Field(ge=0, lt=MAX_SHARDS)
    shards: int = Field(ge=1, le=MAX_SHARDS)
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, ge=1, le=20_000)
    tolerance_cents: int = Field(default=50, ge=0)
    workflow_id: str = Field(min_length=1, max_length=300)


class ShardCheckpoint(Model):
    """Heartbeat details: where a retried shard resumes (keyset cursor) and what it counted so far."""

    last_game: str = ""
    last_payment_id: str = ""
    batches: int = 0
    keys_examined: int = 0
    discrepancies: int = 0
    corrected_now: int = 0
    reviewed_now: int = 0
    already_applied: int = 0
    duplicate_report_rows: int = 0
    # What the judged keys count as (a correction or a review row, now or before): the report's
    # corrected / sent_to_review, so it balances by construction and describes what was judged.
    corrections_judged: int = 0
    reviews_judged: int = 0
    # The fingerprint of the judged inputs, summed batch by batch (see reconcile_batch).
    fp_ledger_rows: int = 0
    fp_ledger_sum: int = 0
    fp_report_rows: int = 0
    fp_report_max: int = 0
    fp_report_sum: int = 0

    @property
    def judged_fingerprint(self) -> str:
        """In the format of the `shard_fingerprint` query: equal iff the shard's inputs are those judged."""
        return (
            f"{self.fp_ledger_rows}:{self.fp_ledger_sum}/"
            f"{self.fp_report_rows}:{self.fp_report_max}:{self.fp_report_sum}"
        )


class ShardReport(Model):
    business_date: date
    shard: int
    keys_examined: int
    discrepancies_found: int
    corrected: int
    sent_to_review: int
    duplicate_report_rows: int
    batches: int
    # About the attempt that returned this report (the counts above are the database's):
    unchanged_since_report: bool = False  # inputs matched the recorded fingerprint: nothing re-judged
    attempt: int = 1
    resumed_from_batch: int = 0
    batches_this_attempt: int = 0


class SettleLedgerInput(Model):
    business_date: date
    shards: int = Field(ge=1, le=MAX_SHARDS)
    workflow_id: str
    reason: str | None = None  # why a new revision would be recorded (None: the default text)


class LedgerSettlement(Model):
    business_date: date
    shards: int
    keys_examined: int
    discrepancies_found: int
    corrected: int
    sent_to_review: int
    duplicate_report_rows: int
    workflow_id: str
    settled_at: datetime
    revision: int = 1  # 1 for the first settlement of the date, then one more per change

    @property
    def balanced(self) -> bool:
        return self.corrected + self.sent_to_review == self.discrepancies_found


LedgerPhase = Literal["checking", "reconciling", "settling", "settled"]


class LedgerReconciliationResult(Model):
    business_date: date
    workflow_id: str
    settlement: LedgerSettlement
    shards: list[ShardReport]


class LedgerStatus(Model):
    business_date: date
    phase: LedgerPhase
    shards_total: int
    shards_done: int
    discrepancies_found: int
    corrected: int
    sent_to_review: int
    settled: bool


class ScheduledLedgerResult(Model):
    business_date: date
    workflow_id: str
    outcome: Literal["reconciled", "already_started"]
    settlement: LedgerSettlement | None = None


# --- the ledger's Python API (ledger.operations, ledger.schedule): what status, review and the
# schedule's operations return ---


class StartedReconciliation(Model):
    """The date's reconciliation `start_reconciliation` started, or the run that already existed."""

    workflow_id: str
    run_id: str | None
    started: bool  # True only when this call started the run
    business_date: date
    shards: int
    payments: int
    # True: the date's run was running and this call joined it (another caller, or one racing this
    # one, started it): nothing new started. `started` and `joined` both False: a closed run.
    joined: bool = False


class SettlementRevision(Model):
    """One settlement of a date: the first (revision 1), then one more per change a re-check found."""

    business_date: date
    revision: int
    keys_examined: int
    discrepancies_found: int
    corrected: int
    sent_to_review: int
    duplicate_report_rows: int
    new_discrepancies: int  # what changed since the previous revision (the whole date for revision 1)
    new_corrections: int
    new_review_rows: int
    changed_shards: list[int]
    reason: str
    workflow_id: str
    settled_at: datetime


class LedgerReport(Report):
    """`ledger_status`: the date's run (Temporal) and its counts (the database). Without a database,
    `database` says what is missing and the counts stay None (`settled` too: not known)."""

    business_date: date
    workflow_id: str
    run_id: str | None = None
    temporal_status: str | None = None
    phase: LedgerPhase | None = None
    shards_done: str | None = None  # "k/S"
    shards_reported: int | None = None
    shards_total: int | None = None
    payments: int | None = None
    discrepancies_found: int | None = None
    corrections: int | None = None
    review_rows: int | None = None
    # Effects written by an attempt that has not reported yet show here before they do above.
    corrections_recorded: int | None = None
    review_rows_recorded: int | None = None
    open_review_rows: int | None = None
    duplicate_report_rows: int | None = None
    settled: bool | None = None
    revision: int | None = None
    revisions: list[SettlementRevision] | None = None
    settlement: LedgerSettlement | None = None
    database: str | None = None  # set only when the database is unavailable: what is not shown
    live_status: str | None = None  # set only when no worker answered the status query: what is not shown


ReviewKind = Literal[
    "unknown_payment", "amount_beyond_tolerance", "currency_mismatch", "status_mismatch", "conflicting_report_rows"
]


class ReviewRow(Model):
    """A discrepancy no rule may correct, left for a person (keys and reasons, never amounts)."""

    review_key: str
    shard: int
    kind: ReviewKind
    reason: str
    created_at: datetime
    resolved_at: datetime | None


class ScheduledRun(Model):
    """A recent action of the schedule: the parent run it started."""

    scheduled_at: datetime
    workflow_id: str | None
    run_id: str | None
    # The run's status in Temporal (`temporal workflow describe`), which is also what the Temporal UI
    # badges it with: every night has a workflow ID of its own (docs/ledger.md, "A night runs once").
    status: str | None


class NightAlreadyRun(Model):
    """A night a backfill did not take again: it has a run already (scheduled, triggered or an
    earlier backfill), under the workflow ID the server names after the night's scheduled time."""

    business_date: date
    scheduled_at: datetime
    workflow_id: str
    run_id: str
    status: str


class ScheduleDescription(Report):
    """A ledger schedule as `describe_schedule` and the operations that change it return it."""

    schedule_id: str
    runs_at: str | None  # "HH:MM zone"
    time_zone: str
    paused: bool
    note: str
    overlap: str
    catchup_window: str
    task_queue: str | None
    actions_taken: int
    missed_catchup_window: int
    next_runs: list[datetime]  # in UTC
    next_runs_local: list[datetime]  # in the schedule's zone
    recent_runs: list[ScheduledRun]
    waiting: int = 0  # nights taken (backfill, trigger, a night during a slow one) not started yet
    policy_upgraded: bool | None = None  # create: the existing schedule got today's overlap policy
    backfilled_dates: list[date] | None = None  # backfill: the business dates whose nights it took now
    already_ran: list[NightAlreadyRun] | None = None  # backfill: nights of the range it left alone


class ScheduleListing(Model):
    """One ledger schedule of `list_schedules`."""

    schedule_id: str
    runs_at: str | None
    time_zone: str
    paused: bool
    note: str | None
    next_runs: list[datetime]


class DeletedSchedule(Report):
    """The schedule `delete_schedule` deleted (its runs stay in Temporal)."""

    schedule_id: str
    deleted: bool
