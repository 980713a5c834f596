"""The deadline planner's payloads: its settings, its workflow's input and status, and its
activities' inputs and results (names and IDs are in cleanup/models.py).

Kept apart from cleanup/models.py so the operator CLI does not build them at start-up. Imported by
workflows/deadline_planner.py inside the sandbox, so nothing here may import asyncpg.
"""

from __future__ import annotations

from typing import Literal

from cleanup.models import DEFAULTS, UtcDatetime
from core.config import CleanupDefaults
from core.config import PlannerSettings as PlannerSettings  # declared with every other setting
from core.model import Model

PlannerPhase = Literal["planning", "sweeping", "sleeping", "paused"]


class PlannerTotals(Model):
    runs: int = 1
    iterations: int = 0
    buckets_ensured: int = 0
    sweeps_started: int = 0
    overdue_swept: int = 0
    stranded_recovered: int = 0
    # Plan or sweep steps that failed for good (a non-retryable error): reported, the loop went on.
    step_failures: int = 0


class PlannerInput(Model):
    settings: PlannerSettings = PlannerSettings()
    # How the planner's cleanups run: the settings' defaults of whoever started the planner, the
    # same as an operator's cleanup takes (a run of 1.0 has none here: the built-in defaults).
    cleanups: CleanupDefaults = DEFAULTS
    paused: bool = False
    pause_reason: str = ""
    totals: PlannerTotals = PlannerTotals()
    lateness_watermark: UtcDatetime | None = None


class PlanTickInput(Model):
    settings: PlannerSettings
    cleanups: CleanupDefaults = DEFAULTS
    task_queue: str
    lateness_watermark: UtcDatetime | None = None


class PlanTickResult(Model):
    buckets: int
    first_bucket: UtcDatetime | None = None
    last_bucket: UtcDatetime | None = None
    lateness_watermark: UtcDatetime | None = None
    lateness_recorded: int = 0
    # The earliest active deadline the plan did not cover (beyond the horizon, or the cap), if any.
    next_unplanned: UtcDatetime | None = None
    # When the next plan is needed, from this one (seconds): before `next_unplanned` enters the
    # horizon; 0 when the cap cut the plan short; None when no later deadline is known.
    plan_again_in_seconds: float | None = None


class SweepInput(Model):
    settings: PlannerSettings
    cleanups: CleanupDefaults = DEFAULTS
    task_queue: str
    # The sweep cleanup the previous iteration started: while it still runs, no second one starts.
    previous_sweep_id: str | None = None
    # The planner iteration's instant (workflow time): the sweep cleanup's ID comes from it, so every
    # attempt of one step, even two at once, starts the same one.
    as_of: UtcDatetime


class SweepResult(Model):
    overdue: int
    oldest_overdue: UtcDatetime | None = None
    sweep_cleanup_id: str | None = None
    stranded_workflows: list[str] = []
    stranded_recovered: int = 0
    # Claiming workflows unknown to this namespace: their claims are kept in 'cleaning'.
    stranded_not_found: list[str] = []


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
    last_step_error: str | None = None
