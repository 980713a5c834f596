"""Scenario 13: the deadline planner under kills, with nobody running a cleanup command.

Real worker processes (two; three in the full profile) ensure the lane's planner
(CLEANUP_PLANNER=on, as `worker.py` does). Each round seeds five (full: six) cohorts whose deadlines
are spread over ~5 s; the harness starts no cleanup: the planner's bucket cleanups (and its sweep,
for whatever they miss) must do it all. Meanwhile some accounts are renewed for good before their
deadline, some to a new deadline (a later cohort's bucket, or a bucket of its own that only the
renewal makes known), and one is renewed after its deadline (too late). Workers die while this
runs: every one is armed to exit at its 5th plan step, right after it started the bucket cleanups
(planner steps run on the worker hosting the planner, so whichever hosts it dies and the planner
moves), the first also right after a partition batch COMMIT, the second after a claim-chunk or a
settlement COMMIT (by round); and a live one is SIGKILLed between the first and the last deadline.
In the last round of a profile with several rounds every worker is SIGKILLed before the cohorts
are seeded and comes back only once the second cohort is overdue past the sweep grace, so the
sweep must take the early cohorts while the planner plans the later ones; the worker that runs
that sweep dies right after recording it.

Must hold, counted in the database: every account in one terminal state, the one its latest
in-time renewal implies (status and version); one idempotency row, one reminder and the archive
rows per cleaned account, its game data gone, a renewed account's data kept; the late renewal
recorded `too_late`; every cleanup that touched an account started by the planner and settled;
after each kill the planner completes an iteration within 45 s (its histories). Recovery: from a
kill until both the planner's next iteration and every account due at the kill done. Visible:
attempts after the kills in the histories (cleanups and every run of the planner), and `planner
status` with the planner running, no overdue account and the round's lateness.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import harness
from cleanup.models import SWEEP_OVERDUE_ACCOUNTS, planner_workflow_id
from cleanup.operations import RenewalOutcome, cleanup_status, renew
from cleanup.planner import planner_status
from core import failpoints
from core.queries import load
from harness.checks import cleanup_effects
from harness.common import MATCHES, Ctx, Row, account_ids, seed_cohort, wait_for
from harness.scenarios.renewal_order import expected_states
from harness.stack import Death, Lane
from harness.visibility import best_effort, given, temporal_evidence

SQL = load(harness.__file__)

SWEEP_GRACE = 4.0
# The lane's planner, read by the worker that starts it: a short tick, small batches (so a
# partition commits several times), the harness's short heartbeat timeouts (cleanups and planner
# steps). Batches of 5 rows make the load budget's stress signal (latency per 1,000 rows)
# meaningless, so it is set out of reach: the budget still bounds batches in flight, but lateness
# here is the planner's and the kills'.
PLANNER_ENV = {
    "LOAD_BUDGET_LATENCY_MS": "600000",
    "PLANNER_TICK_SECONDS": "1",
    "PLANNER_MAX_IDLE_SECONDS": "1",
    # Cohorts of one 1 s bucket: an account is overdue SWEEP_GRACE after its deadline, the instant
    # the rounds place their outages and kills by.
    "PLANNER_LATENESS_OBJECTIVE": "2",
    "PLANNER_SWEEP_GRACE_SECONDS": str(SWEEP_GRACE),
    "PLANNER_HORIZON_SECONDS": "60",
    "CLEANUP_PARTITIONS": "2",
    "CLEANUP_MAX_PARALLEL_PARTITIONS": "2",
    "CLEANUP_BATCH_SIZE": "5",
    "CLEANUP_HEARTBEAT_TIMEOUT_SECONDS": "2",
    "PLANNER_STEP_HEARTBEAT_SECONDS": "2",
}
PARTITION_KILL = "cleanup_partition.after_commit"
# The second armed worker, by round: a planner step first (the heart of the scenario).
SECOND_KILL = ["claim_cleanup_in_chunks.after_commit", "settle_cleanup.after_commit"]
# Planner steps run on the worker that hosts the planner (eager activities), so every worker is
# armed to die at its 5th plan step: whichever hosts the planner then, a few seconds into the round
# (after it planned the buckets of the first cohorts).
PLAN_KILL = "plan_deadline_buckets.after_start=exit@5"
SWEEP_KILL = "sweep_overdue_accounts.after_commit"
# After each kill, the planner must complete an iteration within this (it ticks every second; a
# killed planner step is retried after its heartbeat timeout, 2 s here, a workflow task of a dead
# worker after 10 s).
PLANNER_LIVENESS = 45.0


@dataclass
class Round:
    prefixes: list[str] = field(default_factory=list)
    accounts: list[str] = field(default_factory=list)
    deadlines: list[datetime] = field(default_factory=list)
    outcomes: list[RenewalOutcome] = field(default_factory=list)
    late: RenewalOutcome | None = None
    sigkills: list[datetime] = field(default_factory=list)

    @property
    def patterns(self) -> list[str]:
        return [f"acct_{p}_%" for p in self.prefixes]


def wall(at_monotonic: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=time.monotonic() - at_monotonic)


async def _renew_at(
    ctx: Ctx, lane: Lane, account: str, at: datetime, until: datetime | None
) -> RenewalOutcome | BaseException | None:
    """Renew at `at` (for good, or to `until`); None: not tried, `until` had passed by then (a
    loaded machine; renewing to a past deadline is refused as bad input, nothing to judge)."""
    await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
    if until is not None and until <= datetime.now(UTC) + timedelta(seconds=0.2):
        return None
    try:
        return await renew(ctx.client, lane.pool, lane.task_queue, account, until)
    except Exception as err:  # reported as a violation, not a crash of the round
        return err


def _sigkill(slot_proc: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(slot_proc.pid, signal.SIGKILL)


async def _kill_one(lane: Lane, at: datetime, pick: int, rnd: Round) -> list[Death]:
    """SIGKILL one live worker at `at` (the supervisor restarts it)."""
    await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
    live = [s for s in lane.slots if s.alive() and s.proc is not None]
    if live:
        rnd.sigkills.append(datetime.now(UTC))
        _sigkill(live[pick % len(live)].proc)
    return []  # the supervisor records the death (and restarts the worker)


def _all_down(lane: Lane, rnd: Round) -> list[Death]:
    """SIGKILL every worker of the lane and keep them down (not restarted) until `_all_up`."""
    deaths: list[Death] = []
    for slot in lane.slots:
        slot.supervised = False
    for slot in lane.slots:
        proc = slot.proc
        if proc is not None and proc.poll() is None:
            _sigkill(proc)
            deaths.append(Death(slot.name, proc.pid, -9, time.monotonic()))
    rnd.sigkills.append(datetime.now(UTC))
    return deaths


async def _all_up(ctx: Ctx, lane: Lane, at: datetime) -> list[Death]:
    """Start every worker again at `at`, armed to die right after the sweep the outage made
    necessary (whichever runs it)."""
    await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
    for slot in lane.slots:
        slot.supervised = True
    await asyncio.gather(*(ctx.h.supervisor.start(s, f"{SWEEP_KILL}=exit@1") for s in lane.slots))
    return []


def arming(ctx: Ctx, index: int, workers: int) -> list[str]:
    """Every worker's failpoints in round `index` (a worker comes back without): the plan step on
    all (whichever hosts the planner), a partition batch on the first, a claim chunk or a
    settlement on the second."""
    rng = ctx.rng(f"planner-kills-arm:{index}")
    second = SECOND_KILL[index % len(SECOND_KILL)]
    extra = [f"{PARTITION_KILL}=exit@{rng.randint(1, 3)}", f"{second}=exit@1"]
    return [",".join([*extra[i : i + 1], PLAN_KILL]) for i in range(workers)]


async def one_round(ctx: Ctx, lane: Lane, row: Row, index: int, outage: bool) -> None:
    rng = ctx.rng(f"planner-kills:{index}")
    pool, sup = lane.pool, ctx.h.supervisor
    rnd = Round()
    round_began: datetime = await pool.fetchval(SQL.planner_clock)
    # Round 0's workers were started armed with the lane: every death since counts.
    before = {s.name: len(s.deaths) if index > 0 else 0 for s in lane.slots}
    outage_deaths: list[Death] = []
    if outage:  # every worker down before the cohorts are seeded, until the sweep is due
        armed = {"after the outage, every worker": f"{SWEEP_KILL}=exit@1"}
        outage_deaths = _all_down(lane, rnd)
    else:
        armed = dict(zip((s.name for s in lane.slots), arming(ctx, index, len(lane.slots)), strict=True))
        if index > 0:  # round 0's workers were started armed
            await asyncio.gather(*(sup.start(s, armed[s.name]) for s in lane.slots))
    started = time.monotonic()

    cohorts = 5 if ctx.profile.scale == 1 else 6
    for i in range(cohorts):
        prefix, deadline = ctx.ids.prefix("pl"), ctx.ids.future_deadline(3 + 1.0 * i)
        await seed_cohort(pool, prefix, deadline, rng.randint(15, 30) * ctx.profile.scale)
        rnd.prefixes.append(prefix)
        rnd.deadlines.append(deadline)
    fresh = ctx.ids.future_deadline((rnd.deadlines[-1] - datetime.now(UTC)).total_seconds() + 2)
    per_cohort = [await account_ids(pool, p) for p in rnd.prefixes]
    rnd.accounts = [a for ids in per_cohort for a in ids]

    # Renewals before each account's deadline: ~10% for good, ~10% to a new deadline (the next
    # cohort's bucket for even cohorts, else a bucket only these renewals make known).
    renewals = []
    late_account = per_cohort[0][-1]
    for i, ids in enumerate(per_cohort):
        chosen = rng.sample([a for a in ids if a != late_account], max(2, len(ids) // 5))
        half = len(chosen) // 2
        target = rnd.deadlines[i + 1] if i % 2 == 0 and i + 1 < cohorts else fresh
        left = (rnd.deadlines[i] - datetime.now(UTC)).total_seconds()
        for j, account in enumerate(chosen):
            at = datetime.now(UTC) + timedelta(seconds=rng.uniform(0.2, max(0.3, left - 1.0)))
            renewals.append(_renew_at(ctx, lane, account, at, None if j < half else target))
    late = _renew_at(ctx, lane, late_account, rnd.deadlines[0] + timedelta(seconds=1.5), None)

    # The faults: a SIGKILL of one live worker between the first and the last deadline, or (outage
    # round) every worker back only when the second cohort is overdue past the sweep grace.
    span = (rnd.deadlines[-1] - rnd.deadlines[0]).total_seconds()
    kill_at = rnd.deadlines[0] + timedelta(seconds=rng.uniform(0.5, max(1.0, span)))
    killer = (
        _all_up(ctx, lane, rnd.deadlines[1] + timedelta(seconds=SWEEP_GRACE + 1.5))
        if outage
        else _kill_one(lane, kill_at, rng.randint(0, 9), rnd)
    )
    late_task = asyncio.create_task(late)
    killer_task = asyncio.create_task(killer)
    not_tried = 0
    for r in await asyncio.gather(*renewals):
        if isinstance(r, BaseException):
            row.violations.append(f"renewal failed: {type(r).__name__}: {r}")
        elif r is None:
            not_tried += 1
        else:
            rnd.outcomes.append(r)
    late_result = await late_task
    await killer_task
    if late_result is None:
        pass  # never: renewed for good, it has no new deadline to pass
    elif isinstance(late_result, BaseException):
        row.violations.append(f"late renewal failed: {type(late_result).__name__}: {late_result}")
    else:
        rnd.late = late_result
        if late_result.in_time:
            row.violations.append(f"renewal of {late_account} 1.5 s after its deadline was judged in time")

    # The planner alone must bring every account to a terminal state.
    async def terminal() -> bool:
        return int(await pool.fetchval(SQL.planner_not_terminal, rnd.patterns)) == 0

    within = 120.0 + 30 * ctx.profile.scale
    if not await wait_for(terminal, within, interval=0.5):
        left_over = await pool.fetchval(SQL.planner_not_terminal, rnd.patterns)
        row.violations.append(f"{left_over} accounts not terminal {within:.0f} s after seeding")
    cleanups = await pool.fetch(SQL.planner_cleanups, rnd.patterns)
    ids = [r["cleanup_id"] for r in cleanups]
    not_planner = [r["cleanup_id"] for r in cleanups if not r["by_planner"]]
    if not_planner:
        row.violations.append(f"cleanups not started by the planner: {not_planner[:3]}")
    ended = await asyncio.wait_for(
        asyncio.gather(*(ctx.client.get_workflow_handle(w).result() for w in ids), return_exceptions=True), within
    )
    failed = [f"{w}: {r}" for w, r in zip(ids, ended, strict=True) if isinstance(r, BaseException)]
    row.violations += [f"cleanup did not complete: {f}" for f in failed[:3]]

    # Effects, counted in the database, per cohort.
    expected = {a: ("cleaned", 1) for a in rnd.accounts} | expected_states(rnd.outcomes)
    for i, prefix in enumerate(rnd.prefixes):
        mine = [a for a in rnd.accounts if a.startswith(f"acct_{prefix}_")]
        effects = await cleanup_effects(
            pool,
            prefix,
            matches_per_account=MATCHES,
            expect_cleaned=sum(1 for a in mine if expected[a][0] == "cleaned"),
            cleanup_ids=ids if i == 0 else [],  # every cleanup of the round settled (counted once)
        )
        row.duplicates += effects.duplicates
        row.lost += effects.lost
        row.violations += [f"{prefix}: {p}" for p in effects.problems()]
    states = {
        r["account_id"]: (r["status"], r["cleanup_version"])
        for r in await pool.fetch(SQL.planner_account_states, rnd.patterns)
    }
    wrong = sorted(a for a, want in expected.items() if states.get(a) != want)
    if wrong:
        row.lost += len(wrong)
        row.violations.append(
            f"{len(wrong)} accounts not in the state their latest renewal implies, e.g. "
            + ", ".join(f"{a}: {states.get(a)} != {expected[a]}" for a in wrong[:3])
        )
    recorded = dict(await pool.fetch(SQL.planner_late_renewals, [late_account]))
    if rnd.late is not None and recorded.get("too_late", 0) != 1:
        row.lost += 1
        row.violations.append(f"the late renewal of {late_account} is not recorded too_late: {recorded}")

    # The kills: failpoint exits (recorded by the supervisor) and SIGKILLs.
    deaths = [d for s in lane.slots for d in s.deaths[before[s.name] :]] + outage_deaths
    failpoint_deaths = [d for d in deaths if d.returncode == failpoints.EXIT_CODE]
    kill_times = [wall(d.at) for d in failpoint_deaths] + rnd.sigkills
    row.runs += len(failpoint_deaths) + len(rnd.sigkills)
    # The planner's loop goes on after the kills: a killed planner step must not hold it. Its
    # iterations end with a completed sweep step, read from its histories (every run).
    gaps: list[float] = []
    if kill_times:
        last_kill = max(kill_times)

        async def iterated_after_last_kill() -> bool:
            return any(t > last_kill for t in await planner_iterations(ctx, lane))

        await wait_for(iterated_after_last_kill, PLANNER_LIVENESS, interval=1.0)
        ends = sorted(await planner_iterations(ctx, lane))
        for at in kill_times:
            after = next((t for t in ends if t > at), None)
            gaps.append((after - at).total_seconds() if after is not None else float("inf"))
        # Recovery from a kill: until the planner's next iteration and every account due then done.
        for at, gap in zip(kill_times, gaps, strict=True):
            done_at = await pool.fetchval(SQL.planner_due_done_at, rnd.patterns, at)
            row.recovered(max(gap, (done_at - at).total_seconds() if done_at is not None else 0.0))
        if max(gaps) > PLANNER_LIVENESS:
            row.violations.append(
                f"the planner completed no iteration within {PLANNER_LIVENESS:.0f} s of a kill "
                f"(gaps {[round(g, 1) for g in gaps]} s)"
            )
    hit = sorted(_hits(lane, failpoint_deaths))
    row.notes.append(
        f"round {index + 1}: armed {sorted(armed.values())}, failpoint deaths {len(failpoint_deaths)} "
        f"({', '.join(hit) or 'none hit'}), SIGKILL at {len(rnd.sigkills)} instant(s)"
        f"{' (every worker, before seeding, back after the second deadline + the sweep grace)' if outage else ''}; "
        f"{len(rnd.accounts)} accounts in {cohorts} cohorts over {span:.0f} s"
        f"{f', {not_tried} renewals to a new deadline not tried (it had passed)' if not_tried else ''}; "
        f"planner's next iteration {_s(max(gaps, default=None))} s after a kill at most; "
        f"{time.monotonic() - started:.1f} s"
    )

    # Operator visibility: the histories and `planner status`.
    evidence: list[str] = []
    for w in ids:
        evidence += [f"{w}: {e}" for e in await temporal_evidence(ctx.client, w)]
    evidence += await planner_evidence(ctx, lane)
    # After the round: a status that answers slowly on a loaded machine is slow, not wrong.
    status = await best_effort(given(planner_status(ctx.client, pool, lane.task_queue)), 60.0)
    lateness = await pool.fetchrow(SQL.planner_lateness, rnd.patterns)
    statuses = [await best_effort(given(cleanup_status(ctx.client, pool, w)), 60.0) for w in ids]
    status_ok = (
        status.get("temporal_status") == "RUNNING"
        and status.get("overdue") == 0
        and status.get("lateness_seconds", {}).get("cleanups", 0) >= lateness["cleaned"]
        and all(s.get("settled") for s in statuses)
    )
    if not status_ok:
        row.violations.append(
            f"planner status or cleanup status wrong: {_brief(status)}; "
            f"unsettled {[s.get('workflow_id', s) for s in statuses if not s.get('settled')][:3]}"
        )
    visible = bool(evidence) or not failpoint_deaths
    if not visible:
        row.violations.append("failpoint kills not visible in any Temporal history")
    row.operator_visibility = row.operator_visibility and status_ok and visible
    sweeps = [w for w in ids if w.startswith("cleanup-sweep-")]
    swept = await pool.fetchrow(SQL.planner_swept_since, round_began)
    if swept["accounts"] > len(rnd.accounts):  # each account is overdue, and swept, at most once
        row.violations.append(f"planner status counts {swept['accounts']} accounts swept of {len(rnd.accounts)}")
    row.evidence += evidence[:1]
    row.evidence.append(
        f"round {index + 1}: {len(ids)} planner cleanups ({len(sweeps)} sweeps; {swept['sweeps']} recorded, "
        f"{swept['accounts']} accounts), {len(rnd.outcomes)} renewals "
        f"({sum(not o.in_time for o in rnd.outcomes)} too late), lateness p50 {_s(lateness['p50'])} "
        f"p99 {_s(lateness['p99'])} max {_s(lateness['max'])} s; planner status: {_brief(status)}"
    )


def _hits(lane: Lane, failpoint_deaths: list[Death]) -> list[str]:
    """The failpoint each of these deaths exited at (its worker's log says which)."""
    slots = {s.name: s for s in lane.slots}
    out = []
    for d in failpoint_deaths:
        found = re.search(rf"failpoint (\S+): exiting process {d.pid}\b", slots[d.slot].log_tail(1_000_000))
        out.append(found.group(1) if found else "?")
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _brief(status: dict[str, Any]) -> str:
    keys = ("temporal_status", "overdue", "overdue_swept", "stranded_claims_recovered", "error")
    out = {k: status[k] for k in keys if k in status}
    late = status.get("lateness_seconds") or {}
    if late:
        out["lateness"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in late.items() if k != "window"}
    if status.get("totals"):
        out["runs"] = status["totals"].get("runs")
        out["iterations"] = status["totals"].get("iterations")
    return str(out)


async def planner_iterations(ctx: Ctx, lane: Lane) -> list[datetime]:
    """When each iteration of the lane's planner ended (its sweep step completed), over every run."""
    workflow_id = planner_workflow_id(lane.task_queue)
    out: list[datetime] = []
    async for wf in ctx.client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        history = await ctx.client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        scheduled: dict[int, str] = {}
        for e in history.events:
            if e.HasField("activity_task_scheduled_event_attributes"):
                scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            elif e.HasField("activity_task_completed_event_attributes"):
                kind = scheduled.get(e.activity_task_completed_event_attributes.scheduled_event_id)
                if kind == SWEEP_OVERDUE_ACCOUNTS:
                    out.append(e.event_time.ToDatetime().replace(tzinfo=UTC))
    return out


async def planner_evidence(ctx: Ctx, lane: Lane) -> list[str]:
    """Failures and retries in every run of the planner (it continues as new)."""
    workflow_id = planner_workflow_id(lane.task_queue)
    out: list[str] = []
    async for wf in ctx.client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        out += [f"{workflow_id}: {e}" for e in await temporal_evidence(ctx.client, workflow_id, wf.run_id)]
    return out


async def run(ctx: Ctx) -> Row:
    row = Row("13 planner under kills")
    workers = 2 if ctx.profile.scale == 1 else 3
    t0 = time.monotonic()
    lane = await ctx.h.lane("planner", workers, planner=True, env=PLANNER_ENV, failpoints=arming(ctx, 0, workers))
    row.operator_visibility = True  # and-ed over the rounds
    row.notes.append(f"{workers} workers with the planner started in {time.monotonic() - t0:.1f} s")
    try:
        for index in range(ctx.profile.rounds):
            outage = ctx.profile.rounds > 1 and index == ctx.profile.rounds - 1
            await one_round(ctx, lane, row, index, outage)
    finally:
        with contextlib.suppress(Exception):
            await ctx.client.get_workflow_handle(planner_workflow_id(lane.task_queue)).terminate(reason="scenario over")
        await ctx.h.close_lane(lane)
    return row
