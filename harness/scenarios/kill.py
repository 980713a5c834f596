"""Scenario 2: kill a worker right after a COMMIT, before the activity returns, at every commit point.

A run: arm one supervised worker with `CLEANUP_FAILPOINTS=<point>=exit@N` (N drawn from the seed),
start a small workload on its lane, wait for the process to die (os._exit right after COMMIT), let
the supervisor restart it, wait for the workload to finish, then count effects in the database.
Lanes (own task queue, database and worker) run side by side; runs within a lane are sequential.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cleanup.operations import cleanup_status, start_cleanup
from harness.checks import Effects, cleanup_effects, ledger_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, redeliver, seed_cohort, seed_day, seed_events
from harness.stack import Lane
from harness.visibility import best_effort, temporal_evidence
from ledger.models import ReconcileShardInput, SettleLedgerInput
from ledger.operations import ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# Ordered so that the recovery of one run never passes the next run's failpoint.
POINTS = [
    "cleanup_partition.after_commit",
    "reconcile_shard.after_commit",
    "relay_outbox_batch.after_send",
    "claim_cleanup_in_chunks.after_commit",
    "settle_ledger_date.after_commit",
    "relay_outbox_batch.after_commit",
    "settle_cleanup.after_commit",
]
# settle_ledger_date has a 10-minute start-to-close and no heartbeat in LedgerReconciliationWorkflow,
# so a kill there is only retried after 10 minutes; the harness drives that step itself with 5 s.
SETTLE_LEDGER_TIMEOUT = 5.0


@dataclass
class Prepared:
    hits: int  # how many times the failpoint will be hit by this workload (N is drawn from 1..hits)
    run: Callable[[], Awaitable[Any]]  # start the workload and wait for its end
    check: Callable[[], Awaitable[Effects]]
    status: Callable[[], Awaitable[dict[str, Any]]]
    status_ok: Callable[[dict[str, Any]], bool]
    workflow_ids: list[str] = field(default_factory=list)


async def _cleanup(ctx: Ctx, lane: Lane, point: str, rng: random.Random) -> Prepared:
    n = rng.randint(25, 60) * ctx.profile.scale
    prefix, deadline = ctx.ids.prefix("k"), ctx.ids.past_deadline()
    await seed_cohort(lane.pool, prefix, deadline, n)
    batch = 10 * ctx.profile.scale
    per_partition = [math.ceil(n / 2), n // 2]
    hits = sum(math.ceil(c / batch) for c in per_partition) if point.startswith("cleanup_partition") else 1
    from cleanup.models import cohort_cleanup_id

    wf = cohort_cleanup_id(deadline)

    async def run() -> Any:
        started = await start_cleanup(
            ctx.client,
            lane.pool,
            lane.task_queue,
            deadline=deadline,
            partitions=2,
            max_parallel_partitions=2,
            batch_size=batch,
            heartbeat_timeout_seconds=2,
            step_timeout_seconds=5,
        )
        return await ctx.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()

    def ok(s: dict[str, Any]) -> bool:
        return bool(s.get("settled")) and s.get("settlement", {}).get("cleaned") == n

    return Prepared(
        hits,
        run,
        lambda: cleanup_effects(lane.pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf]),
        lambda: cleanup_status(ctx.client, lane.pool, wf),
        ok,
        [wf],
    )


async def _ledger(ctx: Ctx, lane: Lane, point: str, rng: random.Random) -> Prepared:
    d = ctx.ids.business_date()
    payments = rng.randint(150, 300) * ctx.profile.scale
    batch = 50 * ctx.profile.scale
    seeded = await seed_day(lane.pool, d, payments, 2)
    from ledger.models import ledger_workflow_id

    wf = ledger_workflow_id(d)
    ids = [wf]

    async def run_workflow() -> Any:
        await start_reconciliation(
            ctx.client, lane.pool, lane.task_queue, d, batch_size=batch, heartbeat_timeout_seconds=2.0
        )
        return await ctx.client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, wf).result()

    async def run_driven() -> Any:
        # Shards through Temporal (one delivery each), then the settlement with a short timeout.
        for shard in range(2):
            arg = ReconcileShardInput(business_date=d, shard=shard, shards=2, batch_size=batch, workflow_id=wf)
            await redeliver(ctx.client, lane.task_queue, "reconcile_shard", arg, times=1)
        settle_id, _ = await redeliver(
            ctx.client,
            lane.task_queue,
            "settle_ledger_date",
            SettleLedgerInput(business_date=d, shards=2, workflow_id=wf),
            times=1,
            stc=SETTLE_LEDGER_TIMEOUT,
        )
        ids[:] = [settle_id]

    def ok(s: dict[str, Any]) -> bool:
        return bool(s.get("settled")) and s.get("corrections") == seeded.expected_corrections

    driven = point.startswith("settle_ledger")
    return Prepared(
        1 if driven else 4,
        run_driven if driven else run_workflow,
        lambda: ledger_effects(
            lane.pool,
            d,
            shards=2,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        ),
        lambda: ledger_status(ctx.client, lane.pool, d),
        ok,
        ids,
    )


async def _relay(ctx: Ctx, lane: Lane, point: str, rng: random.Random) -> Prepared:
    prefix = ctx.ids.prefix("r")
    await seed_events(lane.pool, prefix, rng.randint(12, 30) * ctx.profile.scale)
    pending = int(await lane.pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'pending'"))
    relay_prefix = f"harness-relay-{prefix}-"
    wf = f"{relay_prefix}1"

    async def run() -> Any:
        await start_relays(
            ctx.client,
            lane.task_queue,
            relays=1,
            settings=RELAY,
            idle_sleep_seconds=0.5,
            stop_when_drained=True,
            id_prefix=relay_prefix,
        )
        return await ctx.client.get_workflow_handle_for(OutboxRelayWorkflow.run, wf).result()

    async def status() -> dict[str, Any]:
        return await outbox_status(lane.pool, ctx.client)

    return Prepared(
        min(3, math.ceil(pending / RELAY.batch_size)),
        run,
        lambda: outbox_effects(lane.pool, ctx.h.provider.provider),
        status,
        lambda s: s.get("pending") == 0 and s.get("dead") == 0,
        [wf],
    )


PREPARE: dict[str, Callable[[Ctx, Lane, str, random.Random], Awaitable[Prepared]]] = {
    "cleanup_partition.after_commit": _cleanup,
    "claim_cleanup_in_chunks.after_commit": _cleanup,
    "settle_cleanup.after_commit": _cleanup,
    "reconcile_shard.after_commit": _ledger,
    "settle_ledger_date.after_commit": _ledger,
    "relay_outbox_batch.after_send": _relay,
    "relay_outbox_batch.after_commit": _relay,
}


@dataclass
class RunResult:
    point: str
    n: int
    killed: bool
    effects: Effects
    recovery: float | None
    evidence: list[str]
    status_during: dict[str, Any]
    status_ok: bool
    violations: list[str]


async def kill_once(ctx: Ctx, lane: Lane, point: str, rng: random.Random) -> RunResult:
    sup, slot = ctx.h.supervisor, lane.slots[0]
    prepared = await PREPARE[point](ctx, lane, point, rng)
    n = rng.randint(1, max(1, prepared.hits))
    await sup.start(slot, f"{point}=exit@{n}")
    before = len(slot.deaths)
    work = asyncio.create_task(asyncio.wait_for(prepared.run(), 300))
    violations: list[str] = []
    death = None
    while death is None and not work.done():
        death = await sup.wait_death(slot, before, within=0.2)
    status_during: dict[str, Any] = {}
    if death is None:
        violations.append(f"{point}=exit@{n}: the failpoint was never hit (workload finished without a kill)")
    else:
        if death.returncode != 86:
            violations.append(f"worker died with exit code {death.returncode}, not 86: {slot.log_tail(500)}")
        status_during = await best_effort(prepared.status(), 3.0)
    try:
        await work
    except Exception as err:
        violations.append(f"{point}: workload did not complete: {type(err).__name__}: {err}")
    recovery = time.monotonic() - death.at if death is not None else None
    effects = await prepared.check()
    evidence: list[str] = []
    for wf in prepared.workflow_ids:
        evidence += await temporal_evidence(ctx.client, wf)
    status_after = await best_effort(prepared.status(), 10.0)
    return RunResult(
        point,
        n,
        death is not None,
        effects,
        recovery,
        evidence,
        status_during,
        prepared.status_ok(status_after),
        violations + [f"{point}=exit@{n}: {p}" for p in effects.problems()],
    )


async def run(ctx: Ctx) -> Row:
    row = Row("2 kill after commit")
    lanes = await asyncio.gather(*(ctx.h.lane(f"kill{j}", 1) for j in range(ctx.profile.kill_lanes)))
    plan = [POINTS[i % len(POINTS)] for i in range(ctx.profile.kill_runs)]
    results: list[RunResult] = []

    async def lane_loop(j: int, lane: Lane) -> None:
        rng = ctx.rng(f"kill-{j}")
        for point in plan[j :: len(lanes)]:
            results.append(await kill_once(ctx, lane, point, rng))

    try:
        await asyncio.gather(*(lane_loop(j, lane) for j, lane in enumerate(lanes)))
    finally:
        for lane in lanes:
            await ctx.h.close_lane(lane)
    per_point: dict[str, list[RunResult]] = {}
    for r in results:
        per_point.setdefault(r.point, []).append(r)
        row.runs += 1 if r.killed else 0
        row.duplicates += r.effects.duplicates
        row.lost += r.effects.lost
        row.dead_letters += r.effects.dead_letters
        if r.recovery is not None:
            row.recovered(r.recovery)
        row.violations += r.violations
    invisible = [f"{r.point}=exit@{r.n}" for r in results if r.killed and not r.evidence]
    no_status = [f"{r.point}=exit@{r.n}" for r in results if r.killed and not r.status_ok]
    if invisible:
        row.violations.append(f"kill not visible in Temporal history: {', '.join(invisible)}")
    if no_status:
        row.violations.append(f"status output wrong after recovery: {', '.join(no_status)}")
    row.operator_visibility = bool(results) and not invisible and not no_status
    for point, rs in per_point.items():
        recs = [r.recovery for r in rs if r.recovery is not None]
        sample = next((r.evidence[0] for r in rs if r.evidence), "none")
        row.notes.append(
            f"{point}: {sum(r.killed for r in rs)} kills, N={sorted(r.n for r in rs)}, "
            f"recovery max {max(recs, default=0):.1f}s"
        )
        row.evidence.append(f"{point}: {sample}")
        during = next((r.status_during for r in rs if r.status_during), {})
        if during:
            keys = ("phase", "partitions_reported", "shards_done", "settled", "pending", "error")
            row.evidence.append(f"{point} status during the fault: " + str({k: during[k] for k in keys if k in during}))
    row.notes.append("settle_ledger_date driven with a 5 s timeout (in LedgerReconciliationWorkflow: 1 min)")
    return row
