"""An idle planner costs little, and sparse deadlines share a cohort, with the planner's guarantees.

- Cohorts: sparse deadlines share one cleanup per window of `cohort_seconds` (the lateness
  objective less the margin); a dense window keeps its 1 s buckets; the plan says when the next
  plan is needed (the first deadline beyond the horizon, or at once when the cap cut it short).
- Idle sleep: the planner sleeps `max_idle_seconds` when nothing is due, less when a deadline is
  about to enter the horizon; a registration made while it sleeps (the game's SQL: no nudge), due
  before it wakes, is still cleaned within `max_idle_seconds + sweep_grace_seconds` plus a cohort,
  and a stranded claim is released within `max_idle_seconds` of its cleanup closing.
- A small cohort (a range of one partition) claims, cleans and settles in one activity, which
  leaves one effect however often it is delivered.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.testing import ActivityEnvironment

from activities.cleanup import CleanupActivities
from budget.controller import BudgetSettings, LoadBudget
from cleanup.models import (
    ClaimChunkedInput,
    CleanupPartitionInput,
    SmallCohortInput,
    bucket_cleanup_id,
    planner_workflow_id,
)
from cleanup.planner import dense_threshold, keep_nudging_planner, plan_buckets, planner_status
from cleanup.planner_models import PlannerSettings, PlanTickInput
from cleanup.targets import load_targets
from core.config import CleanupDefaults
from tests.helpers import seed, wait_until
from tests.test_planner import all_settled, planner_worker, strand_a_claim

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def window_start(at: datetime, width: float) -> datetime:
    """The start of the window of `width` seconds (from the epoch, as date_bin cuts it) holding `at`."""
    seconds = (at - EPOCH).total_seconds()
    return EPOCH + timedelta(seconds=seconds // width * width)


class RecordingClient:
    def __init__(self) -> None:
        self.starts: list[tuple[str, int, datetime, datetime | None]] = []
        self.one_activity: dict[str, bool] = {}

    async def start_workflow(self, workflow: str, input: Any, *, id: str, **_: Any) -> Any:
        self.starts.append((id, input.partitions, input.deadline_from, input.deadline_until))
        self.one_activity[id] = input.one_activity
        return SimpleNamespace(result_run_id=f"run-{len(self.starts)}")


async def test_sparse_deadlines_share_a_window_and_a_dense_window_keeps_its_buckets(pool):
    s = PlannerSettings(lateness_objective_seconds=5.0, horizon_seconds=60)
    cleanups = CleanupDefaults(batch_size=1000, partitions=4)
    assert (s.cohort_seconds, dense_threshold(s, cleanups.batch_size)) == (4.0, 120)
    now: datetime = await pool.fetchval("SELECT cleanup_clock()")
    sparse = window_start(now + timedelta(seconds=20), 4.0)
    for offset in (0.5, 1.5, 2.5):  # three accounts in one window: one cohort of the window
        await seed(pool, sparse + timedelta(seconds=offset), 1)
    dense = sparse + timedelta(seconds=8)
    await seed(pool, dense + timedelta(seconds=0.2), 70)  # 150 accounts in one window: its buckets
    await seed(pool, dense + timedelta(seconds=0.7), 70)
    await seed(pool, dense + timedelta(seconds=1.3), 5)
    await seed(pool, dense + timedelta(seconds=1.6), 5)
    instant = sparse + timedelta(seconds=16.25)  # a window of one instant: that instant's cleanup
    await seed(pool, instant, 2)
    later = now + timedelta(seconds=200)  # beyond the horizon: the next plan is due before it enters
    await seed(pool, later, 1)
    client = RecordingClient()
    result = await plan_buckets(pool, client, PlanTickInput(settings=s, cleanups=cleanups, task_queue="q"), {})  # type: ignore[arg-type]
    assert [(i, p, u - d if u else None) for i, p, d, u in client.starts] == [
        (bucket_cleanup_id(sparse, 4000, "q"), 1, timedelta(seconds=4)),
        (bucket_cleanup_id(dense, 1000, "q"), 1, timedelta(seconds=1)),
        (bucket_cleanup_id(dense + timedelta(seconds=1), 1000, "q"), 1, timedelta(seconds=1)),
        (bucket_cleanup_id(instant, 0, "q"), 1, None),
    ]
    assert all(client.one_activity.values()), "each fits one batch: claimed, cleaned and settled by one activity"
    assert result.buckets == 4 and result.next_unplanned == later
    assert result.plan_again_in_seconds is not None
    assert 200 - 60 - 5 < result.plan_again_in_seconds <= 200 - 60

    capped = await plan_buckets(
        pool,
        RecordingClient(),  # type: ignore[arg-type]
        PlanTickInput(settings=s.model_copy(update={"max_buckets_per_tick": 1}), cleanups=cleanups, task_queue="q"),
        {},
    )
    assert capped.buckets == 1 and capped.plan_again_in_seconds == 0.0  # plan the rest at once


def planner_sleeps(history: Any) -> list[float]:
    return [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]


IDLE = PlannerSettings(
    tick_seconds=1.0,
    max_idle_seconds=6.0,
    horizon_seconds=30,
    sweep_grace_seconds=2.0,
    lateness_objective_seconds=2.0,
)


async def test_an_idle_planner_sleeps_its_longest_and_catches_what_came_meanwhile(client, pool, task_queue):
    """Nothing due: it sleeps `max_idle_seconds` at a time. Accounts registered while it sleeps
    (seeded in SQL, no nudge) with a deadline before it wakes are cleaned once, within
    `max_idle_seconds + sweep_grace_seconds` plus a cohort of their deadline, never before it; a
    claim stranded by a terminated cleanup is released and the accounts cleaned in that time too."""
    async with planner_worker(client, pool, task_queue, IDLE):
        handle = client.get_workflow_handle(planner_workflow_id(task_queue))

        async def slept_twice() -> bool:
            return len(planner_sleeps(await handle.fetch_history())) >= 2

        await wait_until(slept_twice, within=30, interval=0.5)
        assert planner_sleeps(await handle.fetch_history())[:2] == [IDLE.max_idle_seconds] * 2
        soon = await seed(pool, datetime.now(UTC) + timedelta(seconds=1), 5)  # due before it wakes
        stranded_at = datetime.now(UTC) + timedelta(seconds=1)
        stranded = await seed(pool, stranded_at, 3)
        await strand_a_claim(client, pool, stranded, stranded_at)
        await wait_until(lambda: all_settled(pool, soon + stranded), within=60, interval=0.5)
        status = await planner_status(client, pool, task_queue)
        await handle.terminate(reason="test over")
    bound = IDLE.max_idle_seconds + IDLE.sweep_grace_seconds + IDLE.cohort_seconds + 5.0  # claim + clean, loaded CI
    row = await pool.fetchrow(
        "SELECT count(*) AS cleaned, max(extract(epoch FROM cleaned_at - renewal_deadline)) AS late,"
        " count(*) FILTER (WHERE claimed_at < renewal_deadline) AS early"
        " FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'cleaned'",
        soon,
    )
    assert (row["cleaned"], row["early"]) == (5, 0) and row["late"] <= bound, dict(row)
    applied = await pool.fetchval(
        "SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])", soon + stranded
    )
    assert applied == len(soon + stranded)
    assert status.stranded_claims_recovered == len(stranded)


async def test_a_deadline_beyond_the_horizon_wakes_the_planner_before_it_enters(client, pool, task_queue):
    """With a deadline 5 s beyond the horizon, the planner sleeps about 5 s rather than its longest,
    and the account is cleaned by a planned cohort, not by the sweep."""
    settings = IDLE.model_copy(update={"max_idle_seconds": 60.0, "horizon_seconds": 10.0, "sweep_grace_seconds": 60.0})
    accounts = await seed(pool, datetime.now(UTC) + timedelta(seconds=15), 2)
    async with planner_worker(client, pool, task_queue, settings):
        await wait_until(lambda: all_settled(pool, accounts), within=60, interval=0.5)
        handle = client.get_workflow_handle(planner_workflow_id(task_queue))
        sleeps = planner_sleeps(await handle.fetch_history())
        await handle.terminate(reason="test over")
    assert sleeps and 1.0 <= sleeps[0] <= 6.0, sleeps
    cleanups = [r[0] for r in await pool.fetch("SELECT DISTINCT cleanup_id FROM cleanup_applied")]
    assert cleanups and all(c.startswith("cleanup-bucket-") for c in cleanups), cleanups
    assert await pool.fetchval("SELECT count(*) FROM planner_sweeps WHERE kind = 'overdue'") == 0


async def test_a_registration_due_sooner_than_the_planners_sleep_nudges_it(client, pool, task_queue, settings):
    """The game registers (its own SQL, no service call) accounts due in a few seconds while the
    planner sleeps its longest (60 s): the registration notifies at commit, the worker's listener
    nudges the planner, and a planned cohort cleans them, not the overdue sweep a minute later."""
    idle = IDLE.model_copy(update={"max_idle_seconds": 60.0, "horizon_seconds": 30.0, "sweep_grace_seconds": 60.0})
    async with planner_worker(client, pool, task_queue, idle):
        handle = client.get_workflow_handle(planner_workflow_id(task_queue))

        async def asleep() -> bool:
            return planner_sleeps(await handle.fetch_history())[-1:] == [idle.max_idle_seconds]

        await wait_until(asleep, within=30, interval=0.5)
        listening = asyncio.create_task(keep_nudging_planner(client, settings.database_url, settings))
        try:
            await wait_until(lambda: listener_up(pool), within=30, interval=0.2)
            accounts = [f"nudged-{i}" for i in range(3)]
            await pool.execute(
                "SELECT set_deadline(a, clock_timestamp() + interval '3 seconds') FROM unnest($1::text[]) a", accounts
            )
            await wait_until(lambda: all_settled(pool, accounts), within=45, interval=0.5)
        finally:
            listening.cancel()
        await handle.terminate(reason="test over")
    cleanups = [r[0] for r in await pool.fetch("SELECT DISTINCT cleanup_id FROM cleanup_applied")]
    assert cleanups and all(c.startswith("cleanup-bucket-") for c in cleanups), cleanups
    assert await pool.fetchval("SELECT count(*) FROM planner_sweeps WHERE kind = 'overdue'") == 0


async def listener_up(pool: Any) -> bool:
    """The worker's listening session has sent its LISTEN (what it is idle after)."""
    return bool(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'"
        )
    )


async def test_a_small_cohort_delivered_twice_cleans_each_account_once_and_settles_once(pool):
    """`clean_small_cohort` (claim, partition and settlement in one activity) run a second time, as a
    retry after all its COMMITs and before its reply would be: it claims nothing new, cleans
    nothing again, and returns the claim and the settlement the first delivery wrote. An account
    whose deadline is after the range's end stays untouched."""
    start = window_start(datetime.now(UTC) - timedelta(seconds=30), 1.0)
    accounts = await seed(pool, start + timedelta(milliseconds=100), 5)
    accounts += await seed(pool, start + timedelta(milliseconds=900), 3)
    [outside] = await seed(pool, start + timedelta(seconds=1), 1)
    compiled = await CleanupActivities.create(pool, load_targets())
    activities = CleanupActivities(
        pool, compiled.partition_batch_sql, compiled.compiled, LoadBudget(pool, BudgetSettings(enabled=False))
    )
    cohort = SmallCohortInput(
        claim=ClaimChunkedInput(
            cleanup_id="small-twice", deadline_from=start, deadline_until=start + timedelta(seconds=1), partitions=1
        ),
        partition=CleanupPartitionInput(cleanup_id="small-twice", partition_no=0, batch_size=100),
        deadline=start,
    )
    first = await ActivityEnvironment().run(activities.clean_small_cohort, cohort)
    second = await ActivityEnvironment().run(activities.clean_small_cohort, cohort)
    assert first.claim.claimed == 8 and second.claim == first.claim
    assert (first.report.counts.cleaned, second.report.counts.cleaned) == (8, 0)
    assert first.settlement == second.settlement and first.settlement.cleaned == 8
    applied = await pool.fetchval(
        "SELECT count(*) FROM cleanup_applied WHERE cleanup_id = 'small-twice' AND account_id = ANY($1::text[])",
        accounts,
    )
    assert applied == 8
    assert await pool.fetchval("SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = 'small-twice'") == 1
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", outside) == "active"


def test_the_shipped_settings_keep_an_idle_day_small_and_a_cohort_inside_the_objective() -> None:
    """About 17 events an iteration (two steps and a timer, bench.planner_events): an idle day of
    iterations `max_idle_seconds` apart stays under 30,000 events; a sparse cohort's window plus the
    margin stays inside the objective."""
    s = PlannerSettings()
    assert 86_400 / s.max_idle_seconds * 17 <= 30_000
    assert s.cohort_seconds + s.COHORT_MARGIN_SECONDS <= s.lateness_objective_seconds


def test_an_account_of_a_sparse_cohort_is_not_overdue_before_its_window_ends() -> None:
    """The sweep waits the grace plus a sparse cohort's first account's wait for the window's end:
    it never takes an account from under a cohort still to wake. With 1 s buckets, the grace alone."""
    s = PlannerSettings()
    assert (s.cohort_seconds, s.overdue_after_seconds) == (9.0, s.sweep_grace_seconds + 8.0)
    assert PlannerSettings(lateness_objective_seconds=2).overdue_after_seconds == s.sweep_grace_seconds
    assert PlannerSettings(lateness_objective_seconds=0.5).cohort_seconds == s.bucket_seconds
