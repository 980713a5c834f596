"""Scenario 3: delay one partition. The settlement must wait, the slow activity keeps heartbeating,
nothing else runs twice.

The harness holds a row lock on one account of one cleanup partition, and on one payment of one
ledger shard, for longer than the activities' heartbeat timeout, so those batches wait inside
their statement. While held: no settlement, status shows k/P reported, the slow activity's
heartbeat keeps moving. After release: every activity ran exactly once (attempt 1 only).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import asyncpg
from temporalio.client import Client

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from core import db
from harness.checks import cleanup_effects, ledger_effects
from harness.common import MATCHES, Ctx, Row, seed_cohort, seed_day, wait_for
from harness.visibility import pending_evidence, temporal_evidence
from ledger.models import ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

HEARTBEAT_TIMEOUT = 2.0


async def heartbeats(client: Client, workflow_id: str, activity: str) -> list[datetime]:
    desc = await client.get_workflow_handle(workflow_id).describe()
    return [
        p.last_heartbeat_time.ToDatetime()
        for p in desc.raw_description.pending_activities
        if p.activity_type.name == activity and p.HasField("last_heartbeat_time")
    ]


async def _held(
    ctx: Ctx,
    row: Row,
    lock_sql: str,
    lock_args: list[Any],
    wf: str,
    activity: str,
    reported: Any,
    total: int,
    hold: float,
) -> dict[str, Any]:
    """Hold the lock; return what was observed while it was held."""
    assert ctx.h.lanes
    lane = ctx.h.lanes[-1]
    blocker = await asyncpg.connect(lane.database_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    seen: dict[str, Any] = {}
    try:
        await blocker.execute(lock_sql, *lock_args)
        await ctx.start_work()  # type: ignore[attr-defined]

        async def others_done() -> bool:
            return bool(await reported() == total - 1)

        # Generous: on a loaded machine the other partitions may take long; the held one waits meanwhile.
        if not await wait_for(others_done, 120, 0.1):
            row.violations.append(f"{wf}: the other partitions did not report while one was held")
        # Then held for `hold` more, sampling its heartbeats: from the start, a slow machine may spend
        # the whole hold on the others and leave no sample.
        others_at = asyncio.get_running_loop().time()
        beats = []
        while asyncio.get_running_loop().time() - others_at < hold:
            beats += await heartbeats(ctx.client, wf, activity)
            await asyncio.sleep(HEARTBEAT_TIMEOUT / 2)
        seen["heartbeats"] = sorted(set(beats))
        seen["pending"] = await pending_evidence(ctx.client, wf)
        seen["reported"] = await reported()
    finally:
        await tx.rollback()
        await blocker.close()
    return seen


async def run(ctx: Ctx) -> Row:
    """Ledger shard and cleanup partition each held 3x their heartbeat timeout: slow, not dead.

    The blocked batch keeps heartbeating while it waits, so it is not retried as a lost attempt.
    """
    return await delay(
        ctx, "3 delay one partition", cleanup_heartbeat=HEARTBEAT_TIMEOUT, cleanup_hold=3 * HEARTBEAT_TIMEOUT
    )


async def delay(ctx: Ctx, name: str, *, cleanup_heartbeat: float, cleanup_hold: float) -> Row:
    row = Row(name)
    lane = await ctx.h.lane("delay", 2)
    rng = ctx.rng("delay")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    try:
        # -- ledger: one shard held ----------------------------------------------------------------
        d = ctx.ids.business_date()
        shards = 4
        seeded = await seed_day(pool, d, 800 * ctx.profile.scale, shards)
        slow = rng.randrange(shards)
        wf = ledger_workflow_id(d)

        async def start_ledger() -> None:
            await start_reconciliation(
                client,
                pool,
                tq,
                ReconcileRequest(business_date=d, batch_size=100, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT),
            )

        async def shards_reported() -> int:
            return int(await pool.fetchval("SELECT count(*) FROM ledger_shard_reports WHERE business_date = $1", d))

        ctx.start_work = start_ledger  # type: ignore[attr-defined]
        seen = await _held(
            ctx,
            row,
            "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = $2 "
            "ORDER BY game, payment_id OFFSET 150 LIMIT 1 FOR UPDATE",
            [d, slow],
            wf,
            "reconcile_shard",
            shards_reported,
            shards,
            3 * HEARTBEAT_TIMEOUT,
        )
        settled_while_held = await pool.fetchval("SELECT count(*) FROM ledger_settlements WHERE business_date = $1", d)
        result = await client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, wf).result()
        row.runs += 1
        retried = await temporal_evidence(client, wf)
        if retried:
            row.violations.append(f"ledger {d}: something ran twice: {retried}")
        if [r.attempt for r in result.shards] != [1] * shards:
            row.violations.append(f"ledger {d}: shard attempts {[r.attempt for r in result.shards]}")
        if settled_while_held:
            row.violations.append(f"ledger {d}: settled while shard {slow} was held")
        if len(seen["heartbeats"]) < 2:
            row.violations.append(f"ledger shard {slow}: heartbeat did not move while held ({seen['heartbeats']})")
        e = await ledger_effects(
            pool,
            d,
            shards=shards,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        )
        ls = await ledger_status(client, pool, d)
        row.evidence.append(
            f"ledger shard {slow} held {3 * HEARTBEAT_TIMEOUT:.0f}s (heartbeat timeout {HEARTBEAT_TIMEOUT:.0f}s): "
            f"{len(seen['heartbeats'])} distinct heartbeats seen, {seen['pending']}, "
            f"{seen['reported']}/{shards} reported, no settlement; after: {ls.shards_done} settled={ls.settled}"
        )

        # -- cleanup: one partition held -------------------------------------------------------------
        n, partitions = 200 * ctx.profile.scale, 4
        prefix, deadline = ctx.ids.prefix("dl"), ctx.ids.past_deadline()
        await seed_cohort(pool, prefix, deadline, n)
        held_partition = rng.randrange(partitions)
        holder: dict[str, str] = {}

        async def start_cleanup_now() -> None:
            started = await start_cleanup(
                client,
                pool,
                tq,
                StartCleanup(
                    deadline=deadline, partitions=partitions, batch_size=10, heartbeat_timeout_seconds=cleanup_heartbeat
                ),
            )
            holder["wf"] = started.workflow_id

        from cleanup.models import cohort_cleanup_id

        cwf = cohort_cleanup_id(deadline)

        async def partitions_reported() -> int:
            return int(await pool.fetchval("SELECT count(*) FROM cleanup_partition_reports WHERE cleanup_id = $1", cwf))

        # Partition p gets the accounts whose rank (by account_id) is p modulo P: lock one in its 3rd batch.
        rank = held_partition + partitions * 25
        ctx.start_work = start_cleanup_now  # type: ignore[attr-defined]
        seen = await _held(
            ctx,
            row,
            # Its cloud save, not the account row: the claim (which updates every account) must not wait.
            "SELECT 1 FROM demo_game.cloud_saves WHERE account_id = (SELECT account_id FROM accounts"
            " WHERE account_id LIKE $1 ORDER BY account_id OFFSET $2 LIMIT 1) FOR UPDATE",
            [f"acct_{prefix}_%", rank],
            cwf,
            "cleanup_partition",
            partitions_reported,
            partitions,
            cleanup_hold,
        )
        settled_while_held = await pool.fetchval("SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = $1", cwf)
        await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, cwf).result()
        row.runs += 1
        retried = await temporal_evidence(client, cwf)
        if retried:
            row.violations.append(f"cleanup {cwf}: something ran twice: {retried}")
        if settled_while_held:
            row.violations.append(f"cleanup {cwf}: settled while partition {held_partition} was held")
        e = e + await cleanup_effects(pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[cwf])
        cs = await cleanup_status(client, pool, cwf)
        row.evidence.append(
            f"cleanup partition {held_partition} held {cleanup_hold:.0f}s "
            f"(heartbeat timeout {cleanup_heartbeat:.0f}s): {seen['pending']}, "
            f"{seen['reported']}/{partitions} reported, no settlement; after: {cs.partitions_reported} "
            f"settled={cs.settled}"
        )
        row.duplicates, row.lost = e.duplicates, e.lost
        row.violations += e.problems()
        row.operator_visibility = bool(ls.settled and cs.settled and seen["pending"])
    finally:
        await ctx.h.close_lane(lane)
    return row
