"""A workflow whose step finishes while its worker shuts down (for tests/test_worker_shutdown.py).

Sandbox-safe: imports nothing but temporalio and the standard library.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity, workflow

step_started = asyncio.Event()
release = asyncio.Event()


@activity.defn
async def finish_when_released() -> str:
    """Runs until the test releases it: work that simply finishes, here just as its worker is told
    to stop."""
    step_started.set()
    await release.wait()
    return "finished"


@activity.defn
async def next_step() -> str:
    return "done"


@workflow.defn
class HandOffWorkflow:
    @workflow.run
    async def run(self) -> str:
        await workflow.execute_activity(finish_when_released, start_to_close_timeout=timedelta(seconds=60))
        return await workflow.execute_activity(next_step, start_to_close_timeout=timedelta(seconds=60))
