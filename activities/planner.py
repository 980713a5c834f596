"""Activities of the deadline planner (workflows/deadline_planner.py).

Both are safe under at-least-once delivery: ensuring a bucket's cleanup twice finds the same run
(its ID comes from the bucket), and a repeated sweep re-counts and hands the same accounts to a
cleanup whose claim takes each account once. They use the worker's own Temporal client, and
heartbeat while they run, so a worker that dies in one is noticed after the heartbeat timeout
(not the start-to-close timeout) and the planner's loop goes on elsewhere. Failpoints right after
their effects (`plan_deadline_buckets.after_start`, `sweep_overdue_accounts.after_commit`) let the
fault harness kill a worker there.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
from temporalio import activity

from cleanup.models import PLAN_DEADLINE_BUCKETS, SWEEP_OVERDUE_ACCOUNTS
from cleanup.planner import plan_buckets, sweep_overdue
from cleanup.planner_models import PlanTickInput, PlanTickResult, SweepInput, SweepResult
from core import failpoints
from core.heartbeat import run_heartbeating


def _beat_every() -> float:
    """A third of the activity's heartbeat timeout (5 s for runs scheduled without one)."""
    timeout = activity.info().heartbeat_timeout
    return max(0.1, timeout.total_seconds() / 3) if timeout else 5.0


class PlannerActivities:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # Bucket cleanups this worker process already ensured (see `plan_buckets`).
        self.ensured_buckets: dict[str, datetime] = {}

    @activity.defn(name=PLAN_DEADLINE_BUCKETS)
    async def plan_deadline_buckets(self, input: PlanTickInput) -> PlanTickResult:
        """Ensure one sleeping cohort cleanup per upcoming deadline bucket (skip scan, bounded)."""
        result = await run_heartbeating(
            plan_buckets(self.pool, activity.client(), input, self.ensured_buckets),
            activity.heartbeat,
            _beat_every(),
        )
        failpoints.hit(f"{PLAN_DEADLINE_BUCKETS}.after_start")
        return result

    @activity.defn(name=SWEEP_OVERDUE_ACCOUNTS)
    async def sweep_overdue_accounts(self, input: SweepInput) -> SweepResult:
        """Release stranded claims of closed cleanups, then sweep overdue active accounts."""
        result = await run_heartbeating(
            sweep_overdue(self.pool, activity.client(), input, heartbeat=activity.heartbeat),
            activity.heartbeat,
            _beat_every(),
        )
        if result.sweep_cleanup_id or result.stranded_recovered:
            failpoints.hit(f"{SWEEP_OVERDUE_ACCOUNTS}.after_commit")
        return result
