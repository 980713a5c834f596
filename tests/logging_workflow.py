"""A workflow and an activity that log through every kind of logger (for tests/test_observability.py).

Sandbox-safe: imports nothing but temporalio and the standard library.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from temporalio import activity, workflow

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
