"""The deadline planner's domain: its models, and the operations its activities and CLI run.

Every account whose deadline passes is cleaned (or renewed) exactly once, with no operator action:

- buckets: each planner iteration finds the deadline buckets (width `bucket_seconds`) that hold
  active accounts within the look-ahead horizon and ensures one sleeping cohort cleanup
  (RenewalCleanupWorkflow over the range [start, start + width)) per bucket, with a workflow ID
  derived from the bucket, so ensuring it again is harmless. The durable timer does the rest.
- overdue sweep: active accounts past their deadline by more than `sweep_grace_seconds` (a missed
  bucket, an outage, a row edited by hand) go to one sweep cleanup over their range.
- stranded claims: accounts left in 'cleaning' by a closed (terminated, cancelled, failed) cleanup
  are released to 'active' and then swept; the key (account_id, cleanup_version) keeps one effect.

The models are imported by the planner workflow (under imports_passed_through), so this module
never imports asyncpg at run time (see DEVELOPERS.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from core.models import Model, UtcDatetime, bucket_cleanup_id, sweep_cleanup_id

if TYPE_CHECKING:
    import asyncpg
    from temporalio.client import Client

log = logging.getLogger("planner")

PLANNER_ID = "deadline-planner"
DEFAULT_TASK_QUEUE = "deadline-cleanup"
# At most this many overdue accounts are counted per sweep (the count is a bounded scan).
OVERDUE_COUNT_CAP = 100_000
RELEASE_CHUNK = 10_000

PlannerPhase = Literal["planning", "sweeping", "sleeping", "paused"]


def planner_workflow_id(task_queue: str) -> str:
    """One planner per deployment (task queue): `deadline-planner` on the default queue."""
    return PLANNER_ID if task_queue == DEFAULT_TASK_QUEUE else f"{PLANNER_ID}-{task_queue}"


class PlannerSettings(Model):
    """The planner's knobs. Lateness L of a bucketed account: at most `bucket_seconds` plus the
    time to claim and clean; anything missed is caught by the sweep within
    `sweep_grace_seconds + tick_seconds`."""

    bucket_seconds: float = Field(default=1.0, ge=0.001, le=3600)
    horizon_seconds: float = Field(default=120.0, ge=1, le=86_400)
    tick_seconds: float = Field(default=5.0, ge=0.1, le=30)
    sweep_grace_seconds: float = Field(default=10.0, ge=0, le=3600)
    max_buckets_per_tick: int = Field(default=1000, ge=1, le=10_000)
    partitions: int = Field(default=8, ge=1, le=256)
    max_parallel_partitions: int = Field(default=4, ge=1, le=256)
    batch_size: int = Field(default=1000, ge=1, le=20_000)
    claim_chunk_size: int = Field(default=10_000, ge=1, le=100_000)
    iterations_per_run: int = Field(default=50, ge=1, le=10_000)

    @classmethod
    def from_env(cls) -> PlannerSettings:
        """PLANNER_BUCKET_SECONDS, PLANNER_HORIZON_SECONDS, PLANNER_TICK_SECONDS, ... override defaults."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = os.environ.get(f"PLANNER_{name.upper()}")
            if raw:
                values[name] = raw
        return cls.model_validate(values)


class PlannerTotals(Model):
    runs: int = 1
    iterations: int = 0
    buckets_ensured: int = 0
    sweeps_started: int = 0
    overdue_swept: int = 0
    stranded_recovered: int = 0


class PlannerInput(Model):
    settings: PlannerSettings = PlannerSettings()
    paused: bool = False
    pause_reason: str = ""
    totals: PlannerTotals = PlannerTotals()
    lateness_watermark: UtcDatetime | None = None


class PlanTickInput(Model):
    settings: PlannerSettings
    task_queue: str
    lateness_watermark: UtcDatetime | None = None


class PlanTickResult(Model):
    buckets: int
    first_bucket: UtcDatetime | None = None
    last_bucket: UtcDatetime | None = None
    lateness_watermark: UtcDatetime | None = None
    lateness_recorded: int = 0


class SweepInput(Model):
    settings: PlannerSettings
    task_queue: str
    # The sweep cleanup the previous iteration started: while it still runs, no second one starts.
    previous_sweep_id: str | None = None


class SweepResult(Model):
    overdue: int
    oldest_overdue: UtcDatetime | None = None
    sweep_cleanup_id: str | None = None
    stranded_workflows: list[str] = []
    stranded_recovered: int = 0


class PlannerStatus(Model):
    planner_id: str
    phase: PlannerPhase
    paused: bool
    pause_reason: str
    settings: PlannerSettings
    totals: PlannerTotals
    last_plan: PlanTickResult | None = None
    last_sweep: SweepResult | None = None
    last_iteration_at: UtcDatetime | None = None


# --- operations (activities) ------------------------------------------------------------------------


def _sql() -> Any:
    from core.queries import load

    return load("planner.sql")


async def _start_cohort(
    client: Client,
    task_queue: str,
    settings: PlannerSettings,
    workflow_id: str,
    start: datetime,
    until: datetime,
    summary: str,
) -> bool:
    """Start (or find) one cohort cleanup of the range [start, until); True if this call started it."""
    from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
    from temporalio.common import WorkflowIDReusePolicy as Reuse
    from temporalio.exceptions import WorkflowAlreadyStartedError

    from core import search_attributes as sa
    from core.models import RenewalCleanupInput
    from workflows.renewal_cleanup import RenewalCleanupWorkflow

    input = RenewalCleanupInput(
        cleanup_id=workflow_id,
        deadline=start,
        deadline_until=until,
        partitions=settings.partitions,
        max_parallel_partitions=min(settings.max_parallel_partitions, settings.partitions),
        batch_size=settings.batch_size,
        claim_chunk_size=settings.claim_chunk_size,
        note="started by the deadline planner",
    )
    try:
        await client.start_workflow(
            RenewalCleanupWorkflow.run,
            input,
            id=workflow_id,
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=Reuse.REJECT_DUPLICATE,
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(sa.CLEANUP_DEADLINE, start), SearchAttributePair(sa.CLEANUP_PHASE, "sleeping")]
            ),
            memo={"partitions_done": 0, "note": input.note},
            static_summary=summary,
        )
    except WorkflowAlreadyStartedError:  # closed with this ID: never a second run of one bucket
        return False
    return True


async def plan_buckets(pool: asyncpg.Pool, client: Client, input: PlanTickInput) -> PlanTickResult:
    """Ensure one sleeping cohort cleanup per upcoming deadline bucket; record recent lateness."""
    from core import metrics

    sql = _sql()
    s = input.settings
    now: datetime = await pool.fetchval(sql.clock)
    width = timedelta(seconds=s.bucket_seconds)
    lookback = timedelta(seconds=2 * s.tick_seconds + s.bucket_seconds)
    rows = await pool.fetch(
        sql.upcoming_buckets, now - lookback, now + timedelta(seconds=s.horizon_seconds), width, s.max_buckets_per_tick
    )
    starts: list[datetime] = [r["start"] for r in rows]
    width_ms = max(1, round(s.bucket_seconds * 1000))
    limit = asyncio.Semaphore(16)

    async def ensure(start: datetime) -> bool:
        async with limit:
            return await _start_cohort(
                client,
                input.task_queue,
                s,
                bucket_cleanup_id(start, width_ms),
                start,
                start + width,
                f"deadline bucket {start.isoformat()} (+{width_ms} ms)",
            )

    started = await asyncio.gather(*(ensure(b) for b in starts))
    if any(started):
        log.info("planner started %d bucket cleanup(s) of %d upcoming", sum(started), len(starts))

    watermark = input.lateness_watermark or now - timedelta(seconds=s.tick_seconds)
    recent = await pool.fetch(sql.cleaned_since, watermark, 20_000)
    metrics.record_lateness(r["lateness"] for r in recent)
    if recent:
        watermark = recent[-1]["cleaned_at"]
    return PlanTickResult(
        buckets=len(starts),
        first_bucket=starts[0] if starts else None,
        last_bucket=starts[-1] if starts else None,
        lateness_watermark=watermark,
        lateness_recorded=len(recent),
    )


async def recover_stranded(
    pool: asyncpg.Pool, client: Client, heartbeat: Callable[[], None] = lambda: None
) -> tuple[list[str], int]:
    """Release the claims of closed cleanups (terminated, cancelled, failed, timed out, or gone)."""
    from temporalio.client import WorkflowExecutionStatus

    from core.temporal import describe_or_none

    sql = _sql()
    closed: list[str] = []
    released = 0
    for row in await pool.fetch(sql.claiming_workflows, 1000):
        workflow_id: str = row["claimed_by"]
        desc = await describe_or_none(client, workflow_id)
        if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING:
            continue
        n = 0
        while True:
            done = await pool.execute(sql.release_stranded_chunk, workflow_id, RELEASE_CHUNK)
            chunk = int(done.split()[-1])
            n += chunk
            heartbeat()
            if chunk == 0:
                break
        if n:
            closed.append(workflow_id)
            released += n
            await pool.execute(sql.record_sweep, "stranded", workflow_id, n, None)
            log.warning(
                "recovered %d stranded claim(s) of %s (workflow %s): released for re-claiming",
                n,
                workflow_id,
                desc.status.name if desc is not None and desc.status else "not found",
            )
    return closed, released


async def sweep_overdue(
    pool: asyncpg.Pool, client: Client, input: SweepInput, heartbeat: Callable[[], None] = lambda: None
) -> SweepResult:
    """The safety net: recover stranded claims, then hand every overdue active account to a sweep."""
    from core import metrics

    sql = _sql()
    s = input.settings
    stranded, released = await recover_stranded(pool, client, heartbeat)
    metrics.record_stranded(released)
    now: datetime = await pool.fetchval(sql.clock)
    cutoff = now - timedelta(seconds=s.sweep_grace_seconds)
    row = await pool.fetchrow(sql.overdue_accounts, cutoff, OVERDUE_COUNT_CAP)
    assert row is not None
    overdue, oldest = row["overdue"], row["oldest"]
    metrics.set_overdue(overdue)
    result = SweepResult(
        overdue=overdue, oldest_overdue=oldest, stranded_workflows=stranded, stranded_recovered=released
    )
    if overdue == 0:
        return result
    if input.previous_sweep_id is not None:
        from temporalio.client import WorkflowExecutionStatus

        from core.temporal import describe_or_none

        previous = await describe_or_none(client, input.previous_sweep_id)
        if previous is not None and previous.status == WorkflowExecutionStatus.RUNNING:
            return result  # still claiming or cleaning; what it does not cover waits for the next sweep
    workflow_id = sweep_cleanup_id(cutoff)
    await _start_cohort(client, input.task_queue, s, workflow_id, oldest, cutoff, f"overdue sweep before {cutoff}")
    await pool.execute(sql.record_sweep, "overdue", workflow_id, overdue, oldest)
    metrics.record_overdue_swept(overdue)
    log.warning(
        "swept %d overdue account(s) (deadlines from %s, more than %ss ago) into %s",
        overdue,
        oldest.isoformat(),
        s.sweep_grace_seconds,
        workflow_id,
    )
    return result.model_copy(update={"sweep_cleanup_id": workflow_id})


# --- operations (CLI) ---------------------------------------------------------------------------------


async def ensure_planner(client: Client, task_queue: str, settings: PlannerSettings | None = None) -> tuple[str, bool]:
    """Start the planner unless it runs already (the running one is kept): (workflow ID, started)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

    from core.temporal import describe_or_none
    from workflows.deadline_planner import DeadlinePlannerWorkflow

    workflow_id = planner_workflow_id(task_queue)
    existing = await describe_or_none(client, workflow_id)
    if existing is not None and existing.status == WorkflowExecutionStatus.RUNNING:
        return workflow_id, False
    await client.start_workflow(
        DeadlinePlannerWorkflow.run,
        PlannerInput(settings=settings or PlannerSettings.from_env()),
        id=workflow_id,
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        static_summary="deadline planner: cohort cleanups per deadline bucket, overdue sweep, stranded claims",
    )
    started = True
    return workflow_id, started


async def signal_planner(client: Client, task_queue: str, action: Literal["pause", "resume"], reason: str = "") -> None:
    from workflows.deadline_planner import DeadlinePlannerWorkflow

    handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, planner_workflow_id(task_queue))
    if action == "pause":
        await handle.signal(DeadlinePlannerWorkflow.pause, reason)
    else:
        await handle.signal(DeadlinePlannerWorkflow.resume)


async def nudge_planner(client: Client, task_queue: str) -> None:
    """Plan now (e.g. after a renewal to a near deadline) instead of at the end of the tick."""
    from temporalio.service import RPCError

    from workflows.deadline_planner import DeadlinePlannerWorkflow

    try:
        handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, planner_workflow_id(task_queue))
        await handle.signal(DeadlinePlannerWorkflow.nudge)
    except RPCError:  # no planner (e.g. turned off): the renewal stands, the sweep still catches it
        pass


async def planner_status(client: Client, pool: asyncpg.Pool, task_queue: str) -> dict[str, Any]:
    """What an operator asks: is it running, what is next, what is overdue, what was recovered, lateness."""
    from temporalio.client import WorkflowExecutionStatus

    from core.temporal import describe_or_none
    from workflows.deadline_planner import DeadlinePlannerWorkflow

    sql = _sql()
    workflow_id = planner_workflow_id(task_queue)
    out: dict[str, Any] = {"workflow_id": workflow_id}
    desc = await describe_or_none(client, workflow_id)
    out["temporal_status"] = desc.status.name if desc is not None and desc.status else None
    live: PlannerStatus | None = None
    if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING:
        handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, workflow_id)
        live = await handle.query(DeadlinePlannerWorkflow.status)
    settings = live.settings if live else PlannerSettings.from_env()
    out["phase"] = live.phase if live else None
    out["paused"] = live.paused if live else None
    if live and live.pause_reason:
        out["pause_reason"] = live.pause_reason
    now: datetime = await pool.fetchval(sql.clock)
    out["database_clock"] = now
    out["next_deadlines"] = [dict(r) for r in await pool.fetch(sql.next_deadlines, 5)]
    out["due_next_hour"] = await pool.fetchval(sql.due_within, 3600.0)
    overdue = await pool.fetchrow(
        sql.overdue_accounts, now - timedelta(seconds=settings.sweep_grace_seconds), OVERDUE_COUNT_CAP
    )
    assert overdue is not None
    out["overdue"] = overdue["overdue"]
    out["oldest_overdue"] = overdue["oldest"]
    totals = {r["kind"]: r for r in await pool.fetch(sql.sweep_totals)}
    stranded, swept = totals.get("stranded"), totals.get("overdue")
    out["stranded_claims_recovered"] = int(stranded["accounts"]) if stranded else 0
    out["stranded_recoveries"] = stranded["sweeps"] if stranded else 0
    out["overdue_swept"] = int(swept["accounts"]) if swept else 0
    out["overdue_sweeps"] = swept["sweeps"] if swept else 0
    stats = await pool.fetchrow(sql.lateness_stats, 3600.0, 100_000)
    assert stats is not None
    out["lateness_seconds"] = {
        "window": "cleanups of the last hour (at most 100,000)",
        "cleanups": stats["cleanups"],
        "p50": stats["p50"],
        "p99": stats["p99"],
        "max": stats["max"],
    }
    out["settings"] = settings.model_dump()
    if live:
        out["totals"] = live.totals.model_dump()
        out["last_iteration_at"] = live.last_iteration_at
        out["last_plan"] = live.last_plan.model_dump(mode="json") if live.last_plan else None
        out["last_sweep"] = live.last_sweep.model_dump(mode="json") if live.last_sweep else None
    return out
