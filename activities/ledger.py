"""Activities of the nightly ledger reconciliation.

Each is safe under at-least-once delivery: a shard re-run after a crash, by a second run of the
same date, or concurrently with another run, leaves one correction (or one review row) per
payment and date, and reports the same counts, read back from the database.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime
from typing import Any

import asyncpg
from temporalio import activity
from temporalio.exceptions import ApplicationError

import ledger
from budget.controller import LoadBudget, under_budget
from core import db, failpoints, metrics
from core.errors import ErrorType, failure, handed_back
from core.heartbeat import heartbeating, run_heartbeating
from core.outage import resume_details
from core.queries import load
from ledger.errors import LedgerFailure, ledger_failure
from ledger.models import (
    CHECK_LEDGER_DAY,
    RECONCILE_SHARD,
    SETTLE_LEDGER_DATE,
    LedgerDay,
    LedgerDayCheck,
    LedgerSettlement,
    ReconcileShardInput,
    SettleLedgerInput,
    ShardCheckpoint,
    ShardReport,
)

SQL = load(ledger.__file__)
log = logging.getLogger("ledger")


def _bad_input(message: str) -> ApplicationError:
    return ledger_failure(LedgerFailure.INVALID_LEDGER_INPUT, message)


async def check_day(conn: asyncpg.Connection | asyncpg.Pool, business_date: date, shards: int) -> LedgerDay:
    """Malformed input fails here, before any effect: a date not loaded, or a wrong shard count."""
    row = await conn.fetchrow(SQL.ledger_day, business_date)
    if row is None:
        if business_date >= datetime.now(UTC).date():
            raise _bad_input(f"business date {business_date.isoformat()} is not over yet (no ledger data)")
        raise _bad_input(
            f"no ledger data loaded for business date {business_date.isoformat()}; "
            "load the day (or `starter.py ledger seed`) before reconciling it"
        )
    if row["shards"] != shards:
        raise _bad_input(
            f"business date {business_date.isoformat()} is split into {row['shards']} shard(s) "
            f"(0-{row['shards'] - 1}), not {shards}"
        )
    return LedgerDay.from_row(row)


async def run_batch(pool: asyncpg.Pool, input: ReconcileShardInput, checkpoint: ShardCheckpoint) -> asyncpg.Record:
    """One batch of a shard: the reconcile_batch statement in its own transaction, after the
    shard's advisory lock (so attempts of one shard take turns and each batch sees the others')."""
    async with pool.acquire() as conn, db.transaction(conn):
        failpoints.hit(f"{RECONCILE_SHARD}.in_batch")  # the batch's transaction is open, the shard lock not yet asked
        await conn.execute(
            SQL.lock_shard, *SQL.bind("lock_shard", business_date=input.business_date, shard=input.shard)
        )
        row = await conn.fetchrow(
            SQL.reconcile_batch,
            *SQL.bind(
                "reconcile_batch",
                business_date=input.business_date,
                shard=input.shard,
                after_game=checkpoint.last_game,
                after_payment_id=checkpoint.last_payment_id,
                batch_size=input.batch_size,
                tolerance_cents=input.tolerance_cents,
                workflow_id=input.workflow_id,
            ),
        )
        assert row is not None
        if row["updated"] != row["corrected"]:
            # Rolls the batch back: a correction must never be recorded without its ledger update.
            raise ledger_failure(
                LedgerFailure.LEDGER_CONFLICT,
                f"shard {input.shard}: {row['corrected']} correction(s) recorded but "
                f"{row['updated']} ledger row(s) updated; the batch was rolled back",
            )
    return row


BatchGuard = Callable[[Awaitable[asyncpg.Record], ShardCheckpoint], Awaitable[asyncpg.Record]]


async def reconcile_shard_batches(
    pool: asyncpg.Pool,
    input: ReconcileShardInput,
    checkpoint: ShardCheckpoint,
    after_batch: Callable[[ShardCheckpoint, asyncpg.Record], None],
    guard: BatchGuard | None = None,
    budget: LoadBudget | None = None,
    waiting_for_budget: Callable[[ShardCheckpoint, dict[str, Any]], None] | None = None,
) -> ShardCheckpoint:
    """The shard's work without orchestration: keyset batches, one statement and COMMIT each.

    Shared by the activity (which heartbeats through `guard` and `after_batch`) and by the
    benchmark's direct baseline, so both run the same SQL in the same batches. With a `budget`
    (budget.controller), each batch first takes its slot and rows of the database's load budget.
    """

    async def budgeted(checkpoint: ShardCheckpoint) -> asyncpg.Record:
        # The budget is taken when the guard awaits the batch (after its failpoint), held for it only.
        waiting = functools.partial(waiting_for_budget, checkpoint) if waiting_for_budget else None
        async with under_budget(budget, "ledger", input.batch_size, waiting) as grant:
            row = await run_batch(pool, input, checkpoint)
            grant.rows_done = row["batch_rows"]
            return row

    while True:
        batch = budgeted(checkpoint)
        row = await (guard(batch, checkpoint) if guard is not None else batch)
        if row["batch_rows"] == 0:
            return checkpoint
        checkpoint = ShardCheckpoint(
            last_game=row["last_game"],
            last_payment_id=row["last_payment_id"],
            batches=checkpoint.batches + 1,
            keys_examined=checkpoint.keys_examined + row["batch_rows"],
            discrepancies=checkpoint.discrepancies + row["discrepancies"],
            corrected_now=checkpoint.corrected_now + row["corrected"],
            reviewed_now=checkpoint.reviewed_now + row["reviewed"],
            already_applied=checkpoint.already_applied + row["already_applied"],
            duplicate_report_rows=checkpoint.duplicate_report_rows + row["duplicate_report_rows"],
            corrections_judged=checkpoint.corrections_judged + row["corrections_judged"],
            reviews_judged=checkpoint.reviews_judged + row["reviews_judged"],
            fp_ledger_rows=checkpoint.fp_ledger_rows + row["fp_ledger_rows"],
            fp_ledger_sum=checkpoint.fp_ledger_sum + int(row["fp_ledger_sum"]),
            fp_report_rows=checkpoint.fp_report_rows + row["fp_report_rows"],
            fp_report_max=max(checkpoint.fp_report_max, row["fp_report_max"]),
            fp_report_sum=checkpoint.fp_report_sum + int(row["fp_report_sum"]),
        )
        after_batch(checkpoint, row)
        if row["batch_rows"] < input.batch_size:
            return checkpoint


async def report_shard(pool: asyncpg.Pool, input: ReconcileShardInput, checkpoint: ShardCheckpoint) -> ShardReport:
    """Record the shard's report and return the recorded one (read back from the database).

    The report is what this run judged: each key counted as a correction or a review row (now or
    before), so it balances by construction, with the fingerprint of exactly the judged inputs.
    Data that changed during the run (a provider row inserted behind the cursor, a ledger row
    updated after it was judged) is not in that fingerprint, so the next run or re-check finds the
    shard changed and judges it; nothing is absorbed. See record_shard_report for when a report
    replaces the recorded one: only that decision needs the shard's current fingerprint (one more
    read of every row of the shard), so the first report of a shard, inserted as it is, skips it.
    """
    if checkpoint.corrections_judged + checkpoint.reviews_judged != checkpoint.discrepancies:
        raise ledger_failure(  # the batch statement's verdict classes cover every discrepancy
            LedgerFailure.LEDGER_UNBALANCED,
            f"shard {input.shard} of {input.business_date} does not balance: "
            f"{checkpoint.discrepancies} discrepancies found, {checkpoint.corrections_judged} corrected, "
            f"{checkpoint.reviews_judged} sent to review",
        )
    judged = checkpoint.judged_fingerprint
    async with pool.acquire() as conn, db.transaction(conn):
        await conn.execute(
            SQL.lock_shard, *SQL.bind("lock_shard", business_date=input.business_date, shard=input.shard)
        )
        # Under the shard lock no other attempt can report in between: no report now means ours is inserted.
        recorded = await conn.fetchval(SQL.shard_report_exists, input.business_date, input.shard)
        current = await conn.fetchval(SQL.shard_fingerprint, input.business_date, input.shard) if recorded else None
        if current is not None and current != judged:
            log.info(
                "shard %s of %s: inputs changed during the run; the report describes what was judged "
                "and the next run or re-check judges the change",
                input.shard,
                input.business_date,
            )
        await conn.execute(
            SQL.record_shard_report,
            *SQL.bind(
                "record_shard_report",
                business_date=input.business_date,
                shard=input.shard,
                workflow_id=input.workflow_id,
                keys_examined=checkpoint.keys_examined,
                discrepancies=checkpoint.discrepancies,
                corrected=checkpoint.corrections_judged,
                sent_to_review=checkpoint.reviews_judged,
                duplicate_report_rows=checkpoint.duplicate_report_rows,
                batches=checkpoint.batches,
                judged_fingerprint=judged,
                current_fingerprint=current,
            ),
        )
        row = await conn.fetchrow(SQL.get_shard_report, input.business_date, input.shard)
    assert row is not None
    return _report(row)


async def report_if_unchanged(pool: asyncpg.Pool, input: ReconcileShardInput) -> ShardReport | None:
    """The recorded report, if the shard's inputs are exactly those it was recorded for.

    Judging the same inputs again would find every key already corrected, in review or matching and
    write nothing; so a rerun of a reconciled night costs one read of the shard, not a re-judge.
    The recorded fingerprint is that of the inputs the report's run judged (not of the shard after
    the run), so a change during that run makes this miss, and the shard is judged again.
    """
    async with pool.acquire() as conn, db.transaction(conn):
        await conn.execute(
            SQL.lock_shard, *SQL.bind("lock_shard", business_date=input.business_date, shard=input.shard)
        )
        recorded = await conn.fetchrow(SQL.get_shard_report, input.business_date, input.shard)
        if recorded is None or recorded["input_fingerprint"] is None:
            return None
        fingerprint = await conn.fetchval(SQL.shard_fingerprint, input.business_date, input.shard)
    if fingerprint != recorded["input_fingerprint"]:
        return None
    return _report(recorded).model_copy(update={"unchanged_since_report": True})


def _report(row: asyncpg.Record) -> ShardReport:
    return ShardReport(
        business_date=row["business_date"],
        shard=row["shard"],
        keys_examined=row["keys_examined"],
        discrepancies_found=row["discrepancies_found"],
        corrected=row["corrected"],
        sent_to_review=row["sent_to_review"],
        duplicate_report_rows=row["duplicate_report_rows"],
        batches=row["batches"],
    )


def _resume_point(input: ReconcileShardInput, details: tuple[Any, ...], attempt: int) -> ShardCheckpoint:
    """Where this attempt starts: the checkpoint last heartbeated (by this attempt or the one before),
    else the shard's beginning."""
    checkpoint = ShardCheckpoint.model_validate(details[0]) if details else ShardCheckpoint()
    if checkpoint.batches:
        log.info(
            "shard %s of %s attempt %s resumes after batch %s at (%s, %s)",
            input.shard,
            input.business_date,
            attempt,
            checkpoint.batches,
            checkpoint.last_game,
            checkpoint.last_payment_id,
        )
    return checkpoint


def _after_batch(input: ReconcileShardInput, attempt: int, checkpoint: ShardCheckpoint, row: asyncpg.Record) -> None:
    """After a batch's COMMIT: heartbeat its cursor, hand the shard back if the worker is stopping,
    count what this batch inserted."""
    failpoints.hit(f"{RECONCILE_SHARD}.after_commit")
    activity.heartbeat(checkpoint.model_dump(mode="json"))
    if activity.is_worker_shutdown():
        # A graceful shutdown (SIGTERM, a deploy): hand the shard back at this batch boundary,
        # its cursor heartbeated, so another worker resumes it at once.
        raise handed_back(f"shard {input.shard} of {input.business_date} handed back after batch {checkpoint.batches}")
    # What this committed batch inserted (never totals read back), so retries do not double count.
    metrics.record_corrections(row["corrected"])
    metrics.record_review_rows(row["reviewed"])
    log.info(
        "shard %s of %s attempt %s batch %s: %s keys, %s corrected, %s to review, %s already applied",
        input.shard,
        input.business_date,
        attempt,
        checkpoint.batches,
        row["batch_rows"],
        row["corrected"],
        row["reviewed"],
        row["already_applied"],
    )


class LedgerActivities:
    """Holds the pool; one instance per worker process."""

    def __init__(self, pool: asyncpg.Pool, budget: LoadBudget | None = None) -> None:
        self.pool = pool
        self.budget = budget or LoadBudget(pool)  # the worker passes its own; the operator's row wins

    @activity.defn(name=CHECK_LEDGER_DAY)
    async def check_ledger_day(self, input: LedgerDayCheck) -> LedgerDay:
        return await check_day(self.pool, input.business_date, input.shards)

    @activity.defn(name=RECONCILE_SHARD)
    async def reconcile_shard(self, input: ReconcileShardInput) -> ShardReport:
        """Reconcile one shard in keyset-paged batches, one statement and one transaction per batch.

        The heartbeat carries the cursor, so a retry resumes after the last batch it knows of; a
        batch that committed without being heartbeated is re-judged and found already applied.
        Its steps: check the input, skip a shard unchanged since its report, judge and apply the
        batches (each batch's corrections and their records commit together, in `run_batch`),
        then record the report.
        """
        info = activity.info()
        await self._check_shard(input)
        details = resume_details()  # a re-run of this attempt resumes after its last committed batch
        interval = (info.heartbeat_timeout.total_seconds() / 3) if info.heartbeat_timeout else 10.0
        if not details and (unchanged := await self._unchanged_report(input, interval)) is not None:
            return unchanged.model_copy(update={"attempt": info.attempt})
        start = _resume_point(input, details, info.attempt)
        checkpoint = await self._judge_and_apply(input, start, info.attempt, interval)
        report = await run_heartbeating(
            report_shard(self.pool, input, checkpoint),
            lambda: activity.heartbeat(checkpoint.model_dump(mode="json")),
            interval,
        )
        return report.model_copy(
            update={
                "attempt": info.attempt,
                "resumed_from_batch": start.batches,
                "batches_this_attempt": checkpoint.batches - start.batches,
            }
        )

    async def _check_shard(self, input: ReconcileShardInput) -> None:
        """Malformed input fails before any effect: a shard outside the run's or the day's shards."""
        if input.shard >= input.shards:
            raise _bad_input(f"unknown shard {input.shard}: shards are 0-{input.shards - 1}")
        day = await check_day(self.pool, input.business_date, input.shards)
        if input.shard >= day.shards:
            raise _bad_input(f"unknown shard {input.shard} for {day.business_date}: shards are 0-{day.shards - 1}")

    async def _unchanged_report(self, input: ReconcileShardInput, interval: float) -> ShardReport | None:
        """The shard's recorded report when its inputs have not changed since (nothing to judge).

        It waits for the shard lock, which another attempt's batch may hold (a zombie of this shard
        until Postgres ends its idle transaction, the night run beside a re-check): it heartbeats
        while it waits, or the wait itself is taken for a dead worker and retried, again and again."""
        unchanged = await run_heartbeating(report_if_unchanged(self.pool, input), activity.heartbeat, interval)
        if unchanged is not None:
            log.info(
                "shard %s of %s: inputs unchanged since its report; nothing to judge", input.shard, input.business_date
            )
        return unchanged

    async def _judge_and_apply(
        self, input: ReconcileShardInput, start: ShardCheckpoint, attempt: int, interval: float
    ) -> ShardCheckpoint:
        """The shard's batches from `start` on, heartbeating the cursor while each runs, while it waits
        for the load budget and after each commits."""
        return await reconcile_shard_batches(
            self.pool,
            input,
            start,
            functools.partial(_after_batch, input, attempt),
            guard=lambda batch, checkpoint: self._heartbeating(batch, checkpoint, interval),
            budget=self.budget,
            waiting_for_budget=lambda checkpoint, budget: activity.heartbeat(
                checkpoint.model_dump(mode="json"), {"load_budget": budget}
            ),
        )

    @staticmethod
    async def _heartbeating(coro: Any, checkpoint: ShardCheckpoint, interval: float) -> asyncpg.Record:
        """Await a batch while heartbeating the last checkpoint, so a slow or blocked batch is not
        mistaken for a dead worker; a cancelled activity cancels the statement (and rolls it back)."""
        try:
            await failpoints.reached("reconcile_shard.before_batch", checkpoint)
        except BaseException:
            coro.close()
            raise
        return await run_heartbeating(coro, lambda: activity.heartbeat(checkpoint.model_dump(mode="json")), interval)

    @activity.defn(name=SETTLE_LEDGER_DATE)
    async def settle_ledger_date(self, input: SettleLedgerInput) -> LedgerSettlement:
        """Settle the date from its shard reports once every shard has reported: the first
        settlement is revision 1; a later one whose totals differ (late data judged by a re-check)
        records the next revision with what changed and why; equal totals write nothing. Revisions
        of one date are serialised by an advisory lock, so a night run and re-checks never race.
        It heartbeats while it runs (waiting for that lock, say), so a worker that dies during it is
        noticed within the heartbeat timeout instead of the start-to-close timeout."""
        if not activity.in_activity():  # the benchmark's direct baseline calls it as a plain method
            return await self._settle(input)
        timeout = activity.info().heartbeat_timeout
        async with heartbeating(activity.heartbeat, timeout.total_seconds() / 3 if timeout else 10.0):
            return await self._settle(input)

    async def _settle(self, input: SettleLedgerInput) -> LedgerSettlement:
        async with self.pool.acquire() as conn, db.transaction(conn):
            await conn.execute(SQL.lock_settlement, *SQL.bind("lock_settlement", business_date=input.business_date))
            await check_day(conn, input.business_date, input.shards)
            missing = await conn.fetch(SQL.unreported_shards, input.business_date, input.shards)
            if missing:
                # The workflow's join makes this unreachable; the database check makes it provable.
                raise failure(
                    ErrorType.JOIN_INCOMPLETE,
                    f"shards {[r['shard'] for r in missing]} of {input.business_date} have not reported; "
                    "refusing to settle",
                )
            t = await conn.fetchrow(SQL.date_totals, input.business_date)
            assert t is not None
            if t["corrected"] + t["sent_to_review"] != t["discrepancies_found"]:
                # Unreachable (each shard report balances by CHECK); kept as the last line of defence.
                raise ledger_failure(
                    LedgerFailure.LEDGER_UNBALANCED,
                    f"{input.business_date} does not balance: {t['discrepancies_found']} discrepancies "
                    f"found, {t['corrected']} corrected, {t['sent_to_review']} sent to review",
                )
            await conn.execute(
                SQL.settle_revision,
                *SQL.bind(
                    "settle_revision",
                    business_date=input.business_date,
                    shards=input.shards,
                    keys_examined=t["keys_examined"],
                    discrepancies_found=t["discrepancies_found"],
                    corrected=t["corrected"],
                    sent_to_review=t["sent_to_review"],
                    duplicate_report_rows=t["duplicate_report_rows"],
                    workflow_id=input.workflow_id,
                    reason=input.reason,
                ),
            )
            row = await conn.fetchrow(SQL.get_settlement, input.business_date)
        failpoints.hit(f"{SETTLE_LEDGER_DATE}.after_commit")
        assert row is not None
        return LedgerSettlement.from_row(row)
