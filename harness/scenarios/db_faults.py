"""Scenario 8: terminate the workers' Postgres connections mid-run; everything recovers."""

from __future__ import annotations

import asyncio
from datetime import date
from pathlib import Path

import asyncpg

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from core import db
from harness.checks import cleanup_effects, ledger_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, seed_cohort, seed_day, seed_events, wait_for
from harness.stack import HARNESS_APP, Slot
from harness.visibility import temporal_evidence
from ledger.models import ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

TERMINATE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND application_name IS DISTINCT FROM $1"
)

# Every worker connection is terminated (idle pool connections too: the pools must reconnect), and
# the ones an activity was using at that moment are counted: only those can be noticed. In flight:
# a statement running, or a transaction open between two statements (its COMMIT will fail). Not in
# flight: the pool's reset on release and the outage probe (`SELECT 1`), which no activity waits on.
# The snapshot is taken before the signals: a statement may still complete in between, so evidence
# is demanded over a whole run's terminations, never for one.
TERMINATE_WORKERS = """
SELECT count(pg_terminate_backend(pid))::int AS terminated,
       count(*) FILTER (
           WHERE state IN ('active', 'idle in transaction', 'idle in transaction (aborted)')
             AND query <> 'SELECT 1' AND query NOT LIKE 'SELECT pg_advisory_unlock_all();%'
       )::int AS in_flight
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
  AND application_name IS DISTINCT FROM $1
"""

# What a worker writes when one of its activities loses its connection (core.outage, the relay):
# the operator's trace of a fault that the activity absorbed by running again within its attempt.
OUTAGE_LINES = ("database unavailable at", "database back after", "database connection lost")


def log_sizes(slots: list[Slot]) -> dict[Path, int]:
    return {s.log_path: s.log_path.stat().st_size if s.log_path.exists() else 0 for s in slots}


def outage_lines(since: dict[Path, int]) -> list[str]:
    """The workers' outage lines written after `since` (each log's size before the faults)."""
    found: list[str] = []
    for path, offset in since.items():
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        found += [
            f"{path.stem}: {line.strip()[:200]}" for line in text.splitlines() if any(m in line for m in OUTAGE_LINES)
        ]
    return found


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
                client,
                pool,
                tq,
                StartCleanup(deadline=deadline, partitions=4, batch_size=20, heartbeat_timeout_seconds=5),
            )
            await start_reconciliation(
                client, pool, tq, ReconcileRequest(business_date=d, batch_size=50, heartbeat_timeout_seconds=5)
            )
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
            admin = await asyncpg.connect(
                lane.database_url, server_settings={"application_name": HARNESS_APP, **db.service_settings()}
            )
            terminated: list[int] = []
            in_flight: list[int] = []
            logs_before = log_sizes(lane.slots)
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
                    killed = await admin.fetchrow(TERMINATE_WORKERS, HARNESS_APP)
                    terminated.append(killed["terminated"])
                    in_flight.append(killed["in_flight"])
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
            evidence += outage_lines(logs_before)
            cs = await cleanup_status(client, pool, cleanup.workflow_id)
            ls = await ledger_status(client, pool, d)
            os_ = await outbox_status(pool, client)
            ok = bool(cs.settled and ls.settled and os_.pending == 0)
            # A fault no activity was in the middle of leaves nothing to see, and that is right.
            visible = bool(evidence) or sum(in_flight) == 0
            row.operator_visibility = visible and ok if row.runs == 1 else row.operator_visibility and visible and ok
            row.notes.append(
                f"terminated {terminated} worker connections, of which {in_flight} in the middle of an activity"
            )
            if not visible:
                row.violations.append(
                    f"{sum(in_flight)} connections terminated in the middle of an activity left no trace "
                    "(no retried or failed activity in Temporal, no outage line in the workers' logs)"
                )
            if not ok:
                row.violations.append(
                    f"not settled after the faults: cleanup {cs.settled}, "
                    f"ledger {ls.settled}, outbox pending {os_.pending}"
                )
            row.evidence += evidence[:3]
    finally:
        await ctx.h.close_lane(lane)
    return row
