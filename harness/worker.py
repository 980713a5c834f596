"""The ordinary worker plus the harness's redelivery workflow: `python -m harness.worker`.

Same activities and workflows as `worker.py` (built with its own functions); it prints
`HARNESS_WORKER_READY pid=N` once it polls, so the supervisor knows when a (re)started process is up.
Failpoints come from CLEANUP_FAILPOINTS like for any worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import worker as app_worker
from core.config import Settings
from core.temporal import connect
from harness.redelivery import HarnessRedeliverWorkflow

READY = "HARNESS_WORKER_READY"


async def main() -> None:
    settings = Settings.from_env()
    app_worker.configure_logs(secrets=sorted(settings.secrets()), level=logging.INFO)
    assert settings.database_url is not None and settings.temporal_address is not None
    pool = await app_worker.open_pool(settings.database_url, settings.pool_max_size)
    try:
        client = await connect(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        w = app_worker.build_worker(
            client,
            settings.task_queue,
            await app_worker.build_activities(pool),
            max_concurrent_activities=settings.max_concurrent_activities,
            extra_workflows=[HarnessRedeliverWorkflow],
            pool=pool,
        )
        async with w:
            print(f"{READY} pid={os.getpid()} failpoints={os.environ.get('CLEANUP_FAILPOINTS', '')}", flush=True)
            await stop.wait()
    finally:
        await pool.close()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(130)
