"""Scenario 7: pause the nightly schedule across trigger times, unpause, backfill: each date once.

Trigger times are nights, so they are not waited for: the schedule is paused, an operator
reconciles one of the missed dates by hand meanwhile, then unpauses and backfills the missed
nights; a second backfill of the same nights must take none of them again (each already ran, and
the backfill lists it as such) and reconcile nothing again.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from temporalio.client import Client

from harness.checks import ledger_digest, ledger_effects
from harness.common import Ctx, Row, seed_day, wait_for
from ledger import schedule as ls
from ledger.models import ScheduledLedgerInput, ScheduledLedgerResult, ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow


async def _runs(client: Client, schedule_id: str, count: int) -> list[ScheduledLedgerResult]:
    """The results of the schedule's first `count` actions, oldest first.

    Counted with `num_actions` and found by the `TemporalScheduledById` search attribute: a schedule's
    describe lists only its 10 most recent actions, fewer than a full-profile backfill takes.
    """

    async def taken() -> bool:
        return (await ls.describe_schedule(client, schedule_id)).actions_taken >= count

    if not await wait_for(taken, 120, 0.3):
        raise TimeoutError(f"schedule {schedule_id} did not take {count} actions")
    runs: list[Any] = []

    async def listed() -> bool:
        runs[:] = [wf async for wf in client.list_workflows(f"TemporalScheduledById = '{schedule_id}'")]
        return len(runs) >= count

    if not await wait_for(listed, 120, 0.3):  # visibility lags on a loaded machine
        raise TimeoutError(f"only {len(runs)} of {count} runs of schedule {schedule_id} are visible")
    runs.sort(key=lambda wf: wf.start_time)
    results = []
    for wf in runs[:count]:
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id, result_type=ScheduledLedgerResult)
        results.append(await asyncio.wait_for(handle.result(), 120))
    return results


async def executions(client: Client, workflow_id: str) -> int:
    return len([wf async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'")])


async def run(ctx: Ctx) -> Row:
    row = Row("7 paused schedule")
    lane = await ctx.h.lane("schedule", 1)
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    days = 3 * ctx.profile.rounds
    dates = [ctx.ids.business_date() for _ in range(days)]
    seeded = {d: await seed_day(pool, d, 300, 2) for d in dates}
    schedule_id = f"harness-nightly-{uuid.uuid4().hex[:6]}"
    manual = dates[len(dates) // 2]
    try:
        await ls.create_schedule(
            client, tq, options=ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0), schedule_id=schedule_id
        )
        paused = await ls.pause_schedule(client, "harness: maintenance window", schedule_id)
        await start_reconciliation(
            client, pool, tq, ReconcileRequest(business_date=manual, heartbeat_timeout_seconds=2.0)
        )
        await client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(manual)).result()
        await ls.unpause_schedule(client, "", schedule_id)
        await ls.backfill_schedule(client, dates[0], dates[-1], schedule_id)
        first = await _runs(client, schedule_id, days)
        before = await ledger_digest(pool)
        again = await ls.backfill_schedule(client, dates[0], dates[-1], schedule_id)
        outcomes = sorted((r.business_date, r.outcome) for r in first)
        expected = sorted((d, "already_started" if d == manual else "reconciled") for d in dates)
        if outcomes != expected:
            row.violations.append(f"first backfill outcomes {outcomes}, expected {expected}")
        if again.backfilled_dates or again.actions_taken != days:
            row.violations.append(f"the second backfill took {again.backfilled_dates} again")
        if sorted(n.business_date for n in again.already_ran or []) != sorted(dates):
            row.violations.append(f"the second backfill listed {again.already_ran} as already run")
        if await ledger_digest(pool) != before:
            row.violations.append("the second backfill changed the database")
        for d in dates:
            n = await executions(client, ledger_workflow_id(d))
            if n != 1:
                row.duplicates += max(0, n - 1)
                row.lost += 1 if n == 0 else 0
                row.violations.append(f"{d}: {n} reconciliation runs")
            e = await ledger_effects(
                pool,
                d,
                shards=2,
                expected_corrections=seeded[d].expected_corrections,
                expected_review=seeded[d].expected_review,
            )
            row.duplicates += e.duplicates
            row.lost += e.lost
            row.violations += [f"{d}: {p}" for p in e.problems()]
        row.runs = days
        status = [await ledger_status(client, pool, d) for d in dates]
        row.operator_visibility = bool(paused.paused and paused.note and all(s.settled for s in status))
        row.evidence.append(f"schedule describe while paused: paused={paused.paused}, note={paused.note!r}")
        row.evidence.append(f"backfill outcomes: {[(str(d), o) for d, o in outcomes]}; second backfill took none again")
    finally:
        await ls.delete_schedule(client, schedule_id)
        await ctx.h.close_lane(lane)
    return row
