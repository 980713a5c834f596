"""Scenario 1: deliver the same partition / shard / settlement / relay job again after it completed.

Each job goes through Temporal again (HarnessRedeliverWorkflow, twice); the database must not change
and every re-delivered job must report what the first delivery did.
"""

from __future__ import annotations

import functools
import operator
from datetime import datetime, timedelta

import asyncpg
from temporalio.client import Client

from cleanup.inputs import StartCleanup
from cleanup.models import (
    ClaimChunkedInput,
    ClaimResult,
    CleanupPartitionInput,
    CleanupResult,
    PartitionReport,
    SettleCleanupInput,
)
from cleanup.operations import cleanup_status, start_cleanup
from harness.checks import (
    cleanup_effects,
    inject_duplicate,
    inject_ordering_violation,
    ledger_digest,
    ledger_effects,
    outbox_effects,
)
from harness.common import MATCHES, RELAY, Ctx, Row, redeliver, seed_cohort, seed_day, seed_events
from ledger.models import ReconcileShardInput, SettleLedgerInput, ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow


async def claim_again(client: Client, pool: asyncpg.Pool, tq: str, cleanup_id: str, deadline: datetime) -> ClaimResult:
    """Deliver the cleanup's claim again, stream by stream as the workflow claimed (the production
    claim: `claim_cleanup_in_chunks`); the streams' results add up to the claim."""
    rows = await pool.fetch(
        "SELECT claimed_per_partition FROM cleanup_claim_progress WHERE cleanup_id = $1 OR cleanup_id LIKE $2",
        cleanup_id,
        f"{cleanup_id}#claim-%",
    )
    partitions, streams = len(rows[0]["claimed_per_partition"]), len(rows)
    claims = []
    for stream in range(streams):
        arg = ClaimChunkedInput(
            cleanup_id=cleanup_id,
            deadline_from=deadline,
            deadline_until=deadline + timedelta(microseconds=1),
            partitions=partitions,
            stream=stream,
            streams=streams,
        )
        _, again = await redeliver(client, tq, "claim_cleanup_in_chunks", arg)
        claims.append(ClaimResult.model_validate(again[0]))
    return functools.reduce(operator.add, claims)


async def run(ctx: Ctx) -> Row:
    row = Row("1 replay")
    lane = await ctx.h.lane("replay", 1)
    rng = ctx.rng("replay")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    try:
        for _ in range(ctx.profile.rounds):
            # -- cleanup: claim, every partition and the settlement again --------------------------
            n, partitions = rng.randint(40, 120) * ctx.profile.scale, 3
            prefix, deadline = ctx.ids.prefix("rp"), ctx.ids.past_deadline()
            await seed_cohort(pool, prefix, deadline, n)
            started = await start_cleanup(
                client, pool, tq, StartCleanup(deadline=deadline, partitions=partitions, batch_size=25)
            )
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
            first: CleanupResult = await handle.result()
            wf = started.workflow_id
            claim = await claim_again(client, pool, tq, wf, deadline)
            reports: list[PartitionReport] = []
            for p in range(partitions):
                _, runs = await redeliver(
                    client, tq, "cleanup_partition", CleanupPartitionInput(cleanup_id=wf, partition_no=p, batch_size=25)
                )
                again = [PartitionReport.model_validate(r) for r in runs]
                reports.append(again[0])
                if any(r.counts.cleaned for r in again):
                    row.violations.append(f"partition {p} delivered again cleaned {[r.counts.cleaned for r in again]}")
                if any(r.counts.already_applied != claim.claimed_per_partition[p] for r in again):
                    row.violations.append(f"partition {p} delivered again did not report everything already applied")
            settle = SettleCleanupInput(
                cleanup_id=wf, deadline=deadline, partitions=partitions, claim=claim, reports=reports
            )
            _, settlements = await redeliver(client, tq, "settle_cleanup", settle)
            assert first.settlement is not None
            if any(s != first.settlement.model_dump(mode="json") for s in settlements):
                row.violations.append("settlement delivered again differs from the first one")
            if ctx.inject_violation:
                account = await inject_duplicate(pool, prefix)
                row.notes.append(f"--inject-violation: wrote a second reminder for {account}")
            effects = await cleanup_effects(
                pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf]
            )
            status = await cleanup_status(client, pool, wf)
            cleaned = status.settlement.cleaned if status.settlement else None
            status_ok = bool(status.settled) and cleaned == n
            row.evidence.append(
                f"cleanup {wf}: every partition delivered twice more; each re-delivery reported "
                f"already_applied={claim.claimed_per_partition} cleaned=0; status: {status.partitions_reported} "
                f"reported, settled={status.settled}, cleaned={cleaned}"
            )

            # -- ledger: every shard and the settlement again -----------------------------------------
            d = ctx.ids.business_date()
            seeded = await seed_day(pool, d, rng.randint(300, 600) * ctx.profile.scale, 3)
            await start_reconciliation(
                client, pool, tq, ReconcileRequest(business_date=d, batch_size=100, heartbeat_timeout_seconds=5)
            )
            await client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(d)).result()
            before = await ledger_digest(pool)
            lwf = ledger_workflow_id(d)
            for shard in range(3):
                arg2 = ReconcileShardInput(business_date=d, shard=shard, shards=3, batch_size=70, workflow_id=lwf)
                await redeliver(client, tq, "reconcile_shard", arg2)
            await redeliver(
                client, tq, "settle_ledger_date", SettleLedgerInput(business_date=d, shards=3, workflow_id=lwf)
            )
            if await ledger_digest(pool) != before:
                row.violations.append(f"ledger {d}: re-delivered shards or settlement changed the database")
            if ctx.inject_ordering_violation:
                revision = await inject_ordering_violation(pool, d)
                row.notes.append(f"--inject-ordering-violation: wrote revision {revision} of {d} stamped too early")
            effects = effects + await ledger_effects(
                pool,
                d,
                shards=3,
                expected_corrections=seeded.expected_corrections,
                expected_review=seeded.expected_review,
            )
            lstatus = await ledger_status(client, pool, d)
            status_ok = status_ok and bool(lstatus.settled) and lstatus.corrections == seeded.expected_corrections
            row.evidence.append(f"ledger {d}: every shard + settlement delivered twice more: digest unchanged")

            # -- outbox relay: drain, then the relay job again ---------------------------------------
            rprefix = ctx.ids.prefix("rr")
            await seed_events(pool, rprefix, 20)
            relay_prefix = f"harness-relay-{rprefix}-"
            await start_relays(
                client,
                tq,
                relays=1,
                settings=RELAY,
                idle_sleep_seconds=0.5,
                stop_when_drained=True,
                id_prefix=relay_prefix,
            )
            await client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{relay_prefix}1").result()
            received = ctx.h.provider.provider.stats()["received"]
            from outbox.models import RelayBatchInput

            _, again_relay = await redeliver(
                client, tq, "relay_outbox_batch", RelayBatchInput(relay_id=f"{relay_prefix}1", settings=RELAY)
            )
            if any(r["claimed"] for r in again_relay) or ctx.h.provider.provider.stats()["received"] != received:
                row.violations.append("the relay job delivered again sent something")
            effects = effects + await outbox_effects(pool, ctx.h.provider.provider)
            ostatus = await outbox_status(pool, client)
            status_ok = status_ok and ostatus.pending == 0
            row.evidence.append(f"relay {relay_prefix}1 delivered twice more: claimed 0, provider saw no request")
            row.runs += 3
            row.duplicates += effects.duplicates
            row.lost += effects.lost
            row.dead_letters += effects.dead_letters
            row.violations += effects.problems()
            row.operator_visibility = bool(status_ok)
    finally:
        await ctx.h.close_lane(lane)
    return row
