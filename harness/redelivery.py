"""The harness's workflow that delivers the same activity task again, through real Temporal.

Kept free of asyncpg imports (the workflow sandbox re-imports this module). Activities are called
by name, so the worker that registers it needs nothing else.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.common import RetryPolicy


class Redelivery(BaseModel):
    activity: str
    arg: dict[str, Any]
    times: int = Field(default=2, ge=1, le=100)
    start_to_close_seconds: float = Field(default=60.0, gt=0)


@workflow.defn
class HarnessRedeliverWorkflow:
    """Run `activity(arg)` `times` times in a row; each delivery is retried like production ones."""

    @workflow.run
    async def run(self, input: Redelivery) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        for _ in range(input.times):
            result = await workflow.execute_activity(
                input.activity,
                input.arg,
                result_type=dict,
                start_to_close_timeout=timedelta(seconds=input.start_to_close_seconds),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5)),
            )
            results.append(result)
        return results
