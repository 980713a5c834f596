"""Heartbeat while one statement runs, and cancel the statement with its activity."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
