"""Reconciliation stays exact when data moves during a run, when attempts of a shard
overlap, and when discrepancies arrive late. Real Temporal, real Postgres; no timing assertions.

1. data inserted and updated behind the cursor during a run is not absorbed into the shard's
   fingerprint: a later rerun judges it and settles it as the next revision;
2. two attempts of one shard at once (the first held on a row lock, the second started, the first
   released): one correction per key, equal reports, a balanced settlement;
3. a late discrepancy after the settlement: a re-check (its own workflow ID) writes only the new
   correction and review row and records revision 2 with totals that balance; a re-check that
   finds nothing new writes nothing;
4. the night run and a re-check of the same date at once: both complete, one revision.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import date
from typing import Any

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment

import ledger
from activities.ledger import LedgerActivities
from core import db, failpoints
from core.queries import load
from ledger.cli import _status_text
from ledger.models import ReconcileShardInput, SettleLedgerInput, ShardCheckpoint, ledger_workflow_id
from ledger.operations import ledger_status
from tests.helpers import wait_until
from tests.ledger_helpers import digest, double_postings, id_prefix, reconcile, seed_day

D = date(2026, 10, 25)


async def duplicate_effects(pool: asyncpg.Pool) -> int:
    """Corrections or review rows recorded twice for one payment and date."""
    return int(
        await pool.fetchval(
            """
            SELECT (SELECT count(*) - count(DISTINCT idempotency_key) FROM ledger_corrections)
                 + (SELECT count(*) - count(DISTINCT (game, payment_id, business_date)) FROM ledger_corrections)
                 + (SELECT count(*) - count(DISTINCT review_key) FROM ledger_review)
            """
        )
    )


async def key_before(pool: asyncpg.Pool, game: str, payment_id: str, shards: int) -> str:
    """A payment ID of `game` that sorts before (game, payment_id) and lands in the same shard."""
    shard = await pool.fetchval("SELECT ledger_shard_of($1, $2, $3)", game, payment_id, shards)
    for i in range(1000):
        candidate = f"pay-0-late-{i:03d}"  # '0' < '2': before every seeded payment of the game
        if await pool.fetchval("SELECT ledger_shard_of($1, $2, $3)", game, candidate, shards) == shard:
            assert candidate < payment_id
            return candidate
    raise AssertionError("no candidate key")


async def waiting_backends(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def test_data_moved_behind_the_cursor_during_a_run_is_judged_by_the_next_run(client, pool, task_queue, worker):
    seeded = await seed_day(pool, D, payments=600, shards=2)
    moved: dict[str, Any] = {}

    async def behind_the_cursor(checkpoint: ShardCheckpoint) -> None:
        """Before the third batch of the first shard: a provider row for an unknown payment behind
        the cursor, and an update (version bumped) of a payment judged as matching in batch 1 or 2."""
        if checkpoint.batches != 2 or moved:
            return
        game, cursor = checkpoint.last_game, checkpoint.last_payment_id
        moved["shard"] = await pool.fetchval("SELECT ledger_shard_of($1, $2, 2)", game, cursor)
        moved["unknown"] = await key_before(pool, game, cursor, 2)
        await pool.execute(
            "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)"
            " VALUES ($1, $2, $3, $4, 4321, 'EUR', 'settled')",
            D,
            moved["shard"],
            game,
            moved["unknown"],
        )
        moved["updated"] = await pool.fetchval(
            """
            UPDATE ledger_payments p SET amount_cents = p.amount_cents + 7, version = p.version + 1
            WHERE (p.game, p.payment_id) = (
                SELECT l.game, l.payment_id FROM ledger_payments l
                JOIN ledger_report_rows r USING (game, payment_id)
                WHERE l.business_date = $1 AND l.shard = $2 AND (l.game, l.payment_id) <= ($3, $4)
                  AND l.status = 'captured' AND r.status = 'settled' AND r.amount_cents = l.amount_cents
                  AND l.version = 1
                  AND NOT EXISTS (SELECT 1 FROM ledger_review v WHERE v.game = l.game AND v.payment_id = l.payment_id)
                ORDER BY l.game, l.payment_id LIMIT 1)
            RETURNING p.payment_id
            """,
            D,
            moved["shard"],
            game,
            cursor,
        )
        assert moved["updated"] is not None

    failpoints.set_hook("reconcile_shard.before_batch", behind_the_cursor)
    try:
        night = await reconcile(client, pool, task_queue, D, batch_size=100, max_parallel=1)
    finally:
        failpoints.set_hook("reconcile_shard.before_batch", None)
    assert moved, "the hook ran between two batches"
    shard = moved["shard"]

    # The night judged neither change (both were behind its cursor) and settled what it judged...
    assert night.settlement.balanced and night.settlement.revision == 1
    assert night.settlement.discrepancies_found == seeded.expected_discrepancies
    assert await pool.fetchval("SELECT count(*) FROM ledger_review WHERE payment_id = $1", moved["unknown"]) == 0
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections WHERE payment_id = $1", moved["updated"]) == 0
    # ...and its shard report's fingerprint is of the judged inputs, not of the shard after the run.
    recorded = await pool.fetchval(
        "SELECT input_fingerprint FROM ledger_shard_reports WHERE business_date = $1 AND shard = $2", D, shard
    )
    current = await pool.fetchval(load(ledger.__file__).shard_fingerprint, D, shard)
    assert recorded is not None and recorded != current

    # The next run of the date does not take the rerun shortcut for that shard: it judges both.
    rerun = await reconcile(client, pool, task_queue, D, id_prefix=f"rerun-{task_queue}")
    by_shard = {r.shard: r for r in rerun.shards}
    assert not by_shard[shard].unchanged_since_report and by_shard[shard].batches_this_attempt > 0
    assert by_shard[1 - shard].unchanged_since_report
    review = await pool.fetchrow("SELECT kind, reason FROM ledger_review WHERE payment_id = $1", moved["unknown"])
    assert review is not None and review["kind"] == "unknown_payment"
    correction = await pool.fetchrow(
        "SELECT kind, version_before, version_after FROM ledger_corrections WHERE payment_id = $1", moved["updated"]
    )
    assert correction is not None and tuple(correction) == ("amount_mismatch", 2, 3)

    s = rerun.settlement
    assert s.revision == 2 and s.balanced
    assert (s.discrepancies_found, s.corrected, s.sent_to_review) == (
        night.settlement.discrepancies_found + 2,
        night.settlement.corrected + 1,
        night.settlement.sent_to_review + 1,
    )
    live = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM ledger_corrections) AS c, (SELECT count(*) FROM ledger_review) AS r"
    )
    assert live is not None and (live["c"], live["r"]) == (s.corrected, s.sent_to_review)
    assert await duplicate_effects(pool) == 0


async def test_two_attempts_of_one_shard_at_once_leave_one_correction_per_key(db_url, pool):
    seeded = await seed_day(pool, D, payments=400, shards=2)
    acts = LedgerActivities(pool)
    shard0 = ReconcileShardInput(business_date=D, shard=0, shards=2, batch_size=50, workflow_id="attempt-1")

    blocker = await asyncpg.connect(db_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    try:
        # Hold the first payment of shard 0: the first attempt's first batch waits on it.
        await blocker.execute(
            "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = 0 "
            "ORDER BY game, payment_id LIMIT 1 FOR UPDATE",
            D,
        )
        first = asyncio.ensure_future(ActivityEnvironment().run(acts.reconcile_shard, shard0))
        await wait_until(lambda: _waiting(pool, 1), within=60)
        # The retry of the same shard (the first is still alive: a zombie past its heartbeat timeout).
        second = asyncio.ensure_future(
            ActivityEnvironment().run(acts.reconcile_shard, shard0.model_copy(update={"workflow_id": "attempt-2"}))
        )
        await wait_until(lambda: _waiting(pool, 2), within=60)
    finally:
        await tx.rollback()
        await blocker.close()
    reports = await asyncio.gather(first, second)
    other = await ActivityEnvironment().run(
        acts.reconcile_shard, ReconcileShardInput(business_date=D, shard=1, shards=2, workflow_id="attempt-1")
    )
    settlement = await ActivityEnvironment().run(
        acts.settle_ledger_date, SettleLedgerInput(business_date=D, shards=2, workflow_id="attempt-1")
    )

    keep = {"unchanged_since_report", "attempt", "resumed_from_batch", "batches_this_attempt"}
    assert reports[0].model_dump(exclude=keep) == reports[1].model_dump(exclude=keep)
    assert reports[0].corrected + reports[0].sent_to_review == reports[0].discrepancies_found
    assert settlement.balanced and settlement.revision == 1
    assert (settlement.discrepancies_found, settlement.corrected, settlement.sent_to_review) == (
        seeded.expected_discrepancies,
        seeded.expected_corrections,
        seeded.expected_review,
    )
    assert reports[0].discrepancies_found + other.discrepancies_found == seeded.expected_discrepancies
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == seeded.expected_corrections
    assert await double_postings(pool) == 0

    # A zombie attempt that wakes up after all this (a retry's heartbeat details: no shortcut) judges
    # every key again, finds each applied, writes nothing and fails nothing.
    before = await digest(pool)
    zombie_env = ActivityEnvironment()
    zombie_env.info = dataclasses.replace(
        zombie_env.info, attempt=3, heartbeat_details=[ShardCheckpoint().model_dump(mode="json")]
    )
    late = await zombie_env.run(acts.reconcile_shard, shard0.model_copy(update={"workflow_id": "zombie"}))
    assert not late.unchanged_since_report and late.batches_this_attempt > 0
    assert late.model_dump(exclude=keep) == reports[0].model_dump(exclude=keep)
    assert await digest(pool) == before


async def _waiting(pool: asyncpg.Pool, n: int) -> bool:
    return await waiting_backends(pool) >= n


async def test_a_late_discrepancy_after_settlement_becomes_revision_2(client: Client, pool, task_queue, worker):
    await seed_day(pool, D, payments=400, shards=2)
    night = await reconcile(client, pool, task_queue, D)
    assert night.settlement.revision == 1

    # Late data: a provider row for a payment the ledger does not know, and a ledger payment the
    # provider never settled (both discrepancies, neither seen by the night).
    await pool.execute(
        "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)"
        " VALUES ($1, ledger_shard_of('game-1', 'pay-late-r', 2), 'game-1', 'pay-late-r', 1250, 'EUR', 'settled')",
        D,
    )
    await pool.execute(
        "INSERT INTO ledger_payments (game, payment_id, business_date, shard, amount_cents, currency, status)"
        " VALUES ('game-2', 'pay-late-l', $1, ledger_shard_of('game-2', 'pay-late-l', 2), 990, 'USD', 'captured')",
        D,
    )
    before_corrections = await pool.fetchval("SELECT count(*) FROM ledger_corrections")
    before_review = await pool.fetchval("SELECT count(*) FROM ledger_review")

    recheck = await reconcile(client, pool, task_queue, D, recheck=True)

    assert recheck.workflow_id.startswith(ledger_workflow_id(D, id_prefix(task_queue)) + "-recheck-")
    s = recheck.settlement
    assert s.revision == 2 and s.balanced and s.workflow_id == recheck.workflow_id
    assert (s.discrepancies_found, s.corrected, s.sent_to_review) == (
        night.settlement.discrepancies_found + 2,
        night.settlement.corrected + 1,
        night.settlement.sent_to_review + 1,
    )
    # Only the new correction and review row were written.
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == before_corrections + 1
    assert await pool.fetchval("SELECT count(*) FROM ledger_review") == before_review + 1
    assert await pool.fetchval("SELECT kind FROM ledger_corrections WHERE payment_id = 'pay-late-l'") == "not_settled"
    assert await pool.fetchval("SELECT kind FROM ledger_review WHERE payment_id = 'pay-late-r'") == "unknown_payment"
    assert await double_postings(pool) == 0

    revisions = await pool.fetch("SELECT * FROM ledger_settlement_revisions WHERE business_date = $1 ORDER BY 2", D)
    assert [r["revision"] for r in revisions] == [1, 2]
    assert all(r["corrected"] + r["sent_to_review"] == r["discrepancies_found"] for r in revisions)
    rev2 = revisions[1]
    assert (rev2["new_discrepancies"], rev2["new_corrections"], rev2["new_review_rows"]) == (2, 1, 1)
    late_keys = [("game-1", "pay-late-r"), ("game-2", "pay-late-l")]
    changed = sorted({await pool.fetchval("SELECT ledger_shard_of($1, $2, 2)", g, p) for g, p in late_keys})
    assert list(rev2["changed_shards"]) == changed
    assert rev2["reason"].startswith(f"re-check {recheck.workflow_id}: inputs of shard(s)")
    assert "1 new correction(s), 1 new review row(s)" in rev2["reason"]

    # The original run stays in history; the status shows both revisions.
    night_handle = client.get_workflow_handle(night.workflow_id)
    assert (await night_handle.describe()).status == WorkflowExecutionStatus.COMPLETED
    status = await ledger_status(client, pool, D, id_prefix=id_prefix(task_queue))
    assert status.revision == 2 and [r.revision for r in status.revisions or []] == [1, 2]
    assert (status.corrections or 0) + (status.review_rows or 0) == status.discrepancies_found == s.discrepancies_found
    assert "settlement revisions" in _status_text(status.given())

    # A re-check that finds nothing new writes nothing: no revision 3.
    before = await digest(pool)
    again = await reconcile(client, pool, task_queue, D, recheck=True)
    assert all(r.unchanged_since_report for r in again.shards)
    assert again.settlement.revision == 2
    assert await digest(pool) == before


async def test_the_night_run_and_a_recheck_of_the_same_date_at_once_serialize(
    client: Client, db_url, pool, task_queue, worker
):
    """Both runs' first batch of shard 0 is held on a row lock until both wait; then released:
    both complete, one correction per key, one balanced revision (the second run found no change)."""
    seeded = await seed_day(pool, D, payments=400, shards=2)
    blocker = await asyncpg.connect(db_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    try:
        await blocker.execute(
            "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = 0 "
            "ORDER BY game, payment_id LIMIT 1 FOR UPDATE",
            D,
        )
        runs = asyncio.gather(
            reconcile(client, pool, task_queue, D, batch_size=50),
            reconcile(client, pool, task_queue, D, batch_size=50, recheck=True),
        )
        await wait_until(lambda: _waiting(pool, 2), within=60)
    finally:
        await tx.rollback()
        await blocker.close()
    night, recheck = await runs

    assert night.settlement.balanced and recheck.settlement.balanced
    assert night.settlement.revision == recheck.settlement.revision == 1
    s = recheck.settlement
    assert (s.discrepancies_found, s.corrected, s.sent_to_review) == (
        seeded.expected_discrepancies,
        seeded.expected_corrections,
        seeded.expected_review,
    )
    assert await pool.fetchval("SELECT count(*) FROM ledger_settlement_revisions") == 1
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == seeded.expected_corrections
    assert await double_postings(pool) == 0
