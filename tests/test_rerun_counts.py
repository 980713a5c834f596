"""A partition attempt run again inside the same activity after its database restarted (core.outage)
resumes after its last committed batch: each account is counted once, and the partition reports
add up to the cohort whatever the number of restarts."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import Client

from cleanup.inputs import StartCleanup
from cleanup.models import CLEANUP_PARTITION, CleanupResult
from cleanup.operations import start_cleanup
from core import db, failpoints, outage
from demo.fixture import create_game_schema
from tests.helpers import deadline_in, seed
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

ACCOUNTS = 600
BATCH = 50
# Restarts of the database before these batches of the cohort's one partition: with one partition no
# other batch is in flight when the database goes down, so none is lost between its COMMIT and the
# client hearing of it (such a batch is rightly counted `already_applied` by the re-run).
RESTART_AT = {3, 6, 9}


async def test_partition_reports_add_up_to_the_cohort_after_database_restarts_between_batches(
    client: Client, task_queue: str
) -> None:
    from harness.private_pg import PrivatePostgres

    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    await db.migrate_url(pg.admin_url)
    await create_game_schema(pg.admin_url)
    pool = await db.create_pool(pg.admin_url, max_size=4, on_connect=outage.OUTAGE.back)
    batches = 0
    restarting: list[asyncio.Task[None]] = []

    async def restart_later() -> None:
        await asyncio.sleep(1.5)  # down long enough for the attempt to see it unreachable
        await asyncio.to_thread(pg.restart)

    async def before_batch(_: Any) -> None:
        nonlocal batches
        batches += 1
        if batches in RESTART_AT:
            await asyncio.to_thread(pg.crash)  # every backend dies, committed batches stay
            restarting.append(asyncio.create_task(restart_later()))

    try:
        deadline = deadline_in(-60)
        await seed(pool, deadline, ACCOUNTS)
        failpoints.set_hook(f"{CLEANUP_PARTITION}.before_batch", before_batch)
        async with build_worker(client, task_queue, await build_activities(pool), pool=pool):
            started = await start_cleanup(
                client, pool, task_queue, StartCleanup(deadline=deadline, partitions=1, batch_size=BATCH)
            )
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
            result: CleanupResult = await asyncio.wait_for(handle.result(), 300)
        failpoints.set_hook(f"{CLEANUP_PARTITION}.before_batch", None)
        await asyncio.gather(*restarting)
        reports = await pool.fetch(
            "SELECT cleaned, skipped_renewed, skipped_stale, already_applied, failed"
            " FROM cleanup_partition_reports WHERE cleanup_id = $1",
            started.workflow_id,
        )
        applied = await pool.fetchval("SELECT count(*) FROM cleanup_applied")
    finally:
        failpoints.set_hook(f"{CLEANUP_PARTITION}.before_batch", None)
        pool.terminate()
        await asyncio.to_thread(pg.close)

    assert pg.restarts == len(RESTART_AT), "the database restarted between batches, as planned"
    assert applied == ACCOUNTS, "cleaned exactly once"
    assert result.outcome == "cleaned" and result.settlement is not None
    assert sum(r["cleaned"] for r in reports) == ACCOUNTS, [dict(r) for r in reports]
    assert sum(r["already_applied"] for r in reports) == 0, "no batch of this run was counted twice"
    assert sum(sum(r.values()) for r in reports) == ACCOUNTS, "the reports add up to the cohort"
    assert (result.settlement.cleaned, result.settlement.already_applied) == (ACCOUNTS, 0)
