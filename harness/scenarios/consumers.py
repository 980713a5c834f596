"""Scenario 5: three worker processes on the ordinary nightly run and a cohort cleanup (and the relay)."""

from __future__ import annotations

import asyncio
import time

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from harness.checks import cleanup_effects, ledger_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, seed_cohort, seed_day, wait_while_progressing
from ledger.models import ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow


async def identities(ctx: Ctx, workflow_id: str) -> set[str]:
    history = await ctx.client.get_workflow_handle(workflow_id).fetch_history()
    return {
        e.activity_task_started_event_attributes.identity
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    }


async def run(ctx: Ctx) -> Row:
    row = Row("5 several consumers")
    lane = await ctx.h.lane("consumers", 3)
    rng = ctx.rng("consumers")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    try:
        n = rng.randint(500, 800) * ctx.profile.scale
        prefix, deadline = ctx.ids.prefix("c"), ctx.ids.future_deadline(2)
        await seed_cohort(pool, prefix, deadline, n)
        d = ctx.ids.business_date()
        seeded = await seed_day(pool, d, rng.randint(2000, 3000) * ctx.profile.scale, 8)
        t0 = time.monotonic()
        cleanup = await start_cleanup(client, pool, tq, StartCleanup(deadline=deadline, partitions=6, batch_size=50))
        await start_reconciliation(
            client, pool, tq, ReconcileRequest(business_date=d, batch_size=100, heartbeat_timeout_seconds=5)
        )
        relay_prefix = f"harness-relay-{prefix}-"
        settings = RELAY.model_copy(update={"batch_size": 50, "concurrency": 8})
        await start_relays(
            client,
            tq,
            relays=2,
            settings=settings,
            idle_sleep_seconds=0.5,
            stop_when_drained=False,
            id_prefix=relay_prefix,
        )
        await asyncio.gather(
            client.get_workflow_handle_for(RenewalCleanupWorkflow.run, cleanup.workflow_id).result(),
            client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(d)).result(),
        )

        async def drained() -> bool:
            s = await outbox_status(pool)
            return s.pending == 0 and s.delivered >= n

        async def delivered() -> int:
            return (await outbox_status(pool)).delivered

        if not await wait_while_progressing(drained, delivered, 120):
            row.violations.append("the relays stopped delivering (nothing delivered for 120 s) before draining")
        for i in (1, 2):
            await client.get_workflow_handle(f"{relay_prefix}{i}").signal(OutboxRelayWorkflow.stop)
            await client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{relay_prefix}{i}").result()
        row.notes.append(
            f"nightly run + cleanup of {n} accounts + reminders delivered in {time.monotonic() - t0:.1f} s"
        )
        effects = await cleanup_effects(
            pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[cleanup.workflow_id]
        )
        effects = effects + await ledger_effects(
            pool, d, shards=8, expected_corrections=seeded.expected_corrections, expected_review=seeded.expected_review
        )
        effects = effects + await outbox_effects(pool, ctx.h.provider.provider)
        row.runs = 3
        row.duplicates, row.lost, row.dead_letters = effects.duplicates, effects.lost, effects.dead_letters
        row.violations += effects.problems()
        workers = set()
        for wf in (cleanup.workflow_id, ledger_workflow_id(d), f"{relay_prefix}1", f"{relay_prefix}2"):
            workers |= await identities(ctx, wf)
        if len(workers) < 2:
            row.violations.append(f"the work was not shared: activities ran on {sorted(workers)}")
        cs = await cleanup_status(client, pool, cleanup.workflow_id)
        ls = await ledger_status(client, pool, d)
        row.operator_visibility = bool(cs.settled and ls.settled and ls.shards_done == "8/8")
        row.evidence.append(f"activities ran on {len(workers)} worker processes: {', '.join(sorted(workers))}")
        row.evidence.append(
            f"status: cleanup {cs.partitions_reported} settled={cs.settled}; ledger {ls.shards_done} "
            f"settled={ls.settled}"
        )
    finally:
        await ctx.h.close_lane(lane)
    return row
