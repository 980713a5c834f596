"""Heartbeats: the shared timeout default, and heartbeating while a statement or a step runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

T = TypeVar("T")

# Every job's heartbeat timeout defaults to this (cleanup partitions and claims, ledger shards and
# settlements, outbox relay batches): a worker that dies (kill -9, a lost node) is noticed within
# it, and its work resumes on another worker after the retry's first interval (core.errors, 1 s)
# and the server's timer and dispatch latency (a few tenths of a second), so within about 8.5 s,
# under the 10 s goal with room for a loaded machine. A worker stopped with SIGTERM hands its work
# back at once instead.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 7.0

# The start-to-close of a long step that heartbeats (a cleanup partition, a claim stream, a ledger
# shard): its heartbeat timeout is what notices a dead worker, so this only bounds a step that keeps
# heartbeating and never ends, and is long enough for a live one's share of a large cohort or shard.
LONG_STEP_TIMEOUT = timedelta(hours=2)

# How often a running activity's heartbeat reaches the server at most (the SDK buffers the calls in
# between). Temporal's default is 80% of the heartbeat timeout, which leaves a loaded worker only a
# fifth of the timeout to spare; sending the activity's own heartbeats (a third of the timeout)
# promptly keeps a live but busy worker far from being judged dead.
MAX_HEARTBEAT_THROTTLE = timedelta(seconds=1)


async def run_heartbeating(statement: Awaitable[T], beat: Callable[[], None] | None, interval: float) -> T:
    """Await `statement`, calling `beat` every `interval` seconds while it runs.

    A batch blocked on a row lock or simply slow is then not mistaken for a dead worker. When the
    caller is cancelled (the activity was cancelled or timed out), the statement is cancelled too:
    asyncpg cancels the query on the server and its transaction rolls back, instead of an orphan
    statement running on beside the retry.
    """
    if beat is None:
        return await statement
    task = asyncio.ensure_future(statement)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            beat()
    except BaseException:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task  # the query is cancelled on the server before the connection goes back
        raise


@contextlib.asynccontextmanager
async def heartbeating(beat: Callable[[], None], interval: float) -> AsyncIterator[None]:
    """Call `beat` now and every `interval` seconds until the block ends: for a step made of several
    statements or requests, so that waiting on any of them never looks like a dead worker."""

    async def loop() -> None:
        while True:
            beat()
            await asyncio.sleep(interval)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
