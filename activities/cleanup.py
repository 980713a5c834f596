"""Activities of the renewal-deadline cleanup.

Each is safe under at-least-once delivery: run twice, after a renewal, for an old version, or
retried on another node after its COMMIT, it leaves exactly one effect per (account, version).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from temporalio import activity

import cleanup
from budget.controller import LoadBudget, Waiting, under_budget
from cleanup.batches import BatchResult, CompiledCleanup, Pulse, run_keyset_batch
from cleanup.errors import CleanupFailure, cleanup_failure
from cleanup.models import (
    CHECK_ACCOUNT_RENEWED,
    CLAIM_CLEANUP,
    CLAIM_CLEANUP_IN_CHUNKS,
    CLAIM_RUN_ACCOUNTS,
    CLEAN_SMALL_COHORT,
    CLEANUP_PARTITION,
    SETTLE_CLEANUP,
    AccountRenewalCheck,
    ClaimChunkedInput,
    ClaimCleanupInput,
    ClaimResult,
    CleanupPartitionInput,
    CleanupSettlement,
    PartitionCheckpoint,
    PartitionCounts,
    PartitionReport,
    SettleCleanupInput,
    SmallCohortInput,
    SmallCohortResult,
    claim_stream_id,
)
from cleanup.planner import held_by_pause
from cleanup.targets import CleanupTargets, targets_from_json
from core import db, failpoints, metrics
from core.config import CleanupSettings
from core.errors import ErrorType, failure, handed_back
from core.outage import resume_details
from core.queries import load

SQL = load(cleanup.__file__)
log = logging.getLogger("cleanup")
FAILED_REASONS_SHOWN = 3  # in the settlement payload: the first reasons, for the tolerance error
# The claim never runs ahead of the database clock (the renewal rule's clock): a timer that fires
# a little early by another clock waits here, up to this long, instead of claiming too little.
MAX_CLOCK_WAIT_SECONDS = 30.0
# A bucket cleanup held by the planner's pause looks again this often.
HOLD_RETRY_DELAY = timedelta(seconds=5)
# A partition that follows a running claim and found nothing new looks again after this long.
CLAIM_POLL_SECONDS = 0.2
# A schema or privilege error (SQLSTATE class 42) fails this many attempts of a partition (a
# migration or a GRANT may be on its way, ~15 s of back-off); the next records its accounts as
# failed with the error, so the cleanup settles showing them instead of retrying forever.
SCHEMA_ERROR_ATTEMPTS = 5


def claiming_namespace() -> str:
    """The namespace of the workflow whose activity claims (recorded with each claim, so that
    stranded-claim recovery judges it in that namespace only); '' outside an activity."""
    return (activity.info().workflow_namespace or "") if activity.in_activity() else ""


async def wait_for_database_clock(
    pool: asyncpg.Pool,
    instant: datetime,
    limit: float = MAX_CLOCK_WAIT_SECONDS,
    beat: Callable[[], None] | None = None,
    cleanup_id: str = "",
) -> None:
    """Return once the database clock has reached `instant`, calling `beat` at least every second
    meanwhile so a waiting claim is not taken for a dead one. More than `limit` seconds away, the
    database clock is behind the timer that fired: reported (WARNING, gauge, `planner status`) and
    raised as a retryable failure, so the claim neither runs early nor gives up as if nothing were due."""
    while True:
        remaining = await pool.fetchval(SQL.seconds_until, instant)
        if remaining is None or remaining < 0:
            metrics.set_database_clock_behind(0.0)
            return
        if remaining > limit:
            raise await database_clock_behind(pool, instant, remaining, cleanup_id)
        if beat is not None:
            beat()
        await asyncio.sleep(min(remaining + 0.001, 1.0))


async def database_clock_behind(
    pool: asyncpg.Pool, instant: datetime, remaining: float, cleanup_id: str
) -> BaseException:
    task_queue = activity.info().task_queue if activity.in_activity() else ""
    message = (
        f"the database clock is {remaining:.1f}s behind the timer: {cleanup_id or 'a claim'} waits for "
        f"{instant.isoformat()} by the database clock (the renewal rule's); claiming again later"
    )
    log.warning("%s", message)
    metrics.set_database_clock_behind(remaining)
    await pool.execute(
        SQL.record_database_clock_behind,
        *SQL.bind(
            "record_database_clock_behind",
            task_queue=task_queue,
            behind_seconds=remaining,
            instant=instant,
            cleanup_id=cleanup_id,
        ),
    )
    delay = timedelta(seconds=min(max(remaining - MAX_CLOCK_WAIT_SECONDS, 1.0), 30.0))
    return failure(CleanupFailure.DATABASE_CLOCK_BEHIND, message, next_retry_delay=delay)


async def claim_in_chunks(
    pool: asyncpg.Pool,
    input: ClaimChunkedInput,
    after_chunk: Callable[[int], None] | None = None,
    beat: Callable[[], None] | None = None,
    budget: LoadBudget | None = None,
    waiting_for_budget: Waiting | None = None,
) -> ClaimResult:
    """The cohort claim as bounded statements: each chunk claims at most `chunk_size` accounts of
    the range, in one transaction that also advances the keyset cursor and the counts in
    cleanup_claim_progress. A retry (or a second delivery) resumes after the last committed chunk
    and reports the same result, read back from the database.

    With a `budget` (budget.controller), the claim first tells the deadline objective of its cohort
    (its earliest deadline and its accounts), and each chunk is a budgeted batch like a partition's:
    it takes a slot first (but no rows: an account is one unit of the budget's rate, counted when
    cleaned, not when claimed), and is at most the budget's `max_claim_rows` accounts while the
    budget throttles the work (unthrottled or switched off, `chunk_size`, as without one)."""
    last_instant = input.deadline_until - timedelta(microseconds=1)
    await wait_for_database_clock(pool, last_instant, beat=beat, cleanup_id=input.cleanup_id)
    await pool.execute(
        SQL.claim_progress_start,
        *SQL.bind(
            "claim_progress_start",
            progress_id=input.progress_id,
            partitions=input.partitions,
            deadline_from=input.deadline_from,
            deadline_until=input.deadline_until,
        ),
    )
    if budget is not None:
        accounts = await pool.fetchval(SQL.cohort_accounts, input.deadline_from, input.deadline_until)
        await budget.register_cohort(input.cleanup_id, input.deadline_from, accounts)
    while True:
        async with under_budget(budget, "claim", 0, waiting_for_budget, input.cleanup_id) as grant:
            # The grant read the limits in force now: a rate limit makes the chunk small.
            chunk_size = budget.claim_rows(input.chunk_size) if budget and grant.slot is not None else input.chunk_size
            async with pool.acquire() as conn, db.transaction(conn):
                chunk = await _claim_chunk(conn, input, chunk_size)
            if isinstance(chunk, ClaimResult):
                return chunk
        failpoints.hit(f"{CLAIM_CLEANUP_IN_CHUNKS}.after_commit")
        if after_chunk is not None:
            after_chunk(len(chunk["partitions"]))


async def _claim_chunk(
    conn: asyncpg.Connection, input: ClaimChunkedInput, chunk_size: int
) -> asyncpg.Record | ClaimResult:
    """One chunk of the claim, in the caller's transaction: the claim statement after the cursor, and
    the cursor and counts advanced with it (so a chunk and its progress commit together). Under the
    progress row's lock; a claim already done returns its result, read back, and claims nothing."""
    progress = await conn.fetchrow(SQL.claim_progress_lock, input.progress_id)
    assert progress is not None
    per_partition = list(progress["claimed_per_partition"])
    if progress["done"]:
        return ClaimResult(
            claimed_per_partition=per_partition,
            skipped_renewed=progress["skipped_renewed"],
            skipped_stale=0,
        )
    await conn.execute(SQL.claim_chunk_plan)
    row = await conn.fetchrow(
        SQL.claim_chunk,
        *SQL.bind(
            "claim_chunk",
            cleanup_id=input.cleanup_id,
            deadline_from=input.deadline_from,
            deadline_until=input.deadline_until,
            cursor_deadline=progress["cursor_deadline"],
            cursor_account=progress["cursor_account"],
            chunk_size=chunk_size,
            stream_partitions=input.stream_partitions,
            claimed_before=sum(per_partition),
            streams=input.streams,
            stream=input.stream,
            run_accounts=CLAIM_RUN_ACCOUNTS,
            namespace=claiming_namespace(),
        ),
    )
    assert row is not None
    for p in row["partitions"]:
        per_partition[p] += 1
    await conn.execute(
        SQL.claim_progress_update,
        *SQL.bind(
            "claim_progress_update",
            progress_id=input.progress_id,
            cursor_deadline=row["last_deadline"],
            cursor_account=row["last_account"],
            claimed_per_partition=per_partition,
            renewed=row["renewed"],
            chunk_rows=row["scanned"],
            done=row["scanned"] < chunk_size,  # a short chunk found the range's last accounts
        ),
    )
    return row


class PartitionProgress:
    """What a partition's batches report while they run. This one reports nothing (the benchmark's
    direct baseline); the activity's heartbeats (`HeartbeatingProgress`)."""

    wait_interval = 5.0  # seconds between `still_working` calls while one batch runs

    def batch_committed(self, checkpoint: PartitionCheckpoint) -> None:
        """After each batch's COMMIT, with the cursor and counts so far."""

    def still_working(self, checkpoint: PartitionCheckpoint) -> None:
        """Every `wait_interval` while a batch runs (blocked on a row lock, say)."""

    def waiting_for_budget(self, checkpoint: PartitionCheckpoint, budget: dict[str, Any]) -> None:
        """While the load budget has no slot or rows for the next batch."""

    def waiting_for_claim(self, checkpoint: PartitionCheckpoint) -> None:
        """While a partition following the claim waits for its next chunk."""


async def cleanup_target_set(pool: asyncpg.Pool, compiled: CompiledCleanup, cleanup_id: str) -> CompiledCleanup:
    """A cleanup runs with one target set: the first partition records its fingerprint; a worker
    compiled from another set (a deploy that changed the targets) runs that cleanup with the set it
    recorded, compiled and checked like its own, or refuses the partition (retried) if it cannot."""
    if compiled.fingerprint is None:
        return compiled
    recorded = await pool.fetchval(
        SQL.record_cleanup_target_set,
        *SQL.bind("record_cleanup_target_set", cleanup_id=cleanup_id, fingerprint=compiled.fingerprint),
    )
    if recorded == compiled.fingerprint:
        return compiled
    if recorded in _OTHER_SETS:
        return _OTHER_SETS[recorded]
    targets = await pool.fetchval(SQL.target_set_of, recorded)
    if targets is None:
        raise failure(
            CleanupFailure.TARGETS_MISMATCH,
            f"cleanup {cleanup_id} runs with target set {recorded}; this worker's is {compiled.fingerprint}",
        )
    _OTHER_SETS[recorded] = await CompiledCleanup.compile(pool, targets_from_json(targets), compiled.settings)
    return _OTHER_SETS[recorded]


# Target sets of cleanups that started before this worker's set was deployed, compiled once.
_OTHER_SETS: dict[str, CompiledCleanup] = {}
DEFAULT_CLEANUP_SETTINGS = CleanupSettings()


@dataclass(frozen=True)
class PartitionRun:
    """What every batch of one partition's run shares: where it runs, the compiled statement, the
    partition, who hears of its progress, the load budget (None: none) and whether a schema or
    privilege error records the batch's accounts as failed (`schema_errors_final`, cleanup.batches)
    instead of failing the attempt."""

    pool: asyncpg.Pool
    compiled: CompiledCleanup
    input: CleanupPartitionInput
    progress: PartitionProgress = field(default_factory=PartitionProgress)
    budget: LoadBudget | None = None
    schema_errors_final: bool = False

    async def batch(self, checkpoint: PartitionCheckpoint) -> BatchResult:
        """One keyset batch after `checkpoint`, under the load budget, heartbeating while it runs."""
        await failpoints.reached(f"{CLEANUP_PARTITION}.before_batch", checkpoint)
        waiting: Waiting = functools.partial(self.progress.waiting_for_budget, checkpoint)
        size = self.input.batch_size if self.budget is None else self.budget.batch_rows(self.input.batch_size)
        async with under_budget(self.budget, "cleanup", size, waiting, self.input.cleanup_id) as grant:
            if self.budget is not None and grant.slot is not None:
                # The grant read the limits in force now: a rate limit makes the batch small (the
                # unused part of what was charged is refunded at release).
                size = self.budget.batch_rows(self.input.batch_size)
            result = await run_keyset_batch(
                self.pool,
                self.compiled,
                self.input.cleanup_id,
                self.input.partition_no,
                checkpoint.last_account_id,
                size,
                pulse=Pulse(functools.partial(self.progress.still_working, checkpoint), self.progress.wait_interval),
                schema_errors_final=self.schema_errors_final,
            )
            grant.rows_done, grant.idle_seconds = result.batch_rows, result.follow_up_lock_seconds
        return result


class ClaimFollower:
    """A partition that runs while its cohort's claim is still claiming (`input.follow_claim`).

    A short batch ends the partition only if the claim was done before that batch began (a chunk
    committed meanwhile is read by the next batch); until then a batch runs only once a new chunk
    has committed. The claim walks one instant's accounts in account order, the order of the
    partition's keyset, so no claim lands behind the cursor; with several claim streams the
    partition follows the one stream that claims for it (`partition_no % claim_streams`)."""

    def __init__(self, pool: asyncpg.Pool, input: CleanupPartitionInput) -> None:
        self.pool = pool
        self.done = not input.follow_claim
        self.stream_id = claim_stream_id(input.cleanup_id, input.partition_no % input.claim_streams)
        self._seen: int | None = 0  # the claim's chunks when the last short batch began: none yet
        self._chunks: int | None = None  # the claim's chunks when this batch began

    async def nothing_new(self) -> bool:
        """Before a batch: True while the claim runs and has committed no chunk since the last short
        batch began (no batch, and no budget, for nothing)."""
        self._chunks = None
        if self.done:
            return False
        claim = await self.pool.fetchrow(SQL.claim_progress_done, self.stream_id)
        self.done = claim is not None and claim["done"]
        self._chunks = claim["chunks"] if claim is not None else 0
        return not self.done and self._chunks == self._seen

    def ends_at_short_batch(self) -> bool:
        """After a short batch: True when the claim was done before it began (nothing more comes)."""
        if self.done:
            return True
        self._seen = self._chunks
        return False


async def clean_partition_batches(run: PartitionRun, checkpoint: PartitionCheckpoint) -> PartitionCheckpoint:
    """The partition's work without orchestration: keyset batches, one statement and COMMIT each.

    Shared by the activity and by the benchmark's direct baseline, so both run the same SQL.
    `run.progress` hears of each committed batch and of every wait: a slow batch (blocked on a row
    lock) keeps heartbeating instead of being retried as dead.
    A batch that fails deterministically is bisected (cleanup.batches): its bad accounts are
    recorded in cleanup_failed and counted as `failed`, the others cleaned.
    With a `run.budget` (budget.controller), each batch first takes its slot and rows of the database's
    load budget, waiting while there are none.
    With `input.follow_claim` the partition follows the cohort's claim (ClaimFollower), looking for
    a new chunk every `CLAIM_POLL_SECONDS`.
    """
    follower = ClaimFollower(run.pool, run.input)
    while True:
        if await follower.nothing_new():
            run.progress.waiting_for_claim(checkpoint)
            await asyncio.sleep(CLAIM_POLL_SECONDS)
            continue
        result = await run.batch(checkpoint)
        if result.batch_rows > 0:
            checkpoint = PartitionCheckpoint(
                last_account_id=result.last_account_id,
                counts=checkpoint.counts + result.counts,
                batches=checkpoint.batches + 1,
            )
            run.progress.batch_committed(checkpoint)
        if result.batch_rows < result.batch_size and follower.ends_at_short_batch():
            return checkpoint


class HeartbeatingProgress(PartitionProgress):
    """The activity's progress: the checkpoint heartbeated after each batch and while waiting (a
    retry resumes from it), batch metrics, and the partition handed back at a batch boundary when
    the worker shuts down."""

    def __init__(self, input: CleanupPartitionInput, attempt: int, counted: PartitionCounts, interval: float) -> None:
        self.input = input
        self.attempt = attempt
        self.counted = counted
        self.wait_interval = interval

    def batch_committed(self, checkpoint: PartitionCheckpoint) -> None:
        failpoints.hit(f"{CLEANUP_PARTITION}.after_commit")
        activity.heartbeat(checkpoint.model_dump(mode="json"))
        batch = checkpoint.counts - self.counted
        metrics.record_cleanup_batch(cleaned=batch.cleaned, already_applied=batch.already_applied, failed=batch.failed)
        self.counted = checkpoint.counts
        if batch.already_applied:
            # Another attempt of this partition (a retry while this one was thought dead, or a
            # zombie after its retry) got there first: this batch changed nothing for those.
            log.info(
                "partition %s of %s attempt %s batch %s: %s account(s) already applied, %s cleaned now",
                self.input.partition_no,
                self.input.cleanup_id,
                self.attempt,
                checkpoint.batches,
                batch.already_applied,
                batch.cleaned,
            )
        if activity.is_worker_shutdown():
            # A graceful shutdown (SIGTERM, a deploy): hand the partition back now, at a batch
            # boundary, with the cursor heartbeated, so another worker resumes it at once
            # instead of waiting out the heartbeat timeout.
            raise handed_back(
                f"partition {self.input.partition_no} handed back after {checkpoint.last_account_id or 'the start'}"
            )

    def still_working(self, checkpoint: PartitionCheckpoint) -> None:
        activity.heartbeat(checkpoint.model_dump(mode="json"))

    def waiting_for_budget(self, checkpoint: PartitionCheckpoint, budget: dict[str, Any]) -> None:
        # The checkpoint stays first (a retry resumes from it); the UI shows why it waits.
        activity.heartbeat(checkpoint.model_dump(mode="json"), {"load_budget": budget})

    def waiting_for_claim(self, checkpoint: PartitionCheckpoint) -> None:
        activity.heartbeat(checkpoint.model_dump(mode="json"), {"waiting_for_claim": True})
        if activity.is_worker_shutdown():
            raise handed_back(f"partition {self.input.partition_no} handed back while the claim runs")


class CleanupActivities:
    """Holds the pools and the compiled cleanup statement; one instance per worker process.

    `claim_pool` (default: `pool`): connections of the cohort claims alone, so a claim never waits
    for a connection behind the batches of the partitions that follow it."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        partition_batch_sql: str,
        compiled: CompiledCleanup | None = None,
        budget: LoadBudget | None = None,
        claim_pool: asyncpg.Pool | None = None,
    ) -> None:
        self.pool = pool
        self.claim_pool = claim_pool or pool
        self.partition_batch_sql = partition_batch_sql
        self.compiled = compiled or CompiledCleanup.from_batch_sql(partition_batch_sql)
        self.budget = budget or LoadBudget(pool)  # the worker passes its own; the operator's row wins

    @classmethod
    async def create(
        cls,
        pool: asyncpg.Pool,
        targets: CleanupTargets,
        claim_pool: asyncpg.Pool | None = None,
        budget: LoadBudget | None = None,
        settings: CleanupSettings = DEFAULT_CLEANUP_SETTINGS,
    ) -> CleanupActivities:
        """Check the declared targets against the live schema, then compile them once, with the
        worker's `settings.cleanup` (the anonymize key, the reminders)."""
        compiled = await CompiledCleanup.compile(pool, targets, settings)
        await pool.execute(
            SQL.record_worker_target_set,
            *SQL.bind("record_worker_target_set", fingerprint=targets.fingerprint, targets=targets.model_dump_json()),
        )
        # Warned, not refused: without the index every batch reads the table whole (late, not wrong).
        for m in compiled.missing_indexes:
            log.warning(
                "target %s: no index on %s.%s (~%d rows): every batch reads the table whole; fix: %s",
                m.target,
                m.table,
                m.match_column,
                m.row_estimate,
                m.fix,
            )
        metrics.set_targets_missing_index(len(compiled.missing_indexes))
        return cls(pool, compiled.batch_sql, compiled, budget=budget, claim_pool=claim_pool)

    async def _hold_if_paused(self, cleanup_id: str) -> None:
        """A planner paused with --hold-scheduled holds its bucket cleanups here, before any claim:
        the attempt fails (retryable, visible in the run) and the next one looks again."""
        held = await held_by_pause(self.pool, activity.info().task_queue, cleanup_id)
        if held is not None:
            raise failure(CleanupFailure.HELD_BY_PAUSE, held, next_retry_delay=HOLD_RETRY_DELAY)

    @activity.defn(name=CLAIM_CLEANUP)
    async def claim_cleanup(self, input: ClaimCleanupInput) -> ClaimResult:
        """Move one still-active account to 'cleaning' (a cohort claims in chunks:
        `claim_cleanup_in_chunks`). Re-running it claims nothing new and reports the same claim,
        read back from the database."""
        await self._hold_if_paused(input.cleanup_id)
        await wait_for_database_clock(self.pool, input.deadline, cleanup_id=input.cleanup_id)
        async with self.pool.acquire() as conn, db.transaction(conn):
            skipped_renewed = skipped_stale = 0
            await conn.execute(
                SQL.claim_account,
                *SQL.bind(
                    "claim_account",
                    cleanup_id=input.cleanup_id,
                    account_id=input.account_id,
                    deadline=input.deadline,
                    cleanup_version=input.expected_version,
                    namespace=claiming_namespace(),
                ),
            )
            state = await conn.fetchrow(SQL.account_state, input.account_id)
            if state is None:
                raise cleanup_failure(CleanupFailure.UNKNOWN_ACCOUNT, f"unknown account {input.account_id}")
            if state["claimed_by"] != input.cleanup_id:
                renewed = state["status"] == "renewed" or (
                    state["cleanup_version"] != input.expected_version and state["renewed_at"] is not None
                )
                skipped_renewed, skipped_stale = (1, 0) if renewed else (0, 1)
            per_partition = [0] * input.partitions
            for row in await conn.fetch(SQL.claims_per_partition, input.cleanup_id):
                per_partition[row["partition_no"]] = row["claimed"]
        failpoints.hit(f"{CLAIM_CLEANUP}.after_commit")
        return ClaimResult(
            claimed_per_partition=per_partition,
            skipped_renewed=skipped_renewed,
            skipped_stale=skipped_stale,
        )

    @activity.defn(name=CLAIM_CLEANUP_IN_CHUNKS)
    async def claim_cleanup_in_chunks(self, input: ClaimChunkedInput) -> ClaimResult:
        """The cohort claim in bounded chunks (10,000 accounts per statement by default), as a
        regular activity that heartbeats after each chunk: no statement grows with the cohort."""
        activity.heartbeat()
        await self._hold_if_paused(input.cleanup_id)

        def after_chunk(claimed: int) -> None:
            activity.heartbeat(claimed)
            if activity.is_worker_shutdown():
                # A graceful shutdown: the chunk is committed with the cursor, so another worker
                # resumes the claim at once instead of waiting out the heartbeat timeout.
                raise handed_back(f"the claim of {input.cleanup_id} handed back after a chunk")

        return await claim_in_chunks(
            self.claim_pool,
            input,
            after_chunk,
            beat=activity.heartbeat,
            budget=self.budget,
            waiting_for_budget=lambda budget: activity.heartbeat({"load_budget": budget}),
        )

    @activity.defn(name=CHECK_ACCOUNT_RENEWED)
    async def check_account_renewed(self, input: AccountRenewalCheck) -> bool:
        """The signal says "renewed"; the database decides whether it is true."""
        state = await self.pool.fetchrow(SQL.account_state, input.account_id)
        if state is None:
            raise cleanup_failure(CleanupFailure.UNKNOWN_ACCOUNT, f"unknown account {input.account_id}")
        return bool(state["cleanup_version"] != input.expected_version and state["status"] != "cleaning")

    @activity.defn(name=CLEANUP_PARTITION)
    async def cleanup_partition(self, input: CleanupPartitionInput) -> PartitionReport:
        """Clean one partition in keyset-paged batches, one statement and one transaction per batch.

        The heartbeat carries the cursor, so a retry on another node resumes after the last batch
        it knows of; a batch that committed without being heartbeated is judged 'already applied'.
        """
        info = activity.info()
        compiled = await cleanup_target_set(self.pool, self.compiled, input.cleanup_id)
        details = resume_details()  # a re-run of this attempt resumes after its last committed batch
        start = PartitionCheckpoint.model_validate(details[0]) if details else PartitionCheckpoint()
        attempt_start = (
            PartitionCheckpoint.model_validate(info.heartbeat_details[0]) if info.heartbeat_details else start
        )
        timeout = info.heartbeat_timeout
        interval = input.heartbeat_interval_seconds or (timeout.total_seconds() / 3 if timeout else 10.0)
        run = PartitionRun(
            self.pool,
            compiled,
            input,
            HeartbeatingProgress(input, info.attempt, start.counts, interval),
            budget=self.budget,
            schema_errors_final=info.attempt >= SCHEMA_ERROR_ATTEMPTS,
        )
        checkpoint = await clean_partition_batches(run, start)
        c = checkpoint.counts
        await self.pool.execute(
            SQL.record_partition_report,
            *SQL.bind(
                "record_partition_report",
                cleanup_id=input.cleanup_id,
                partition_no=input.partition_no,
                **c.model_dump(),
            ),
        )
        in_database = await self.pool.fetchrow(
            SQL.partition_applied,
            *SQL.bind("partition_applied", cleanup_id=input.cleanup_id, partition_no=input.partition_no),
        )
        assert in_database is not None
        return PartitionReport(
            partition_no=input.partition_no,
            counts=c,
            batches=checkpoint.batches,
            claimed=in_database["claimed"],
            applied=in_database["applied"],
            attempt=info.attempt,
            attempt_counts=c - attempt_start.counts,
        )

    @activity.defn(name=CLEAN_SMALL_COHORT)
    async def clean_small_cohort(self, input: SmallCohortInput) -> SmallCohortResult:
        """A range cohort of one partition (the planner's cohort that fits one batch): its claim, its
        partition and its settlement, one after the other in one activity instead of three steps.

        The same statements as the three activities, each as safe run twice as on its own, so a
        retry from any point leaves one effect: a claim already done reports itself, read back; the
        partition resumes after its heartbeated cursor (kept first in every heartbeat of the
        claim too) and judges a batch committed unheartbeated 'already applied'; a settlement
        written returns itself. No account is claimed before the database clock passes the range."""
        details = resume_details()
        checkpoint = details[0] if details else PartitionCheckpoint().model_dump(mode="json")
        activity.heartbeat(checkpoint)
        await self._hold_if_paused(input.claim.cleanup_id)

        def after_chunk(claimed: int) -> None:
            activity.heartbeat(checkpoint)
            if activity.is_worker_shutdown():
                raise handed_back(f"the claim of {input.claim.cleanup_id} handed back after a chunk")

        claim = await claim_in_chunks(
            self.claim_pool,
            input.claim,
            after_chunk,
            beat=lambda: activity.heartbeat(checkpoint),
            budget=self.budget,
            waiting_for_budget=lambda budget: activity.heartbeat(checkpoint, {"load_budget": budget}),
        )
        report = await self.cleanup_partition(input.partition)
        settlement = await self._settle(
            SettleCleanupInput(
                cleanup_id=input.claim.cleanup_id,
                deadline=input.deadline,
                partitions=input.claim.partitions,
                claim=claim,
                reports=[report],
            )
        )
        return SmallCohortResult(claim=claim, report=report, settlement=settlement)

    @activity.defn(name=SETTLE_CLEANUP)
    async def settle_cleanup(self, input: SettleCleanupInput) -> CleanupSettlement:
        """Record the cohort's result once; a re-delivery returns the row written the first time."""
        return await self._settle(input)

    async def _settle(self, input: SettleCleanupInput) -> CleanupSettlement:
        async with self.pool.acquire() as conn, db.transaction(conn):
            missing = await conn.fetch(SQL.unreported_partitions, input.cleanup_id)
            if missing:
                # The workflow's join makes this unreachable; the database check makes it provable.
                raise failure(
                    ErrorType.JOIN_INCOMPLETE,
                    f"partitions {[r[0] for r in missing]} have not reported; refusing to settle",
                )
            totals = PartitionCounts()
            for report in input.reports:
                totals = totals + report.counts
            written = await conn.execute(
                SQL.settle_cleanup,
                *SQL.bind(
                    "settle_cleanup",
                    cleanup_id=input.cleanup_id,
                    deadline=input.deadline,
                    account_id=input.account_id,
                    partitions=input.partitions,
                    skipped_renewed=input.claim.skipped_renewed + totals.skipped_renewed,
                    skipped_stale=input.claim.skipped_stale + totals.skipped_stale,
                    already_applied=totals.already_applied,
                ),
            )
            row = await conn.fetchrow(SQL.get_settlement, input.cleanup_id)
            reasons = (
                [
                    r["reason"]
                    for r in await conn.fetch(
                        SQL.failed_reasons,
                        *SQL.bind("failed_reasons", cleanup_id=input.cleanup_id, most=FAILED_REASONS_SHOWN),
                    )
                ]
                if row is not None and row["failed"]
                else []
            )
        failpoints.hit(f"{SETTLE_CLEANUP}.after_commit")
        assert row is not None
        if written.endswith(" 1"):  # this delivery wrote the settlement: count its skips once
            metrics.record_cleanup_settled(skipped_renewed=row["skipped_renewed"], skipped_stale=row["skipped_stale"])
        return CleanupSettlement.from_row(row, failed_reasons=reasons)
