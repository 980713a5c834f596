"""Scenario 9: restart the Temporal dev server while cleanups sleep; each timer fires once.

Runs on a dev server of its own (the other scenarios keep theirs), with supervised workers: a
worker that gives up while the server is down is restarted by the supervisor.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from temporalio.api.enums.v1 import EventType

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from core.config import Settings
from core.temporal import connect
from devstack.embedded import DevServer
from harness.checks import cleanup_effects
from harness.common import MATCHES, Ctx, Row, seed_cohort
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# Seconds from seeding to the first deadline: time to seed, start and stop the server before it.
LEAD_SECONDS = 8


async def run(ctx: Ctx) -> Row:
    row = Row("9 server restart")
    rng = ctx.rng("server-restart")
    with tempfile.TemporaryDirectory(prefix="harness-restart-") as tmp:
        server = DevServer(Path(tmp), port=None)
        await asyncio.to_thread(server.start)
        lane = await ctx.h.lane("restart", 2, address=server.address)
        try:
            client = await connect(Settings(temporal_address=server.address))
            cohorts = []
            for i in range(2 * ctx.profile.rounds):
                n = rng.randint(30, 80) * ctx.profile.scale
                prefix, deadline = ctx.ids.prefix("sr"), ctx.ids.future_deadline(LEAD_SECONDS + 2 * i)
                await seed_cohort(lane.pool, prefix, deadline, n)
                started = await start_cleanup(
                    client, lane.pool, lane.task_queue, StartCleanup(deadline=deadline, partitions=2)
                )
                cohorts.append((prefix, deadline, n, started.workflow_id))
            first = min(d for _, d, _, _ in cohorts)
            for *_, wf in cohorts:
                status = await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, wf).query(
                    RenewalCleanupWorkflow.status
                )
                if status.phase != "sleeping" and datetime.now(UTC) < first:
                    row.violations.append(f"{wf} was not sleeping before the restart")
            await asyncio.to_thread(server.stop)
            down_at = asyncio.get_running_loop().time()
            # The premise of the next check: the server was down before any deadline (a loaded
            # machine may take longer than LEAD_SECONDS to seed, start and stop; then it proves nothing).
            down_before_deadlines = datetime.now(UTC) < first
            last = max(d for _, d, _, _ in cohorts)
            await asyncio.sleep(max(0.0, (last - datetime.now(UTC)).total_seconds()) + 2)
            early = await lane.pool.fetchval("SELECT count(*) FROM cleanup_applied")
            if early and down_before_deadlines:
                row.violations.append(f"{early} accounts cleaned while the server was down")
            if not down_before_deadlines:
                row.notes.append("the server went down after the first deadline (a slow machine): not checked")
            await asyncio.to_thread(server.start)
            row.notes.append(
                f"server down for {asyncio.get_running_loop().time() - down_at:.1f} s, past every deadline"
            )
            client = await connect(Settings(temporal_address=server.address))
            t_up = asyncio.get_running_loop().time()
            for prefix, deadline, n, wf in cohorts:
                handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, wf)
                await asyncio.wait_for(handle.result(), 120)
                row.recovered(asyncio.get_running_loop().time() - t_up)
                events = (await handle.fetch_history()).events
                fired = [e for e in events if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED]
                if len(fired) != 1:
                    row.violations.append(f"{wf}: {len(fired)} timers fired")
                    row.duplicates += max(0, len(fired) - 1)
                    row.lost += 1 if not fired else 0
                effects = await cleanup_effects(
                    lane.pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf]
                )
                row.duplicates += effects.duplicates
                row.lost += effects.lost
                row.violations += effects.problems()
                row.runs += 1
                shown = await cleanup_status(client, lane.pool, wf)
                late = (fired[0].event_time.ToDatetime().replace(tzinfo=UTC) - deadline).total_seconds() if fired else 0
                row.evidence.append(
                    f"{wf}: one TimerFired, {late:.1f} s after the deadline (the server was down); "
                    f"status phase={shown.phase} settled={shown.settled}"
                )
                row.operator_visibility = (
                    bool(shown.settled) if row.runs == 1 else (row.operator_visibility and bool(shown.settled))
                )
            deaths = [d for s in lane.slots for d in s.deaths]
            row.notes.append(f"worker deaths while the server was down (restarted by the supervisor): {len(deaths)}")
        finally:
            await ctx.h.close_lane(lane)
            await asyncio.to_thread(server.stop)
    return row
