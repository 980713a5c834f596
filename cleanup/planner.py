"""The deadline planner's operations, run by its activities and its commands.

- buckets: each planner iteration finds the deadline buckets (width `bucket_seconds`) that hold
  active accounts within the look-ahead horizon and ensures one sleeping cohort cleanup
  (RenewalCleanupWorkflow over the range [start, start + width)) per bucket, with a workflow ID
  derived from the bucket, so ensuring it again is harmless. The durable timer does the rest.
  A bucket whose accounts share one deadline gets a cleanup of that instant instead (its ID names
  the instant): it wakes at the deadline, not at the bucket's end, and its partitions clean while
  it claims. Should the bucket later hold other deadlines too, the range's cleanup is ensured for
  them; the claim gives each account to one cleanup only.
- overdue sweep: active accounts past their deadline by more than `overdue_after_seconds` (the
  grace, plus a sparse cohort's wait for its window's end; a missed
  bucket, an outage, a row edited by hand) go to one sweep cleanup over their range.
- stranded claims: accounts left in 'cleaning' by a cleanup that Temporal reports closed
  (terminated, cancelled, failed), in the namespace that claimed them, are released to 'active' and
  then swept; the key (account_id, cleanup_version) keeps one effect. A claiming workflow that
  Temporal does not know (another namespace or cluster) releases nothing and is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NamedTuple

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair,
)
from temporalio.service import RPCError, RPCStatusCode

import cleanup
from budget.controller import BudgetStatus, budget_status
from cleanup.inputs import CleanupScope, StartCleanup, cleanup_input
from cleanup.models import (
    BUCKET_ID_PREFIX,
    CLEANUP_WORKFLOW,
    DEFAULTS,
    OVERDUE_COUNT_CAP,
    PLANNER_NUDGE_SIGNAL,
    PLANNER_PAUSE_SIGNAL,
    PLANNER_RESUME_SIGNAL,
    PLANNER_WORKFLOW,
    RELEASE_CHUNK,
    STATUS_QUERY,
    CleanupResult,
    bucket_cleanup_id,
    planner_workflow_id,
    sweep_cleanup_id,
)
from cleanup.planner_models import (
    PlannerInput,
    PlannerPhase,
    PlannerSettings,
    PlannerStatus,
    PlannerTotals,
    PlanTickInput,
    PlanTickResult,
    SweepInput,
    SweepResult,
)
from core import db, metrics
from core import search_attributes as sa
from core.config import CleanupDefaults, Settings
from core.model import Model, Report
from core.queries import load
from core.temporal import StartOutcome, WorkflowStart, describe_or_none, query_or_note, start_idempotently

log = logging.getLogger("planner")
DEFAULT_PLANNER = PlannerSettings()
SQL = load(cleanup.__file__, "planner.sql")


class CohortRange(NamedTuple):
    """One cohort cleanup the planner starts: its workflow ID, the deadline range [start, until) it
    covers (or the instant `start`) and its summary. `partitions`: the settings' count unless given
    (a bucket that fits in one batch takes one)."""

    workflow_id: str
    start: datetime
    until: datetime | None  # None: the one instant `start`
    summary: str
    partitions: int | None = None
    wake_early_seconds: float = 0.0


async def _start_cohort(
    client: Client, task_queue: str, defaults: CleanupDefaults, cohort: CohortRange
) -> StartOutcome:
    """Start (or find) one cohort cleanup of the range [start, until): started, joined or closed.
    Its input comes from the one builder (cleanup.inputs), as an operator's cleanup does."""
    scope = CleanupScope(
        cohort.workflow_id,
        cohort.start,
        partitions=cohort.partitions,
        deadline_until=cohort.until,
        wake_early_seconds=cohort.wake_early_seconds,
        one_activity=(cohort.partitions or defaults.partitions) == 1,
    )
    input = cleanup_input(scope, StartCleanup(note="started by the deadline planner"), defaults)
    # A closed run with this ID is never repeated: one run per bucket.
    return await start_idempotently(
        client,
        WorkflowStart(
            CLEANUP_WORKFLOW,
            input,
            workflow_id=cohort.workflow_id,
            task_queue=task_queue,
            result_type=CleanupResult,
            search_attributes=[
                SearchAttributePair(sa.CLEANUP_DEADLINE, cohort.start),
                SearchAttributePair(sa.CLEANUP_PHASE, "sleeping"),
            ],
            memo={"partitions_done": 0, "note": input.note},
            summary=cohort.summary,
        ),
    )


async def plan_buckets(
    pool: asyncpg.Pool, client: Client, input: PlanTickInput, ensured: dict[str, datetime] | None = None
) -> PlanTickResult:
    """Ensure one sleeping cohort cleanup per upcoming cohort of deadlines; record recent lateness;
    say when the next plan is needed.

    Cohorts: the horizon is cut into windows of `cohort_seconds` (the lateness objective less the
    margin, on a grid from the epoch, so every tick cuts the same windows and a window's cleanup
    keeps its ID). A window that fits one batch is one cohort; a window holding more keeps buckets of
    `bucket_seconds` (dense deadlines: the lateness of a bucket, at no extra cost per account).

    `ensured` (kept by the caller between ticks, e.g. per worker process): cohort workflow IDs this
    process already ensured. A cohort's ID is started once and never reused, so ensuring it again
    changes nothing; skipping those saves a start call per upcoming cohort per tick. Another
    process, or a restarted one, ensures them once more, which is harmless."""
    s = input.settings
    if await planner_pause(pool, input.task_queue) is not None:  # whichever run asks: paused
        return PlanTickResult(buckets=0, lateness_watermark=input.lateness_watermark)
    now: datetime = await pool.fetchval(SQL.clock)
    window = timedelta(seconds=s.cohort_seconds)
    lookback = timedelta(seconds=2 * s.tick_seconds) + window
    horizon_end = now + timedelta(seconds=s.horizon_seconds)
    cohorts = await _upcoming_cohorts(pool, s, input.cleanups.batch_size, now - lookback, horizon_end)
    await _ensure_buckets(client, input, cohorts, ensured if ensured is not None else {}, forget_before=now - lookback)
    # Everything before `planned_until` has its cleanup; the first deadline after it must be
    # planned before it enters the horizon (at once when the cap cut this plan short).
    capped = len(cohorts) >= s.max_buckets_per_tick
    planned_until = cohorts[-1][0]["start"] + cohorts[-1][1] if capped else horizon_end
    next_unplanned: datetime | None = await pool.fetchval(SQL.next_deadline, planned_until)
    plan_again_in = None
    if capped:
        plan_again_in = 0.0
    elif next_unplanned is not None:
        plan_again_in = max(0.0, (next_unplanned - horizon_end).total_seconds())
    watermark, recorded = await _record_lateness(pool, input, now)
    starts: list[datetime] = [r["start"] for r, _ in cohorts]
    return PlanTickResult(
        buckets=len(starts),
        first_bucket=starts[0] if starts else None,
        last_bucket=starts[-1] if starts else None,
        lateness_watermark=watermark,
        lateness_recorded=recorded,
        next_unplanned=next_unplanned,
        plan_again_in_seconds=plan_again_in,
    )


# A cohort cleanup costs about 28 history events whatever its size (bench.planner_events): a window
# whose buckets would hold this many accounts each on average keeps them (under one event per
# account already), and gains the bucket's lateness instead of the window's.
DENSE_ACCOUNTS_PER_BUCKET = 30


def dense_threshold(s: PlannerSettings, batch_size: int) -> int:
    """The accounts above which a window of `cohort_seconds` is dense (cut into buckets): as many as
    its buckets hold at `DENSE_ACCOUNTS_PER_BUCKET` each, and never more than one batch (a sparse
    cohort is one partition of one batch)."""
    buckets = max(1, round(s.cohort_seconds / s.bucket_seconds))
    return min(batch_size, DENSE_ACCOUNTS_PER_BUCKET * buckets)


async def _upcoming_cohorts(
    pool: asyncpg.Pool, s: PlannerSettings, batch_size: int, since: datetime, until: datetime
) -> list[tuple[asyncpg.Record, timedelta]]:
    """The windows of `cohort_seconds` with active accounts with a deadline in [since, until), each
    with its width; a dense window (`dense_threshold`) as its buckets of `bucket_seconds` instead.
    At most `max_buckets_per_tick`, earliest first. A window's count stops at the dense threshold
    (never above one batch), so a sparse window's count is exact and a dense one's buckets are
    counted again, up to one batch each."""
    window = timedelta(seconds=s.cohort_seconds)
    bucket = timedelta(seconds=s.bucket_seconds)
    limit = s.max_buckets_per_tick
    if window <= bucket:  # no window wider than a bucket: the buckets, counted up to one batch
        buckets = SQL.bind(
            "upcoming_buckets", since=since, until=until, width=bucket, buckets=limit, count_up_to=batch_size + 1
        )
        rows = await pool.fetch(SQL.upcoming_buckets, *buckets)
        return [(r, bucket) for r in rows]
    dense = dense_threshold(s, batch_size)
    windows = SQL.bind("upcoming_buckets", since=since, until=until, width=window, buckets=limit, count_up_to=dense + 1)
    rows = await pool.fetch(SQL.upcoming_buckets, *windows)
    out: list[tuple[asyncpg.Record, timedelta]] = []
    for row in rows:
        if row["accounts"] <= dense:
            out.append((row, window))
        else:
            end = min(row["start"] + window, until)
            buckets = SQL.bind(
                "upcoming_buckets",
                since=max(row["start"], since),
                until=end,
                width=bucket,
                buckets=limit - len(out),
                count_up_to=batch_size + 1,
            )
            fine = await pool.fetch(SQL.upcoming_buckets, *buckets)
            out.extend((r, bucket) for r in fine)
        if len(out) >= limit:
            return out[:limit]
    return out


def cohort_range(
    row: asyncpg.Record, width: timedelta, s: PlannerSettings, cleanups: CleanupDefaults, task_queue: str
) -> CohortRange:
    """The cleanup of one upcoming cohort (`row`: start, first, last, accounts; `width`: its window or
    bucket): its ID names the range, or the instant when every account of it shares one deadline."""
    # A cohort that fits in one batch is one partition: one activity after the claim
    # instead of P small ones in P / parallel rounds (the lateness of the cohort).
    partitions = 1 if row["accounts"] <= cleanups.batch_size else None
    if row["first"] == row["last"]:
        instant = row["first"]
        return CohortRange(
            bucket_cleanup_id(instant, 0, task_queue),
            instant,
            None,
            f"deadline {instant.isoformat()} (one instant)",
            partitions=partitions,
        )
    start = row["start"]
    width_ms = max(1, round(width.total_seconds() * 1000))
    return CohortRange(
        bucket_cleanup_id(start, width_ms, task_queue),
        start,
        start + width,
        f"deadline bucket {start.isoformat()} (+{width_ms} ms)",
        partitions=partitions,
        wake_early_seconds=s.wake_early_seconds,
    )


async def _ensure_buckets(
    client: Client,
    input: PlanTickInput,
    cohorts: list[tuple[asyncpg.Record, timedelta]],
    known: dict[str, datetime],
    forget_before: datetime,
) -> None:
    """Ensure the cleanup of each upcoming cohort (`cohorts`: a row of start, first, last, accounts,
    and its width) not in `known`, then add those to `known` and drop the ones older than
    `forget_before` (never upcoming again)."""
    s = input.settings
    limit = asyncio.Semaphore(16)

    async def ensure(cohort: CohortRange) -> None:
        async with limit:
            await _start_cohort(client, input.task_queue, input.cleanups, cohort)

    new = [
        c
        for c in (cohort_range(r, w, s, input.cleanups, input.task_queue) for r, w in cohorts)
        if c.workflow_id not in known
    ]
    await asyncio.gather(*(ensure(c) for c in new))
    for c in new:
        known[c.workflow_id] = c.start
    for workflow_id in [w for w, start in known.items() if start < forget_before]:
        del known[workflow_id]
    if new:
        log.info("planner ensured %d new cohort cleanup(s) of %d upcoming", len(new), len(cohorts))


async def _record_lateness(pool: asyncpg.Pool, input: PlanTickInput, now: datetime) -> tuple[datetime, int]:
    """Record the lateness of the accounts cleaned since the watermark (the last tick's, else one
    tick ago): the new watermark and how many were recorded."""
    watermark = input.lateness_watermark or now - timedelta(seconds=input.settings.tick_seconds)
    recent = await pool.fetch(SQL.cleaned_since, *SQL.bind("cleaned_since", since=watermark, most=20_000))
    metrics.record_lateness(r["lateness"] for r in recent)
    if recent:
        watermark = recent[-1]["cleaned_at"]
    return watermark, len(recent)


# One sweep step releases stranded claims for at most this long (a closed cohort of millions takes
# several steps), so the step, and the planner's loop behind it, stays short and bounded.
RELEASE_SECONDS_PER_STEP = 60.0


class StrandedRecovery(NamedTuple):
    released_workflows: list[str]  # closed in this namespace: their claims went back to 'active'
    released: int
    not_found: list[str]  # unknown to this namespace: their claims are kept, and reported


async def recover_stranded(
    pool: asyncpg.Pool,
    client: Client,
    heartbeat: Callable[[], None] = lambda: None,
    time_limit: float = RELEASE_SECONDS_PER_STEP,
) -> StrandedRecovery:
    """Release the claims of cleanups that Temporal reports closed (completed, terminated, cancelled,
    failed, timed out) in this client's namespace, starting no new chunk after `time_limit` seconds
    (the rest is released by the next step). Only claims recorded in this namespace (or before the
    namespace was recorded, '') are judged. A workflow Temporal does not know releases nothing: a
    worker pointed at another namespace or cluster must not take every claim in flight for closed."""
    released_workflows: list[str] = []
    not_found: list[str] = []
    released = 0
    until = time.monotonic() + time_limit
    for claim_namespace in dict.fromkeys((client.namespace, "")):
        claiming = SQL.bind("claiming_workflows", namespace=claim_namespace, most=1000)
        for row in await pool.fetch(SQL.claiming_workflows, *claiming):
            workflow_id: str = row["claimed_by"]
            desc = await describe_or_none(client, workflow_id)
            if desc is None:
                not_found.append(workflow_id)
                continue
            if desc.status in (None, WorkflowExecutionStatus.RUNNING):
                continue
            n = await release_claims(pool, workflow_id, claim_namespace, until, heartbeat)
            if n:
                released_workflows.append(workflow_id)
                released += n
                await pool.execute(
                    SQL.record_sweep,
                    *SQL.bind(
                        "record_sweep", kind="stranded", cleanup_id=workflow_id, accounts=n, oldest_deadline=None
                    ),
                )
                log.warning(
                    "recovered %d stranded claim(s) of %s (workflow %s): released for re-claiming",
                    n,
                    workflow_id,
                    desc.status.name,
                )
            if time.monotonic() > until:  # at least one chunk per step: every step makes progress
                return StrandedRecovery(released_workflows, released, not_found)
    if not_found:
        log.warning(
            "claims in 'cleaning' by %d workflow(s) unknown to namespace %s kept (not released): %s",
            len(not_found),
            client.namespace,
            ", ".join(not_found[:10]),
        )
    return StrandedRecovery(released_workflows, released, not_found)


async def release_claims(
    pool: asyncpg.Pool, workflow_id: str, claim_namespace: str, until: float, heartbeat: Callable[[], None]
) -> int:
    """The claims of one closed workflow back to 'active', chunk by chunk until done or `until`."""
    n = 0
    while True:
        done = await pool.execute(
            SQL.release_stranded_chunk,
            *SQL.bind(
                "release_stranded_chunk", workflow_id=workflow_id, chunk_size=RELEASE_CHUNK, namespace=claim_namespace
            ),
        )
        chunk = int(done.split()[-1])
        n += chunk
        heartbeat()
        if chunk == 0 or time.monotonic() > until:
            return n


async def sweep_overdue(
    pool: asyncpg.Pool, client: Client, input: SweepInput, heartbeat: Callable[[], None] = lambda: None
) -> SweepResult:
    """The safety net: recover stranded claims, then hand every overdue active account to a sweep."""
    s = input.settings
    if await planner_pause(pool, input.task_queue) is not None:  # whichever run asks: paused
        return SweepResult(overdue=0)
    stranded, released, not_found = await recover_stranded(pool, client, heartbeat)
    metrics.record_stranded(released)
    now: datetime = await pool.fetchval(SQL.clock)
    cutoff = now - timedelta(seconds=s.overdue_after_seconds)
    row = await pool.fetchrow(
        SQL.overdue_accounts, *SQL.bind("overdue_accounts", cutoff=cutoff, count_up_to=OVERDUE_COUNT_CAP)
    )
    assert row is not None
    overdue, oldest = row["overdue"], row["oldest"]
    metrics.set_overdue(overdue)
    result = SweepResult(
        overdue=overdue,
        oldest_overdue=oldest,
        stranded_workflows=stranded,
        stranded_recovered=released,
        stranded_not_found=not_found,
    )
    if overdue == 0:
        return result
    # The previous sweep: the one the planner saw started, and the one recorded last (by a retried
    # step's attempt that died before replying, or before the planner continued as new): while one
    # runs, no second one starts (nor is recorded, which would count its accounts twice).
    recorded_last = await pool.fetchval(SQL.latest_overdue_sweep)
    for previous_id in dict.fromkeys(i for i in (input.previous_sweep_id, recorded_last) if i is not None):
        previous = await describe_or_none(client, previous_id)
        if previous is not None and previous.status == WorkflowExecutionStatus.RUNNING:
            return result  # still claiming or cleaning; what it does not cover waits for the next sweep
    workflow_id = sweep_cleanup_id(input.as_of, input.task_queue)
    await _start_cohort(
        client,
        input.task_queue,
        input.cleanups,
        CohortRange(workflow_id, oldest, cutoff, f"overdue sweep before {cutoff}"),
    )
    await pool.execute(
        SQL.record_sweep,
        *SQL.bind("record_sweep", kind="overdue", cleanup_id=workflow_id, accounts=overdue, oldest_deadline=oldest),
    )
    metrics.record_overdue_swept(overdue)
    log.warning(
        "swept %d overdue account(s) (deadlines from %s, more than %ss ago) into %s",
        overdue,
        oldest.isoformat(),
        s.overdue_after_seconds,
        workflow_id,
    )
    return result.model_copy(update={"sweep_cleanup_id": workflow_id})


# --- operations (CLI) ---------------------------------------------------------------------------------


async def ensure_planner(
    client: Client,
    task_queue: str,
    settings: PlannerSettings = DEFAULT_PLANNER,
    pool: asyncpg.Pool | None = None,
    cleanups: CleanupDefaults = DEFAULTS,
) -> tuple[str, bool]:
    """Start the planner unless it runs already (the running one is kept): (workflow ID, started).
    With the database at hand, a new run starts paused if an operator's pause is recorded there.
    `settings` and `cleanups`: the caller's (`settings.planner`, `settings.cleanup.defaults`)."""
    workflow_id = planner_workflow_id(task_queue)
    existing = await describe_or_none(client, workflow_id)
    if existing is not None and existing.status == WorkflowExecutionStatus.RUNNING:
        return workflow_id, False
    pause = await planner_pause(pool, task_queue) if pool is not None else None
    outcome = await start_idempotently(
        client,
        WorkflowStart(
            PLANNER_WORKFLOW,
            PlannerInput(
                settings=settings,
                cleanups=cleanups,
                paused=pause is not None,
                pause_reason=pause["reason"] if pause else "",
            ),
            workflow_id=workflow_id,
            task_queue=task_queue,
            summary="deadline planner: cohort cleanups per deadline bucket, overdue sweep, stranded claims",
            repeat_closed=True,
        ),
    )
    return workflow_id, outcome.started  # False: another caller started it since the describe above


class PlannerCohort(NamedTuple):
    """The cohort the running planner of a task queue puts a deadline in, as its plan computes it."""

    cohort: CohortRange
    cleanups: CleanupDefaults  # the running planner's cleanup defaults
    accounts: int  # active accounts in the cohort's range now
    paused: bool  # an operator's pause is recorded: the planner plans nothing new meanwhile


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


async def planner_cohort_of(
    client: Client, pool: asyncpg.Pool, task_queue: str, deadline: datetime
) -> PlannerCohort | None:
    """The planner's cohort of `deadline`: the window (or dense bucket) its plan cuts around it, on
    the same grid and with the settings of the planner's running run. None when no planner runs on
    `task_queue`, or when no active account has `deadline` (the cohort would not cover it)."""
    planner = await running_planner_input(client, task_queue)
    if planner is None:
        return None
    settings, cleanups = planner.settings, planner.cleanups
    window = timedelta(seconds=settings.cohort_seconds)
    start = EPOCH + (deadline - EPOCH) // window * window
    for row, width in await _upcoming_cohorts(pool, settings, cleanups.batch_size, start, start + window):
        if not row["start"] <= deadline < row["start"] + width:
            continue
        cohort = cohort_range(row, width, settings, cleanups, task_queue)
        if cohort.until is None and cohort.start != deadline:
            return None  # the window's one instant is another deadline
        until = cohort.until or cohort.start + timedelta(microseconds=1)
        accounts: int = await pool.fetchval(
            SQL.active_accounts_in_range, *SQL.bind("active_accounts_in_range", since=cohort.start, until=until)
        )
        paused = await planner_pause(pool, task_queue) is not None
        return PlannerCohort(cohort, cleanups, accounts, paused)
    return None


async def running_planner_input(client: Client, task_queue: str) -> PlannerInput | None:
    """The input (settings and cleanup defaults) of the running planner of `task_queue`, from its
    run's history (so no worker need answer a query), or None when none runs."""
    desc = await describe_or_none(client, planner_workflow_id(task_queue))
    if desc is None or desc.status != WorkflowExecutionStatus.RUNNING:
        return None
    handle = client.get_workflow_handle(desc.id, run_id=desc.run_id)
    async for event in handle.fetch_history_events(page_size=1):
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        (input,) = await client.data_converter.decode(payloads, [PlannerInput])
        return input if isinstance(input, PlannerInput) else None
    return None


async def planner_cleanup_ids(
    client: Client, task_queue: str, deadline: datetime, settings: PlannerSettings = DEFAULT_PLANNER
) -> list[str]:
    """The workflow IDs the planner gives a cleanup covering `deadline`, whichever its plan chose:
    the instant's, the sparse window's and the dense bucket's (with the running planner's settings,
    else `settings`: the caller's)."""
    running = await running_planner_input(client, task_queue)
    s = running.settings if running is not None else settings
    ids = [bucket_cleanup_id(deadline, 0, task_queue)]
    for seconds in dict.fromkeys((s.cohort_seconds, s.bucket_seconds)):
        width = timedelta(seconds=seconds)
        start = EPOCH + (deadline - EPOCH) // width * width
        ids.append(bucket_cleanup_id(start, max(1, round(seconds * 1000)), task_queue))
    return ids


async def join_planner_cohort(client: Client, task_queue: str, found: PlannerCohort) -> StartOutcome:
    """Start the planner's cleanup of the cohort, or find it: the planner ensures the same workflow
    ID, so the two are one run whichever comes first, and each account is claimed by it once."""
    return await _start_cohort(client, task_queue, found.cleanups, found.cohort)


# A planner whose workflow task failed this many times in a row (a bug, a non-deterministic change
# deployed under a running history) is stuck: it no longer plans nor sweeps, though RUNNING.
STUCK_TASK_ATTEMPTS = 3


async def watch_planner(
    client: Client,
    task_queue: str,
    stuck_checks: int = 0,
    pool: asyncpg.Pool | None = None,
    settings: PlannerSettings = DEFAULT_PLANNER,
    cleanups: CleanupDefaults = DEFAULTS,
) -> tuple[str, int]:
    """One look of a worker's watchdog at the planner: (what it did, stuck checks so far).

    A closed planner (failed, terminated, timed out, or gone) is started again; one whose workflow
    task has failed `STUCK_TASK_ATTEMPTS` times in a row at two looks in a row is terminated and
    started again. Both are safe: the planner keeps no state the database does not (bucket IDs,
    sweeps and recoveries are recorded there, and so is an operator's pause); what a restart loses
    is its counters. `settings` and `cleanups`: those of a planner started again."""
    workflow_id = planner_workflow_id(task_queue)
    desc = await describe_or_none(client, workflow_id)
    if desc is None or desc.status != WorkflowExecutionStatus.RUNNING:
        was = desc.status.name if desc is not None and desc.status else "not found"
        _, started = await ensure_planner(client, task_queue, settings, pool, cleanups)
        if started:
            log.warning("deadline planner %s was %s: started again", workflow_id, was)
            metrics.record_planner_restart("closed")
            return "restarted", 0
        return "running", 0
    task = desc.raw_description.pending_workflow_task
    failing = desc.raw_description.HasField("pending_workflow_task") and task.attempt >= STUCK_TASK_ATTEMPTS
    if not failing:
        return "running", 0
    if stuck_checks + 1 < 2:
        log.warning("deadline planner %s: its workflow task failed %d times in a row", workflow_id, task.attempt - 1)
        return "stuck", stuck_checks + 1
    log.error(
        "deadline planner %s is stuck (its workflow task failed %d times in a row): terminating and starting it again",
        workflow_id,
        task.attempt - 1,
    )
    with contextlib.suppress(RPCError):  # closed meanwhile: start it all the same
        await client.get_workflow_handle(workflow_id).terminate(reason="stuck: its workflow task kept failing")
    await ensure_planner(client, task_queue, settings, pool, cleanups)
    metrics.record_planner_restart("stuck")
    return "restarted", 0


PAUSE_STOPS = "planning new bucket cleanups, the overdue sweep and the recovery of stranded claims"
PAUSE_DOES_NOT_STOP = (
    "cleanups already running, manual and single-account cleanups, renewals, and (unless paused with "
    "--hold-scheduled) the bucket cleanups already scheduled within the horizon, whose timers still fire"
)


async def planner_pause(pool: asyncpg.Pool, task_queue: str) -> asyncpg.Record | None:
    """The operator's pause of this task queue's planner, as recorded in the database (or None)."""
    row: asyncpg.Record | None = await pool.fetchrow(SQL.planner_pause_get, task_queue)
    return row


async def held_by_pause(pool: asyncpg.Pool, task_queue: str, cleanup_id: str) -> str | None:
    """Why a planner's bucket cleanup must not claim yet (paused with --hold-scheduled), or None.
    Other cleanups (manual, single-account, the sweep's) are never held."""
    if not cleanup_id.startswith(BUCKET_ID_PREFIX):
        return None
    pause = await planner_pause(pool, task_queue)
    if pause is None or not pause["hold_scheduled"]:
        return None
    return f"held by the planner's pause since {pause['paused_at'].isoformat()} ({pause['reason'] or 'no reason'})"


async def signal_planner(
    client: Client,
    task_queue: str,
    action: Literal["pause", "resume"],
    reason: str = "",
    pool: asyncpg.Pool | None = None,
    hold_scheduled: bool = False,
) -> None:
    """Record the pause (or its end) in the database first, where a restarted planner finds it,
    then tell the running planner."""
    if pool is not None:
        if action == "pause":
            await pool.execute(
                SQL.planner_pause_set,
                *SQL.bind("planner_pause_set", task_queue=task_queue, reason=reason, hold_scheduled=hold_scheduled),
            )
        else:
            await pool.execute(SQL.planner_pause_clear, task_queue)
    handle = client.get_workflow_handle(planner_workflow_id(task_queue))
    try:
        if action == "pause":
            await handle.signal(PLANNER_PAUSE_SIGNAL, reason)
        else:
            await handle.signal(PLANNER_RESUME_SIGNAL)
    except RPCError as err:
        # No planner running: the recorded pause (or its end) is what the next run starts with.
        if pool is None or err.status != RPCStatusCode.NOT_FOUND:
            raise


class DeadlineCohort(Model):
    """Active accounts sharing one upcoming deadline."""

    deadline: datetime
    accounts: int


class Lateness(Model):
    """Seconds from deadline to cleaned, of the recent cleanups (None: no cleanup in the window)."""

    window: str
    cleanups: int
    p50: float | None
    p99: float | None
    max: float | None


class PlannerReport(Report):
    """`planner_status`: the planner run (Temporal), its pause, and what the database shows: the next
    deadlines, overdue and held accounts, failures, recoveries, lateness and the load budget.
    Without a database, `database` says what is missing and those fields stay None."""

    workflow_id: str
    temporal_status: str | None = None
    phase: PlannerPhase | None = None
    paused: bool | None = None
    pause_reason: str | None = None
    paused_at: datetime | None = None
    hold_scheduled: bool | None = None
    pause_effect: str | None = None
    database_clock_behind_this_host_seconds: float | None = None
    database_clock_behind: str | None = None  # a recent claim that found the database clock far behind
    database_clock: datetime | None = None
    next_deadlines: list[DeadlineCohort] | None = None
    due_next_hour: int | None = None
    overdue: int | None = None
    oldest_overdue: datetime | None = None
    held_overdue: int | None = None  # under a legal hold past their deadline: not overdue
    oldest_held: datetime | None = None
    failed_pending_review: int | None = None
    failed_by_schema_error: int | None = None
    stranded_claims_recovered: int | None = None
    stranded_recoveries: int | None = None
    overdue_swept: int | None = None
    overdue_sweeps: int | None = None
    lateness_seconds: Lateness | None = None
    budget: BudgetStatus | None = None
    # the workers' targets whose match column has no usable index now, each with its fix
    targets_missing_index: list[str] | None = None
    database: str | None = None  # set only when the database is unavailable: what is not shown
    live_status: str | None = None  # set only when no worker answered the status query: what is not shown
    settings: PlannerSettings
    totals: PlannerTotals | None = None
    last_iteration_at: datetime | None = None
    last_plan: PlanTickResult | None = None
    last_sweep: SweepResult | None = None
    last_step_error: str | None = None


async def planner_status(
    client: Client, pool: asyncpg.Pool | None, task_queue: str, settings: PlannerSettings = DEFAULT_PLANNER
) -> PlannerReport:
    """What an operator asks: is it running, what is next, what is overdue, what was recovered, lateness.

    Without a database (`pool` None, or the connection lost while reading) it answers what Temporal
    knows, and `database` says that the deadlines, overdue accounts, recoveries and lateness are missing;
    without a worker to answer its status query, `live_status` says what is not shown. `settings`:
    shown when the planner's own cannot be asked (the caller's `settings.planner`)."""
    workflow_id = planner_workflow_id(task_queue)
    out: dict[str, Any] = {"workflow_id": workflow_id}
    desc = await describe_or_none(client, workflow_id)
    out["temporal_status"] = desc.status.name if desc is not None and desc.status else None
    live: PlannerStatus | None = None
    if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING:
        live, no_answer = await query_or_note(desc, client, STATUS_QUERY, PlannerStatus)
        if live is None:
            out["live_status"] = f"{no_answer}; its phase, totals and last steps are not shown"
    settings = live.settings if live else settings
    out["phase"] = live.phase if live else None
    out["paused"] = live.paused if live else None
    if live and live.pause_reason:
        out["pause_reason"] = live.pause_reason
    missing = "not connected" if pool is None else None
    if pool is not None:
        try:
            out.update(await _pause_status(pool, task_queue))
            out.update(await _clock_status(pool, task_queue))
            out.update(await _planner_status_from_database(pool, settings))
            out["targets_missing_index"] = await _targets_missing_index(pool)
        except Exception as err:
            if not db.is_database_error(err):
                raise
            missing = f"{type(err).__name__}: {err}"
    if missing is not None:
        out["database"] = f"unavailable ({missing}); {PLANNER_DB_PART}"
    out["settings"] = settings
    if live:
        out["totals"] = live.totals
        out["last_iteration_at"] = live.last_iteration_at
        out["last_plan"] = live.last_plan
        out["last_sweep"] = live.last_sweep
        out["last_step_error"] = live.last_step_error
    return PlannerReport(**out)


async def _targets_missing_index(pool: asyncpg.Pool) -> list[str]:
    """The workers' last target set checked for missing indexes on the catalog as it is now: the
    line goes away once the index is built. A set this code cannot read shows nothing."""
    from cleanup.target_check import read_catalog  # lazy: only the database part of the status needs them
    from cleanup.target_report import missing_indexes
    from cleanup.targets import targets_from_json

    recorded = await pool.fetchval(SQL.latest_worker_targets)
    if recorded is None:
        return []
    try:
        targets = targets_from_json(recorded)
    except ValueError:
        return []
    found = missing_indexes(targets, await read_catalog(pool, targets))
    return [f"{m.target} (~{m.row_estimate} rows): {m.fix}" for m in found]


PLANNER_DB_PART = "next deadlines, overdue accounts, recoveries and lateness are not shown"


# `planner status` reports a claim that found the database clock behind its timer this recently.
CLOCK_BEHIND_SHOWN_SECONDS = 3600.0


async def _clock_status(pool: asyncpg.Pool, task_queue: str) -> dict[str, Any]:
    """How far the database clock is from this host's, and the last claim that found it far behind."""
    now: datetime = await pool.fetchval(SQL.clock)
    out: dict[str, Any] = {"database_clock_behind_this_host_seconds": round(time.time() - now.timestamp(), 3)}
    row = await pool.fetchrow(
        SQL.database_clock_behind,
        *SQL.bind("database_clock_behind", task_queue=task_queue, within_seconds=CLOCK_BEHIND_SHOWN_SECONDS),
    )
    if row is not None:
        out["database_clock_behind"] = (
            f"{row['behind_seconds']:.1f}s behind the timer of {row['cleanup_id']} at "
            f"{row['observed_at'].isoformat()} (its claim waits for the database clock)"
        )
    return out


async def _pause_status(pool: asyncpg.Pool, task_queue: str) -> dict[str, Any]:
    """The recorded pause wins over the live run's flag (a restarted run may not know it yet)."""
    pause = await planner_pause(pool, task_queue)
    if pause is None:
        return {"paused": False, "pause_effect": "not paused"}
    does_not_stop = PAUSE_DOES_NOT_STOP
    if pause["hold_scheduled"]:
        does_not_stop = "cleanups already running, manual and single-account cleanups, renewals"
    return {
        "paused": True,
        "pause_reason": pause["reason"],
        "paused_at": pause["paused_at"],
        "hold_scheduled": pause["hold_scheduled"],
        "pause_effect": f"stops {PAUSE_STOPS}"
        + (" and holds the scheduled bucket cleanups at their claim" if pause["hold_scheduled"] else "")
        + f"; does not stop {does_not_stop}",
    }


async def _planner_status_from_database(pool: asyncpg.Pool, settings: PlannerSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    now: datetime = await pool.fetchval(SQL.clock)
    out["database_clock"] = now
    out["next_deadlines"] = [DeadlineCohort.from_row(r) for r in await pool.fetch(SQL.next_deadlines, 5)]
    out["due_next_hour"] = await pool.fetchval(SQL.due_within, 3600.0)
    cutoff = now - timedelta(seconds=settings.overdue_after_seconds)
    overdue = await pool.fetchrow(
        SQL.overdue_accounts, *SQL.bind("overdue_accounts", cutoff=cutoff, count_up_to=OVERDUE_COUNT_CAP)
    )
    assert overdue is not None
    out["overdue"] = overdue["overdue"]
    out["oldest_overdue"] = overdue["oldest"]
    held = await pool.fetchrow(SQL.held_overdue)
    assert held is not None
    out["held_overdue"] = held["held_overdue"]  # not overdue: a legal hold keeps them until released
    out["oldest_held"] = held["oldest_held"]
    failed = await pool.fetchrow(SQL.failed_accounts)
    assert failed is not None
    # Claimed accounts no cleanup can finish until someone acts: never 'cleaning' unseen.
    out["failed_pending_review"] = failed["pending"]
    out["failed_by_schema_error"] = failed["schema_errors"]
    totals = {r["kind"]: r for r in await pool.fetch(SQL.sweep_totals)}
    stranded, swept = totals.get("stranded"), totals.get("overdue")
    out["stranded_claims_recovered"] = int(stranded["accounts"]) if stranded else 0
    out["stranded_recoveries"] = stranded["sweeps"] if stranded else 0
    out["overdue_swept"] = int(swept["accounts"]) if swept else 0
    out["overdue_sweeps"] = swept["sweeps"] if swept else 0
    stats = await pool.fetchrow(SQL.lateness_stats, *SQL.bind("lateness_stats", within_seconds=3600.0, most=100_000))
    assert stats is not None
    out["lateness_seconds"] = Lateness.from_row(stats, window="cleanups of the last hour (at most 100,000)")
    out["budget"] = await budget_status(pool)
    return out


# What a game's registration of a near deadline notifies at commit (migration 090): the payload is
# the service's schema, so deployments sharing a database nudge only their own planner.
DUE_CHANNEL = "deadline_cleanup_due"
# A burst of registrations is one nudge per interval per worker (the planner's tick bounds it too).
NUDGE_INTERVAL_SECONDS = 1.0
LISTEN_RETRY_SECONDS = 5.0


async def keep_nudging_planner(client: Client, database_url: str, settings: Settings) -> None:
    """Every worker that ensures the planner listens on DUE_CHANNEL and nudges the planner when the
    game registers or moves a deadline due within the hour, so a registration sooner than the
    planner's longest sleep (PLANNER_MAX_IDLE_SECONDS) is planned at once, not swept late. The
    listening session is the service's (its application_name). A lost session is opened again; a
    notification missed meanwhile waits for the planner's next iteration, as without this."""
    due = asyncio.Event()
    planner = client.get_workflow_handle(planner_workflow_id(settings.task_queue))

    def heard(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == settings.database_schema:
            due.set()

    while True:
        try:
            conn = await db.open_connection(
                database_url, settings, server_settings={"application_name": db.APPLICATION_NAME}
            )
            try:
                await conn.add_listener(DUE_CHANNEL, heard)
                while not conn.is_closed():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(due.wait(), timeout=LISTEN_RETRY_SECONDS)
                        due.clear()
                        with contextlib.suppress(RPCError):  # no planner now: its next run plans it
                            await planner.signal(PLANNER_NUDGE_SIGNAL)
                        await asyncio.sleep(NUDGE_INTERVAL_SECONDS)
            finally:
                conn.terminate()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as err:
            log.warning(
                "listening for registrations due soon: %s; again in %g s", type(err).__name__, LISTEN_RETRY_SECONDS
            )
            await asyncio.sleep(LISTEN_RETRY_SECONDS)
