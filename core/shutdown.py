"""A worker shutting down hands the workflow's next step to another worker, not to itself.

When a worker begins a graceful shutdown (SIGTERM), its workflow-task polls still open can take a
workflow task from the server for a few tenths of a second; the SDK then drops that task, and the
workflow waits out the workflow task timeout (5 s) before another worker gets it. An activity that
completes during the shutdown triggers exactly such a task (the workflow's next step), and the
server sends it to this worker's sticky queue. So `HandOffInterceptor` holds the completion of an
activity that finished once the process was told to stop (`begin()`, called by worker.py's SIGTERM
handler) for `pause` seconds: by then the worker no longer polls, the server has released its
sticky queue, and the next step starts on another worker at once. Activities handed back (a
failure retried by the server) and local activities (completed inside the workflow task this
worker already holds) are not held.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

HAND_OFF_PAUSE_SECONDS = 0.5
_STOPPING: list[bool] = []


def begin() -> None:
    """The process was told to stop (SIGTERM, SIGINT): hold completions from now on."""
    _STOPPING[:] = [True]


def stopping() -> bool:
    return bool(_STOPPING) or (activity.in_activity() and activity.is_worker_shutdown())


class HandOffInterceptor(Interceptor):
    def __init__(self, pause: float = HAND_OFF_PAUSE_SECONDS) -> None:
        self.pause = pause

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _HandOff(next, self.pause)


class _HandOff(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, pause: float) -> None:
        super().__init__(next)
        self.pause = pause

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        result = await super().execute_activity(input)
        # A signal already delivered is handled by the event loop a few iterations later (its
        # wakeup pipe is read, then the handler is queued): let it run before deciding.
        for _ in range(3):
            await asyncio.sleep(0)
        if stopping() and not activity.info().is_local:
            await asyncio.sleep(self.pause)
        return result
