"""Scenario (opt-in): a zombie ledger attempt and late data, with real worker processes.

`./dev harness --scenarios ledger-overlap`. Not in the default set (scenario 11, zombie
attempt, covers a shard's zombie in the quick profile: frozen before the shard lock, not under it).

1. A row lock held by the harness makes shard 0's first batch wait inside its statement (holding
   the shard's advisory lock). The worker running it is frozen (SIGSTOP) past the heartbeat
   timeout: Temporal retries shard 0 on the other worker, which waits for the shard lock. The row
   lock is released, then the frozen worker is woken (SIGCONT): a zombie and its retry of one shard
   now run at once. The date must settle balanced, with one correction per key (before the shard lock
   the retry judged from a stale snapshot and the date failed `LedgerUnbalanced`).
2. Late data after the settlement (a provider row for an unknown payment, a ledger payment the
   provider never settled): `ledger reconcile --recheck` must write exactly one correction and one review
   row and record settlement revision 2, balanced; `ledger status` must show both revisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import asyncpg
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from core import db
from harness.checks import ledger_effects
from harness.common import Ctx, Row, seed_day, wait_for
from ledger.models import LedgerReconciliationResult
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

HEARTBEAT_TIMEOUT = 2.0


async def _shard_attempts(client: Client, workflow_id: str) -> list[tuple[int, int, str]]:
    """(attempt, state, last worker identity) of the pending reconcile_shard activities."""
    desc = await client.get_workflow_handle(workflow_id).describe()
    return [
        (p.attempt, int(p.state), p.last_worker_identity)
        for p in desc.raw_description.pending_activities
        if p.activity_type.name == "reconcile_shard"
    ]


async def _lock_waiters(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def _result(client: Client, workflow_id: str) -> LedgerReconciliationResult:
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, workflow_id)
    return await asyncio.wait_for(handle.result(), 180)


async def run(ctx: Ctx) -> Row:
    row = Row("15 zombie shard under its lock, late data")
    lane = await ctx.h.lane("ledger-overlap", 2)
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    business_date = ctx.ids.business_date()
    seeded = await seed_day(pool, business_date, 300, 2)
    blocker = await asyncpg.connect(lane.database_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    frozen: int | None = None
    held = True
    try:
        await blocker.execute(
            "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = 0 "
            "ORDER BY game, payment_id LIMIT 1 FOR UPDATE",
            business_date,
        )
        started = await start_reconciliation(
            client,
            pool,
            tq,
            ReconcileRequest(
                business_date=business_date, max_parallel=1, batch_size=50, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT
            ),
        )
        wf = started.workflow_id

        async def first_waits() -> bool:
            attempts = await _shard_attempts(client, wf)
            return bool(attempts and attempts[0][2]) and await _lock_waiters(pool) >= 1

        if not await wait_for(first_waits, 60, 0.2):
            raise TimeoutError("shard 0's first attempt never waited on the held row")
        identity = (await _shard_attempts(client, wf))[0][2]
        frozen = int(identity.split("@")[0])
        os.kill(frozen, signal.SIGSTOP)
        row.evidence.append(f"shard 0 attempt 1 on worker {identity} waits on a held row; worker frozen (SIGSTOP)")

        async def retry_waits() -> bool:
            attempts = await _shard_attempts(client, wf)
            started_elsewhere = any(
                a >= 2 and s == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED and who != identity
                for a, s, who in attempts
            )
            return started_elsewhere and await _lock_waiters(pool) >= 2

        if not await wait_for(retry_waits, 90, 0.2):
            raise TimeoutError("shard 0 was not retried on the other worker")
        row.evidence.append("heartbeat timeout: shard 0 attempt 2 runs on the other worker, waits for the shard lock")
        await tx.rollback()
        held = False
        os.kill(frozen, signal.SIGCONT)
        frozen = None
        row.evidence.append("row released, frozen worker woken: zombie and retry of shard 0 run at once")
        night = await _result(client, wf)
        row.runs += 1
        e = await ledger_effects(
            pool,
            business_date,
            shards=2,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        )
        row.duplicates += e.duplicates
        row.lost += e.lost
        row.violations += [f"night: {p}" for p in e.problems()]
        s = night.settlement
        if not (s.balanced and s.revision == 1 and s.discrepancies_found == seeded.expected_discrepancies):
            row.violations.append(f"night settlement {s.model_dump(mode='json')}")
        if night.shards[0].attempt < 2:
            row.violations.append(f"shard 0 was not retried (attempt {night.shards[0].attempt})")
        row.evidence.append(
            f"night settled revision {s.revision}: {s.discrepancies_found} = {s.corrected} + {s.sent_to_review}, "
            f"shard 0 reported by attempt {night.shards[0].attempt}"
        )

        # Late data after the settlement, then a re-check.
        await pool.execute(
            "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)"
            " VALUES ($1, ledger_shard_of('game-1', 'pay-late-r', 2), 'game-1', 'pay-late-r', 1250, 'EUR', 'settled')",
            business_date,
        )
        await pool.execute(
            "INSERT INTO ledger_payments (game, payment_id, business_date, shard, amount_cents, currency, status)"
            " VALUES ('game-2', 'pay-late-l', $1, ledger_shard_of('game-2', 'pay-late-l', 2), 990, 'USD', 'captured')",
            business_date,
        )
        recheck = await start_reconciliation(
            client,
            pool,
            tq,
            ReconcileRequest(business_date=business_date, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT, recheck=True),
        )
        late = await _result(client, recheck.workflow_id)
        row.runs += 1
        e = await ledger_effects(
            pool,
            business_date,
            shards=2,
            expected_corrections=seeded.expected_corrections + 1,
            expected_review=seeded.expected_review + 1,
        )
        row.duplicates += e.duplicates
        row.lost += e.lost
        row.violations += [f"re-check: {p}" for p in e.problems()]
        r = late.settlement
        if not (r.balanced and r.revision == 2 and r.discrepancies_found == s.discrepancies_found + 2):
            row.violations.append(f"re-check settlement {r.model_dump(mode='json')}")
        status = await ledger_status(client, pool, business_date)
        revisions = [v.revision for v in status.revisions or []]
        row.operator_visibility = bool(status.settled and revisions == [1, 2])
        row.evidence.append(f"re-check {recheck.workflow_id}: revision {r.revision}; status revisions {revisions}")
        if status.revisions:
            row.evidence.append(f"revision {revisions[-1]} reason: {status.revisions[-1].reason}")
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        if held:
            await tx.rollback()
        await blocker.close()
        await ctx.h.close_lane(lane)
    return row
