"""Scenario 2: stop a worker right after a COMMIT, before the activity returns, at every commit point.

A run: arm the lane's shared failpoint with `<point>=exit@N` (SIGKILL-like: the process dies on
the spot) or `<point>=term@N` (the process sends itself SIGTERM, as a deploy does, and shuts down
gracefully), N drawn from the seed; start a small workload on the lane, whose three supervised
workers count the hits together so exactly one of them stops at the N-th (at least two poll when
a run starts); wait for the workload to finish (another worker carries on; the supervisor restarts
the stopped one), then count effects in the database and measure the recovery of that stop from
the workflow's history (harness/recovery.py: from the stop to the stopped work's next attempt, or
the workflow's next step, started on another worker). Lanes (own task queue, database and workers)
run side by side; runs within a lane are sequential. The workloads run with the default heartbeat
timeouts, so the figures are what a deployment gets."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from core import failpoints
from harness.checks import Effects, cleanup_effects, ledger_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, seed_cohort, seed_day, seed_events
from harness.recovery import WORK, Recovery, measure_workflows, summarize
from harness.stack import Lane
from harness.visibility import best_effort, given, temporal_evidence
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
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
SIGNALS = {"SIGKILL": "exit", "SIGTERM": "term"}  # how a run stops its worker, and the failpoint verb
EXIT_CODES = {"SIGKILL": failpoints.EXIT_CODE, "SIGTERM": 0}  # a graceful shutdown exits 0
# One to stop and one to resume the work at once, whatever the third is doing: a worker stopped in
# the previous run may still be starting again (a restart takes seconds on a loaded machine).
WORKERS_PER_LANE = 3


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
            StartCleanup(
                deadline=deadline, partitions=2, max_parallel_partitions=2, batch_size=batch, step_timeout_seconds=5
            ),
        )
        return await ctx.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()

    def ok(s: dict[str, Any]) -> bool:
        return bool(s.get("settled")) and s.get("settlement", {}).get("cleaned") == n

    return Prepared(
        hits,
        run,
        lambda: cleanup_effects(lane.pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf]),
        lambda: given(cleanup_status(ctx.client, lane.pool, wf)),
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

    async def run() -> Any:
        await start_reconciliation(
            ctx.client, lane.pool, lane.task_queue, ReconcileRequest(business_date=d, batch_size=batch)
        )
        return await ctx.client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, wf).result()

    def ok(s: dict[str, Any]) -> bool:
        return bool(s.get("settled")) and s.get("corrections") == seeded.expected_corrections

    return Prepared(
        1 if point.startswith("settle_ledger") else 4,
        run,
        lambda: ledger_effects(
            lane.pool,
            d,
            shards=2,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        ),
        lambda: given(ledger_status(ctx.client, lane.pool, d)),
        ok,
        [wf],
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
        return (await outbox_status(lane.pool, ctx.client)).model_dump()

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
    signal: str
    n: int
    stopped: bool
    effects: Effects
    recovery: Recovery
    evidence: list[str]
    status_during: dict[str, Any]
    status_ok: bool
    violations: list[str]


async def wait_polling(lane: Lane, count: int, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while sum(slot.alive() and slot.ready() for slot in lane.slots) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} workers of lane {lane.name} poll after {within:g}s")
        await asyncio.sleep(0.05)


async def kill_once(ctx: Ctx, lane: Lane, point: str, signal: str, rng: random.Random) -> RunResult:
    sup = ctx.h.supervisor
    assert lane.failpoints_file is not None
    # At least two workers poll before the stop, so another one can resume the work at once.
    await wait_polling(lane, WORKERS_PER_LANE - 1)
    prepared = await PREPARE[point](ctx, lane, point, rng)
    n = rng.randint(1, max(1, prepared.hits))
    spec = f"{point}={SIGNALS[signal]}@{n}"
    failpoints.arm_shared(lane.failpoints_file, spec)
    deaths = {slot.name: len(slot.deaths) for slot in lane.slots}
    work = asyncio.create_task(asyncio.wait_for(prepared.run(), 300))
    violations: list[str] = []
    fired: dict[str, Any] | None = None
    while fired is None and not work.done():
        await asyncio.wait({work}, timeout=0.1)
        fired = failpoints.shared_state(lane.failpoints_file)["fired"]
    fired = fired or failpoints.shared_state(lane.failpoints_file)["fired"]
    status_during: dict[str, Any] = {}
    if fired is None:
        violations.append(f"{spec}: the failpoint was never hit (workload finished without a stop)")
    else:
        status_during = await best_effort(prepared.status(), 3.0)
    try:
        await work
    except Exception as err:
        violations.append(f"{spec}: workload did not complete: {type(err).__name__}: {err}")
    recovery = Recovery(None, "no stop")
    if fired is not None:
        pid = fired["pid"]
        slot = next(s for s in lane.slots if (s.proc is not None and s.proc.pid == pid) or pid in s.pids())
        if slot.proc is not None and slot.proc.pid == pid:  # a graceful shutdown may still be under way
            await sup.wait_death(slot, deaths[slot.name], within=60)
        death = next((d for d in slot.deaths[deaths[slot.name] :] if d.pid == pid), None)
        if death is None:
            violations.append(f"{spec}: worker {pid} did not stop")
        elif death.returncode != EXIT_CODES[signal]:
            violations.append(
                f"{spec}: worker exited with code {death.returncode}, not {EXIT_CODES[signal]}: {slot.log_tail(500)}"
            )
        recovery = await measure_workflows(ctx.client, prepared.workflow_ids, point, fired["at"], fired["pid"])
        if recovery.seconds is None:
            violations.append(f"{spec}: recovery not measured: {recovery.how}")
    effects = await prepared.check()
    evidence: list[str] = []
    for wf in prepared.workflow_ids:
        evidence += await temporal_evidence(ctx.client, wf)
    # After recovery: a status that answers slowly on a loaded machine is slow, not wrong.
    status_after = await best_effort(prepared.status(), 60.0)
    return RunResult(
        point,
        signal,
        n,
        fired is not None,
        effects,
        recovery,
        evidence,
        status_during,
        prepared.status_ok(status_after),
        violations + [f"{spec}: {p}" for p in effects.problems()],
    )


async def run(ctx: Ctx) -> Row:
    row = Row("2 kill after commit")
    lanes = await asyncio.gather(
        *(ctx.h.lane(f"kill{j}", WORKERS_PER_LANE, shared_failpoints=True) for j in range(ctx.profile.kill_lanes))
    )
    # Each commit point with SIGKILL, then each with SIGTERM, and so on.
    plan = [(POINTS[i % len(POINTS)], list(SIGNALS)[i // len(POINTS) % 2]) for i in range(ctx.profile.kill_runs)]
    results: list[RunResult] = []

    async def lane_loop(j: int, lane: Lane) -> None:
        rng = ctx.rng(f"kill-{j}")
        for point, signal in plan[j :: len(lanes)]:
            results.append(await kill_once(ctx, lane, point, signal, rng))

    try:
        await asyncio.gather(*(lane_loop(j, lane) for j, lane in enumerate(lanes)))
    finally:
        for lane in lanes:
            await ctx.h.close_lane(lane)
    per_point: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        per_point.setdefault((r.point, r.signal), []).append(r)
        row.runs += 1 if r.stopped else 0
        row.duplicates += r.effects.duplicates
        row.lost += r.effects.lost
        row.dead_letters += r.effects.dead_letters
        if r.recovery.seconds is not None:
            row.recovered(r.recovery.seconds)
        row.violations += r.violations
    # A kill is visible in Temporal (a retry, a timed-out task); a graceful stop may leave nothing
    # to see there when the stopping worker finished its work itself.
    invisible = [f"{r.point}=exit@{r.n}" for r in results if r.stopped and r.signal == "SIGKILL" and not r.evidence]
    no_status = [f"{r.point} {r.signal}@{r.n}" for r in results if r.stopped and not r.status_ok]
    if invisible:
        row.violations.append(f"kill not visible in Temporal history: {', '.join(invisible)}")
    if no_status:
        row.violations.append(f"status output wrong after recovery: {', '.join(no_status)}")
    row.operator_visibility = bool(results) and not invisible and not no_status
    row.recovery = summarize([(WORK[r.point], r.signal, r.recovery.seconds) for r in results if r.stopped])
    for (point, signal), rs in per_point.items():
        recs = [r.recovery.seconds for r in rs if r.recovery.seconds is not None]
        sample = next((r.evidence[0] for r in rs if r.evidence), "none")
        sticky = max(r.recovery.sticky_wait for r in rs)
        row.notes.append(
            f"{point} {signal}: {sum(r.stopped for r in rs)} stops, N={sorted(r.n for r in rs)}, "
            f"recovery {', '.join(f'{v:.1f}' for v in sorted(recs))} s; e.g. {rs[-1].recovery.how}"
            + (f"; then up to {sticky:.1f} s on the stopped worker's sticky queue" if sticky else "")
        )
        row.evidence.append(f"{point} {signal}: {sample}")
        during = next((r.status_during for r in rs if r.status_during), {})
        if during:
            keys = ("phase", "partitions_reported", "shards_done", "settled", "pending", "error")
            row.evidence.append(
                f"{point} {signal} status during the fault: " + str({k: during[k] for k in keys if k in during})
            )
    return row
