"""A test-only workflow that delivers the same activity task again, through real Temporal.

At-least-once delivery means any activity may run twice; this makes "twice" happen on purpose.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel
from temporalio import workflow


class Redelivery(BaseModel):
    activity: str
    arg: dict[str, Any]
    times: int = 2


@workflow.defn
class RedeliverActivityWorkflow:
    @workflow.run
    async def run(self, input: Redelivery) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        for _ in range(input.times):
            result = await workflow.execute_activity(
                input.activity,
                input.arg,
                result_type=dict,
                start_to_close_timeout=timedelta(seconds=60),
            )
            results.append(result)
        return results
