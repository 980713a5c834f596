"""Scenario 6: renewals land at random points around the deadline.

Before the claim (in time: renewed, no cleanup, no reminder), between claim and settlement (too
late: the cleanup stands, the renewal is recorded as too_late), after settlement (too late too).
To make "between claim and settlement" a window the harness can hit, it holds a row lock on one
claimed account for a moment, so one partition (and hence the settlement) waits.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, renew, start_cleanup
from core import db
from harness.checks import cleanup_effects
from harness.common import MATCHES, Ctx, Row, account_ids, seed_cohort, wait_for
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# Seconds from seeding to the deadline: time to seed, start the cleanup and renew before it.
LEAD_SECONDS = 6


async def run(ctx: Ctx) -> Row:
    row = Row("6 renewal race")
    lane = await ctx.h.lane("race", 1)
    rng = ctx.rng("renewal-race")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    try:
        for _ in range(ctx.profile.rounds):
            n = rng.randint(60, 120) * ctx.profile.scale
            prefix, deadline = ctx.ids.prefix("rc"), ctx.ids.future_deadline(LEAD_SECONDS)
            await seed_cohort(pool, prefix, deadline, n)
            ids = await account_ids(pool, prefix)
            rng.shuffle(ids)
            k = max(3, n // 10)
            before, between, after = ids[:k], ids[k : 2 * k], ids[2 * k : 3 * k]
            blocked = ids[-1]
            started = await start_cleanup(
                client,
                pool,
                tq,
                StartCleanup(deadline=deadline, partitions=3, batch_size=10, heartbeat_timeout_seconds=10),
            )
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
            # Before the claim: spread over the time left until the deadline.
            left = (deadline - datetime.now(UTC)).total_seconds() - 1.0
            delays = sorted(rng.uniform(0, max(0.0, left)) for _ in before)
            t0 = asyncio.get_running_loop().time()
            in_time: list[bool] = []  # renewals answered before the deadline: each must be in time
            renewed: list[str] = []  # every renewal judged in time (one answered late may be either)
            for account, delay in zip(before, delays, strict=True):
                await asyncio.sleep(max(0.0, t0 + delay - asyncio.get_running_loop().time()))
                outcome = await renew(client, pool, tq, account)
                if datetime.now(UTC) < deadline:
                    in_time.append(outcome.in_time)
                if outcome.in_time:
                    renewed.append(account)
            if len(in_time) < len(before):
                row.notes.append(
                    f"{len(before) - len(in_time)} renewals meant for before the deadline were answered after "
                    "it (a slow machine): judged either way, checked against their own answer"
                )
            k = len(renewed)
            # Hold one claimed account so its partition, and the settlement, wait.
            blocker = await asyncpg.connect(lane.database_url, server_settings=db.service_settings())
            tx = blocker.transaction()
            await tx.start()
            # Its cloud save, not its account row: the claim (an UPDATE of every account) must not wait.
            await blocker.execute("SELECT 1 FROM demo_game.cloud_saves WHERE account_id = $1 FOR UPDATE", blocked)

            async def claimed(cleanup_id: str = started.workflow_id, expected: int = n - k) -> bool:
                # Every account not renewed in time is claimed (by every claim stream of the cohort).
                return bool(
                    await pool.fetchval("SELECT count(*) FROM cleanup_claims WHERE cleanup_id = $1", cleanup_id)
                    >= expected
                )

            await wait_for(claimed, 120, 0.05)
            # Renewals of accounts in the held batch wait for it, so they run while the lock is held.
            between_task = asyncio.gather(*(renew(client, pool, tq, a) for a in between))
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            during = await cleanup_status(client, pool, started.workflow_id)
            settled_early = await pool.fetchval(
                "SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = $1", started.workflow_id
            )
            await tx.rollback()
            await blocker.close()
            late_between = await between_task
            await handle.result()
            late_after = [await renew(client, pool, tq, a) for a in after]

            if not all(in_time):
                row.violations.append(f"{in_time.count(False)} renewals before the deadline were refused")
            if settled_early:
                row.violations.append("settlement was written while a partition was held")
            wrong = [o.account_id for o in [*late_between, *late_after] if o.in_time]
            if wrong:
                row.violations.append(f"renewals after the claim were accepted: {wrong[:3]}")
            recorded = await pool.fetch(
                "SELECT account_id, outcome FROM renewals WHERE account_id = ANY($1::text[])", between + after
            )
            too_late = {r["account_id"] for r in recorded if r["outcome"] == "too_late"}
            row.lost += len(set(between + after) - too_late)  # a late renewal that was not recorded is lost
            reminded = await pool.fetchval("SELECT count(*) FROM outbox WHERE account_id = ANY($1::text[])", renewed)
            row.duplicates += int(reminded)
            effects = await cleanup_effects(
                pool, prefix, matches_per_account=MATCHES, expect_cleaned=n - k, cleanup_ids=[started.workflow_id]
            )
            states = dict(
                await pool.fetch(
                    "SELECT status, count(*) FROM accounts WHERE account_id LIKE $1 GROUP BY 1", f"acct_{prefix}_%"
                )
            )
            if states != {"renewed": k, "cleaned": n - k}:
                row.violations.append(f"terminal states {states}, expected renewed={k}, cleaned={n - k}")
            row.runs += 1
            row.duplicates += effects.duplicates
            row.lost += effects.lost
            row.violations += effects.problems()
            status = await cleanup_status(client, pool, started.workflow_id)
            skipped_renewed = status.settlement.skipped_renewed if status.settlement else None
            row.operator_visibility = bool(
                skipped_renewed == k
                and all(not o.in_time and o.status_seen in ("cleaning", "cleaned") for o in late_between)
            )
            row.evidence.append(
                f"{k} renewed before the claim (settlement skipped_renewed={skipped_renewed}), "
                f"{len(between)} between claim and settlement and {len(after)} after: reported too late "
                f"(CLI exit 3), recorded as renewals.outcome='too_late': {len(too_late)}; "
                f"status while held: phase={during.phase}, {during.partitions_reported} reported"
            )
    finally:
        await ctx.h.close_lane(lane)
    return row
