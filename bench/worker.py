"""The ordinary worker plus the benchmarks' bare reference workflow: `python -m bench.worker`."""

from __future__ import annotations

import asyncio
import logging
import signal

import worker as app_worker
from bench.bare_workflow import BareDeadlineWorkflow, noop
from core import db, embedded
from core.config import Settings
from core.temporal import connect


async def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    settings = embedded.resolve(Settings.from_env())
    assert settings.database_url is not None
    pool = await db.create_pool(settings.database_url, max_size=settings.pool_max_size)
    client = await connect(settings)
    activities = [*(await app_worker.build_activities(pool)), noop]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    w = app_worker.build_worker(
        client,
        settings.task_queue,
        activities,
        max_concurrent_activities=settings.max_concurrent_activities,
        extra_workflows=[BareDeadlineWorkflow],
    )
    async with w:
        await stop.wait()
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
