"""Activities of the deadline planner (workflows/deadline_planner.py).

Both are safe under at-least-once delivery: ensuring a bucket's cleanup twice finds the same run
(its ID comes from the bucket), and a repeated sweep re-counts and hands the same accounts to a
cleanup whose claim takes each account once. They use the worker's own Temporal client.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
from temporalio import activity

from cleanup.models import PLAN_DEADLINE_BUCKETS, SWEEP_OVERDUE_ACCOUNTS
from cleanup.planner import plan_buckets, sweep_overdue
from cleanup.planner_models import PlanTickInput, PlanTickResult, SweepInput, SweepResult


class PlannerActivities:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # Bucket cleanups this worker process already ensured (see `plan_buckets`).
        self.ensured_buckets: dict[str, datetime] = {}

    @activity.defn(name=PLAN_DEADLINE_BUCKETS)
    async def plan_deadline_buckets(self, input: PlanTickInput) -> PlanTickResult:
        """Ensure one sleeping cohort cleanup per upcoming deadline bucket (skip scan, bounded)."""
        return await plan_buckets(self.pool, activity.client(), input, self.ensured_buckets)

    @activity.defn(name=SWEEP_OVERDUE_ACCOUNTS)
    async def sweep_overdue_accounts(self, input: SweepInput) -> SweepResult:
        """Release stranded claims of closed cleanups, then sweep overdue active accounts."""
        return await sweep_overdue(self.pool, activity.client(), input, heartbeat=activity.heartbeat)
