"""Scenario 8: terminate the workers' Postgres connections mid-run; everything recovers."""

from __future__ import annotations

import asyncio
from datetime import date

import asyncpg

from cleanup.operations import cleanup_status, start_cleanup
from harness.checks import cleanup_effects, ledger_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, seed_cohort, seed_day, seed_events, wait_for
from harness.stack import HARNESS_APP
from harness.visibility import temporal_evidence
from ledger.models import ledger_workflow_id
from ledger.operations import ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

TERMINATE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND application_name IS DISTINCT FROM $1"
)


async def run(ctx: Ctx) -> Row:
    row = Row("8 database faults")
    lane = await ctx.h.lane("dbfault", 2)
    rng = ctx.rng("db-faults")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    try:
        for _ in range(ctx.profile.rounds):
            n = rng.randint(600, 1000) * ctx.profile.scale
            prefix, deadline = ctx.ids.prefix("db"), ctx.ids.past_deadline()
            await seed_cohort(pool, prefix, deadline, n)
            d = ctx.ids.business_date()
            seeded = await seed_day(pool, d, rng.randint(1500, 2500) * ctx.profile.scale, 4)
            await seed_events(pool, ctx.ids.prefix("dbe"), 100)
            cleanup = await start_cleanup(
                client, pool, tq, deadline=deadline, partitions=4, batch_size=20, heartbeat_timeout_seconds=5
            )
            await start_reconciliation(client, pool, tq, d, batch_size=50, heartbeat_timeout_seconds=5)
            relay_prefix = f"harness-relay-{prefix}-"
            await start_relays(
                client,
                tq,
                relays=1,
                settings=RELAY,
                idle_sleep_seconds=0.5,
                stop_when_drained=True,
                id_prefix=relay_prefix,
            )
            admin = await asyncpg.connect(lane.database_url, server_settings={"application_name": HARNESS_APP})
            terminated = []
            try:
                # Mid-run: once the cleanup and the ledger are both writing, then every few hundred ms.
                async def busy(cleanup_id: str = cleanup.workflow_id, day: date = d) -> bool:
                    applied = await pool.fetchval(
                        "SELECT count(*) FROM cleanup_applied WHERE cleanup_id = $1", cleanup_id
                    )
                    corrected = await pool.fetchval(
                        "SELECT count(*) FROM ledger_corrections WHERE business_date = $1", day
                    )
                    return bool(applied and corrected)

                await wait_for(busy, 30, 0.05)
                for _ in range(3 + ctx.profile.rounds):
                    terminated.append(int(await admin.fetchval(TERMINATE, HARNESS_APP)))
                    await asyncio.sleep(rng.uniform(0.2, 0.6))
            finally:
                await admin.close()
            t_fault = asyncio.get_running_loop().time()
            await asyncio.wait_for(
                asyncio.gather(
                    client.get_workflow_handle_for(RenewalCleanupWorkflow.run, cleanup.workflow_id).result(),
                    client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(d)).result(),
                    client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{relay_prefix}1").result(),
                ),
                240,
            )
            row.recovered(asyncio.get_running_loop().time() - t_fault)
            # Reminders written by the cleanup after the relay drained: drain them too.
            await start_relays(
                client,
                tq,
                relays=1,
                settings=RELAY,
                idle_sleep_seconds=0.5,
                stop_when_drained=True,
                id_prefix=relay_prefix + "x",
            )
            await client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{relay_prefix}x1").result()
            effects = await cleanup_effects(
                pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[cleanup.workflow_id]
            )
            effects = effects + await ledger_effects(
                pool,
                d,
                shards=4,
                expected_corrections=seeded.expected_corrections,
                expected_review=seeded.expected_review,
            )
            effects = effects + await outbox_effects(pool, ctx.h.provider.provider)
            row.runs += 1
            row.duplicates += effects.duplicates
            row.lost += effects.lost
            row.dead_letters += effects.dead_letters
            row.violations += effects.problems()
            evidence: list[str] = []
            for wf in (cleanup.workflow_id, ledger_workflow_id(d), f"{relay_prefix}1"):
                evidence += await temporal_evidence(client, wf)
            cs = await cleanup_status(client, pool, cleanup.workflow_id)
            ls = await ledger_status(client, pool, d)
            os_ = await outbox_status(pool, client)
            ok = bool(cs["settled"] and ls["settled"] and os_.pending == 0)
            row.operator_visibility = (
                bool(evidence) and ok if row.runs == 1 else row.operator_visibility and bool(evidence) and ok
            )
            row.notes.append(f"terminated {terminated} worker connections")
            if not evidence:
                row.violations.append(
                    "terminated connections left no trace in Temporal (no retried or failed activity)"
                )
            row.evidence += evidence[:3]
    finally:
        await ctx.h.close_lane(lane)
    return row
