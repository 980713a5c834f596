"""A planner whose every workflow task fails, as a bug or a non-deterministic change would (for
tests/test_planner.py). Sandbox-safe: imports nothing that imports asyncpg (DEVELOPERS.md)."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from cleanup.models import PLANNER_WORKFLOW


@workflow.defn(name=PLANNER_WORKFLOW)
class BrokenPlanner:
    @workflow.run
    async def run(self, input: Any) -> None:
        raise RuntimeError("a bug in the planner's own code")
