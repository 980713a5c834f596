"""The benchmarks' reference workflow, in a module of its own: the sandbox re-imports it."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import activity, workflow


@activity.defn
async def noop() -> None:
    return None


@workflow.defn
class BareDeadlineWorkflow:
    """The reference: sleep to a deadline, run one no-op activity, finish."""

    @workflow.run
    async def run(self, deadline: datetime) -> None:
        remaining = deadline - workflow.now()
        if remaining > timedelta(0):
            await workflow.sleep(remaining)
        await workflow.execute_activity(noop, start_to_close_timeout=timedelta(seconds=60))
