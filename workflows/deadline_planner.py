"""DeadlinePlannerWorkflow: every account is cleaned at its deadline with nobody running a command.

A long-running loop (one per deployment, ID `deadline-planner`, ensured by every worker at start):
each iteration ensures one sleeping cohort cleanup per upcoming deadline bucket
(`plan_deadline_buckets`), then runs the safety net (`sweep_overdue_accounts`: stranded claims of
closed cleanups are released, overdue active accounts handed to a sweep cleanup), then sleeps until
the next plan is needed (the first unplanned deadline about to enter the horizon), at most
`max_idle_seconds` and at least `tick_seconds` (a `nudge` signal wakes it early). It continues as
new every `iterations_per_run` iterations so its history stays small. `pause` / `resume` signals
steer it; the `status` query shows it. The durable timers of the cohort cleanups are what fire at the deadlines.

Deterministic by construction: time from the workflow, all I/O in activities called by name, so
this module never imports asyncpg (see DEVELOPERS.md).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NoReturn, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from cleanup.errors import CLEANUP_RETRY
    from cleanup.models import (
        PLAN_DEADLINE_BUCKETS,
        PLANNER_NUDGE_SIGNAL,
        PLANNER_PAUSE_SIGNAL,
        PLANNER_RESUME_SIGNAL,
        PLANNER_WORKFLOW,
        STATUS_QUERY,
        SWEEP_OVERDUE_ACCOUNTS,
    )
    from cleanup.planner_models import (
        PlannerInput,
        PlannerPhase,
        PlannerStatus,
        PlannerTotals,
        PlanTickInput,
        PlanTickResult,
        SweepInput,
        SweepResult,
    )

_RETRY = CLEANUP_RETRY
T = TypeVar("T")
# Sleeps until the next plan is needed, bounded by `max_idle_seconds`, instead of every
# `tick_seconds` (1.0's histories tick: tests/histories/1.0_deadline_planner.json).
IDLE_SLEEP_PATCH = "planner-idle-sleep"


@workflow.defn(name=PLANNER_WORKFLOW)
class DeadlinePlannerWorkflow:
    @workflow.init
    def __init__(self, input: PlannerInput) -> None:
        self._input = input
        self._paused = input.paused
        self._pause_reason = input.pause_reason
        self._totals = input.totals
        self._phase: PlannerPhase = "paused" if input.paused else "planning"
        self._nudged = False
        self._last_plan: PlanTickResult | None = None
        self._last_sweep: SweepResult | None = None
        self._last_iteration_at: datetime | None = None
        self._watermark = input.lateness_watermark
        self._last_sweep_id: str | None = None
        self._last_step_error: str | None = None

    @workflow.run
    async def run(self, input: PlannerInput) -> PlannerTotals:
        """Plan, sweep, count, sleep, for ever; continued as new every `iterations_per_run` iterations.

        A step that fails for good (a non-retryable error) is reported and the loop goes on at the
        next tick: the planner is the one thing that must never stop.
        """
        iterations = 0
        while True:
            if self._paused:
                self._set_phase("paused")
                await workflow.wait_condition(lambda: not self._paused)
            self._set_phase("planning")
            plan = await self._plan()
            self._set_phase("sweeping")
            sweep = await self._sweep()
            self._last_iteration_at = workflow.now()
            self._count(plan, sweep)
            iterations += 1
            if iterations >= input.settings.iterations_per_run or workflow.info().is_continue_as_new_suggested():
                self._continue_as_new(input)
            await self._sleep(plan, sweep)

    async def _step(self, activity: str, arg: Any, result_type: type[T], bound: timedelta, summary: str) -> T | None:
        """Run one step of the loop, bounded by `bound`; None when it failed for good (reported, and
        the loop goes on)."""
        try:
            return await workflow.execute_activity(  # type: ignore[no-any-return]
                activity,
                arg,
                result_type=result_type,
                start_to_close_timeout=bound,
                # Both steps heartbeat: a worker that dies in one is noticed after this long and the
                # loop goes on elsewhere (without it a dead worker's plan step held it 2 minutes).
                heartbeat_timeout=timedelta(seconds=self._input.settings.step_heartbeat_seconds),
                retry_policy=_RETRY,
                summary=summary,
            )
        except ActivityError as err:
            cause = err.cause if err.cause is not None else err
            self._last_step_error = f"{summary}: {type(cause).__name__}: {cause}"
            workflow.logger.error("planner step failed for good, the loop goes on: %s", self._last_step_error)
            return None

    async def _plan(self) -> PlanTickResult | None:
        """Ensure the cohort cleanups of the upcoming buckets; None when the step failed for good."""
        plan = await self._step(
            PLAN_DEADLINE_BUCKETS,
            PlanTickInput(
                settings=self._input.settings,
                cleanups=self._input.cleanups,
                task_queue=workflow.info().task_queue,
                lateness_watermark=self._watermark,
            ),
            PlanTickResult,
            timedelta(minutes=2),
            "plan buckets",
        )
        if plan is not None:
            self._last_plan = plan
            self._watermark = plan.lateness_watermark
        return plan

    async def _sweep(self) -> SweepResult | None:
        """Release stranded claims and hand overdue accounts to a sweep cleanup; None when the step
        failed for good."""
        sweep = await self._step(
            SWEEP_OVERDUE_ACCOUNTS,
            SweepInput(
                settings=self._input.settings,
                cleanups=self._input.cleanups,
                task_queue=workflow.info().task_queue,
                previous_sweep_id=self._last_sweep_id,
                as_of=workflow.now(),
            ),
            SweepResult,
            # Bounded work per step (cleanup.planner.RELEASE_SECONDS_PER_STEP): an attempt that hangs
            # while heartbeating holds the loop this long, not half an hour.
            timedelta(minutes=5),
            "sweep",
        )
        if sweep is not None:
            self._last_sweep = sweep
            self._last_sweep_id = sweep.sweep_cleanup_id or self._last_sweep_id
        return sweep

    def _count(self, plan: PlanTickResult | None, sweep: SweepResult | None) -> None:
        """Add one iteration's results to the totals (a failed step counts as a step failure)."""
        swept = sweep is not None and bool(sweep.sweep_cleanup_id)
        t = self._totals
        self._totals = t.model_copy(
            update={
                "iterations": t.iterations + 1,
                "buckets_ensured": t.buckets_ensured + (plan.buckets if plan else 0),
                "sweeps_started": t.sweeps_started + (1 if swept else 0),
                "overdue_swept": t.overdue_swept + (sweep.overdue if sweep and swept else 0),
                "stranded_recovered": t.stranded_recovered + (sweep.stranded_recovered if sweep else 0),
                "step_failures": t.step_failures + (plan is None) + (sweep is None),
            }
        )

    def _continue_as_new(self, input: PlannerInput) -> NoReturn:
        """Start the next run with the pause, the totals and the watermark carried over (raises)."""
        workflow.continue_as_new(
            input.model_copy(
                update={
                    "paused": self._paused,
                    "pause_reason": self._pause_reason,
                    "totals": self._totals.model_copy(update={"runs": self._totals.runs + 1}),
                    "lateness_watermark": self._watermark,
                }
            )
        )

    async def _sleep(self, plan: PlanTickResult | None, sweep: SweepResult | None) -> None:
        """Wait until the next plan is needed, or less: a nudge or a pause wakes the loop at once."""
        self._set_phase("sleeping")
        self._nudged = False
        seconds = self._input.settings.tick_seconds
        if workflow.patched(IDLE_SLEEP_PATCH):
            seconds = self._idle_seconds(plan, sweep)
        try:
            await workflow.wait_condition(
                lambda: self._nudged or self._paused,
                timeout=timedelta(seconds=seconds),
                timeout_summary="planner tick",
            )
        except TimeoutError:
            pass

    def _idle_seconds(self, plan: PlanTickResult | None, sweep: SweepResult | None) -> float:
        """How long the loop may sleep: until the first unplanned deadline is about to enter the
        horizon, at most `max_idle_seconds` (which bounds how long a registration due sooner, an
        overdue account or a stranded claim waits for the next iteration), at least `tick_seconds`;
        after a failed step, one tick (it is tried again soon)."""
        s = self._input.settings
        if plan is None or sweep is None:
            return s.tick_seconds
        seconds = s.max_idle_seconds
        if plan.plan_again_in_seconds is not None:
            seconds = min(seconds, plan.plan_again_in_seconds)
        return max(s.tick_seconds, seconds)

    def _set_phase(self, phase: PlannerPhase) -> None:
        self._phase = phase
        t = self._totals
        detail = f"{phase}: {t.iterations} iterations, {t.buckets_ensured} buckets ensured"
        detail += f", {t.overdue_swept} overdue swept, {t.stranded_recovered} stranded claims recovered"
        if self._paused:
            detail += f" (paused: {self._pause_reason or 'no reason given'})"
        workflow.set_current_details(detail)

    @workflow.signal(name=PLANNER_PAUSE_SIGNAL)
    def pause(self, reason: str = "") -> None:
        """Stop planning and sweeping after the iteration in flight (started cleanups still run)."""
        self._paused = True
        self._pause_reason = reason

    @workflow.signal(name=PLANNER_RESUME_SIGNAL)
    def resume(self) -> None:
        self._paused = False
        self._pause_reason = ""

    @workflow.signal(name=PLANNER_NUDGE_SIGNAL)
    def nudge(self) -> None:
        """Plan now (a renewal moved a deadline close) instead of at the end of the tick."""
        self._nudged = True

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> PlannerStatus:
        return PlannerStatus(
            planner_id=workflow.info().workflow_id,
            phase=self._phase,
            paused=self._paused,
            pause_reason=self._pause_reason,
            settings=self._input.settings,
            totals=self._totals,
            last_plan=self._last_plan,
            last_sweep=self._last_sweep,
            last_iteration_at=self._last_iteration_at,
            last_step_error=self._last_step_error,
        )
