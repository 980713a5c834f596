"""How the workflows call their long steps: a cleanup partition, a claim stream, a ledger shard.

Deterministic (no I/O, no clock) and free of asyncpg, like every module the workflows import.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy

T = TypeVar("T")

# A long step heartbeats while it runs, so a worker that dies in it is noticed within the heartbeat
# timeout, while a live one may run as long as its share of a large cohort or shard takes. The
# start-to-close only bounds a step that keeps heartbeating and never ends.
LONG_STEP_TIMEOUT = timedelta(hours=2)


async def long_step(
    activity: str,
    arg: Any,
    result_type: type[T],
    *,
    heartbeat_timeout_seconds: float,
    retry_policy: RetryPolicy,
    summary: str,
) -> T:
    """Run the activity `activity` (by name) as a long step: judged by its heartbeat, bounded by
    LONG_STEP_TIMEOUT, retried by `retry_policy`, shown in the UI as `summary`."""
    return await workflow.execute_activity(  # type: ignore[no-any-return]
        activity,
        arg,
        result_type=result_type,
        start_to_close_timeout=LONG_STEP_TIMEOUT,
        heartbeat_timeout=timedelta(seconds=heartbeat_timeout_seconds),
        retry_policy=retry_policy,
        summary=summary,
    )
