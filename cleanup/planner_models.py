"""The deadline planner's payloads: its settings, its workflow's input and status, and its
activities' inputs and results (names and IDs are in cleanup/models.py).

Kept apart from cleanup/models.py so the operator CLI does not build them at start-up. Imported by
workflows/deadline_planner.py inside the sandbox, so nothing here may import asyncpg.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field

from cleanup.models import UtcDatetime
from core.model import Model

PlannerPhase = Literal["planning", "sweeping", "sleeping", "paused"]


class PlannerSettings(Model):
    """The planner's knobs. Lateness L of a bucketed account: at most `bucket_seconds` plus the
    time to claim and clean; anything missed is caught by the sweep within
    `sweep_grace_seconds + tick_seconds`."""

    bucket_seconds: float = Field(default=1.0, ge=0.001, le=3600)
    # A bucket's cleanup wakes this long before the bucket ends; its claim waits for the database
    # clock, so the timer's and the dispatch's latency come before the deadline instead of after.
    wake_early_seconds: float = Field(default=0.5, ge=0, le=10)
    horizon_seconds: float = Field(default=120.0, ge=1, le=86_400)
    tick_seconds: float = Field(default=5.0, ge=0.1, le=30)
    sweep_grace_seconds: float = Field(default=10.0, ge=0, le=3600)
    max_buckets_per_tick: int = Field(default=1000, ge=1, le=10_000)
    partitions: int = Field(default=8, ge=1, le=256)
    max_parallel_partitions: int = Field(default=4, ge=1, le=256)
    batch_size: int = Field(default=1000, ge=1, le=20_000)
    claim_chunk_size: int = Field(default=10_000, ge=1, le=100_000)
    iterations_per_run: int = Field(default=50, ge=1, le=10_000)
    # The plan and sweep steps heartbeat; a worker that dies in one is noticed after this long.
    step_heartbeat_seconds: float = Field(default=10.0, ge=1, le=600)

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
    # Plan or sweep steps that failed for good (a non-retryable error): reported, the loop went on.
    step_failures: int = 0


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
