"""A workflow and an activity that log through every kind of logger (for tests/test_observability.py).

Sandbox-safe: imports nothing but temporalio and the standard library.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy

plain = logging.getLogger("tests.plain")


@activity.defn
async def log_from_activity(text: str) -> str:
    activity.logger.info("sdk activity logger: %s", text)
    plain.info("plain logger in an activity: %s", text)
    return text


@workflow.defn
class LoggingWorkflow:
    @workflow.run
    async def run(self, text: str) -> str:
        workflow.logger.info("sdk workflow logger: %s", text)
        return await workflow.execute_activity(log_from_activity, text, start_to_close_timeout=timedelta(seconds=30))


# A task created while an activity runs copies the activity's context and may outlive it, as the
# asyncpg pool's reconnect task does. The test releases it after the workflow completed.
release_lingering = asyncio.Event()
lingering_done = asyncio.Event()


async def _linger(text: str) -> None:
    await release_lingering.wait()
    plain.warning("lingering task, after its activity: %s", text)
    activity.logger.warning("sdk logger in a lingering task: %s", text)
    lingering_done.set()


_tasks: set[asyncio.Task[None]] = set()


@activity.defn
async def spawn_lingering_task(text: str) -> str:
    task = asyncio.get_running_loop().create_task(_linger(text))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    plain.info("plain logger in an activity: %s", text)
    return text


@workflow.defn
class LingeringTaskWorkflow:
    @workflow.run
    async def run(self, text: str) -> str:
        return await workflow.execute_activity(spawn_lingering_task, text, start_to_close_timeout=timedelta(seconds=30))


# A step against the database that the test takes down under it (tests/test_outage.py): the test
# sets `database_step_body`; each run of the activity is counted.
database_step_body: Callable[[], Awaitable[object]] | None = None
database_step_started = asyncio.Event()
database_step_runs: list[int] = []


@activity.defn
async def database_step() -> list[int]:
    database_step_runs.append(activity.info().attempt)
    database_step_started.set()
    assert database_step_body is not None
    await database_step_body()
    return database_step_runs


@workflow.defn
class DatabaseStepWorkflow:
    @workflow.run
    async def run(self) -> list[int]:
        return await workflow.execute_activity(
            database_step,
            start_to_close_timeout=timedelta(seconds=120),
            retry_policy=RetryPolicy(maximum_attempts=1),  # only a re-run inside the attempt can succeed
        )
