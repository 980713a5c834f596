"""Record the cleanup and planner histories for the replay tests: `python -m tests.record_histories`.

One history per workflow, recorded by today's code (with DATABASE_URL pointing at a Postgres
server; a private Temporal dev server and a scratch database are started and removed):
- `renewal_cleanup.json`: a cohort of 200 accounts whose 4 partitions follow its claim (chunks of
  30, two claim streams, 2 partitions at a time), 5 accounts renewed before the deadline;
- `renewal_cleanup_small_cohort.json` and `renewal_cleanup_small_instant.json`: a range, and an
  instant, cohort of one partition as the planner starts them (cohorts that fit one batch), each
  claimed, cleaned and settled by one activity;
- `deadline_planner.json`: the planner while it starts a bucket cleanup and sweeps, sleeping at most
  2 s between iterations.
Re-record when a change to a workflow's commands is meant to ship without a patch (see
docs/decisions/0001-workflow-versioning.md); `python -m tests.record_ledger_histories` and
`python -m tests.record_outbox_histories` record the other two workflows.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import asyncpg
from temporalio.client import Client

from cleanup.inputs import StartCleanup
from cleanup.models import DEFAULTS, bucket_cleanup_id, planner_workflow_id
from cleanup.operations import renew, start_cleanup
from cleanup.planner import CohortRange, _start_cohort, ensure_planner
from cleanup.planner_models import PlannerSettings
from core import db
from core.config import Settings
from core.temporal import connect
from demo.fixture import create_game_schema
from devstack import embedded
from tests.helpers import deadline_in, seed, wait_until
from worker import build_activities, build_worker

HISTORIES = Path(__file__).resolve().parent / "histories"


@asynccontextmanager
async def scratch_stack(prefix: str) -> AsyncIterator[tuple[Client, asyncpg.Pool, str]]:
    """A private Temporal dev server, a migrated scratch database and a worker on a fresh queue."""
    admin_url = os.environ["DATABASE_URL"]
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    server = embedded.DevServer(Path(tempfile.mkdtemp()), port=None)
    await asyncio.to_thread(server.start)
    url = await db.create_database(admin_url, name)
    await create_game_schema(url)
    try:
        pool = await db.create_pool(url, max_size=8)
        client = await connect(Settings(temporal_address=server.address))
        task_queue = f"record-{uuid.uuid4().hex[:8]}"
        async with build_worker(client, task_queue, await build_activities(pool)):
            yield client, pool, task_queue
        await pool.close()
    finally:
        await db.drop_database(admin_url, name)
        await asyncio.to_thread(server.stop)


async def save(client: Client, name: str, workflow_id: str) -> None:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    (HISTORIES / f"{name}.json").write_text(history.to_json())
    print(f"recorded {name}: {len(history.events)} events")


async def record_cleanup(client: Client, pool: asyncpg.Pool, task_queue: str) -> None:
    deadline = deadline_in(3)
    accounts = await seed(pool, deadline, 200)
    cohort = await start_cleanup(
        client,
        pool,
        task_queue,
        StartCleanup(deadline=deadline, partitions=4, claim_chunk_size=30, claim_streams=2, max_parallel_partitions=2),
    )
    for account_id in accounts[:5]:
        await renew(client, pool, task_queue, account_id)
    await client.get_workflow_handle(cohort.workflow_id).result()
    await save(client, "renewal_cleanup", cohort.workflow_id)


async def record_small_cohort(client: Client, pool: asyncpg.Pool, task_queue: str) -> None:
    """A range cohort of one partition, as the planner starts one that fits a batch: 12 accounts at
    two deadlines, one renewed; claimed, cleaned and settled by one activity."""
    start = deadline_in(3).replace(microsecond=0)
    accounts = await seed(pool, start + timedelta(milliseconds=200), 6)
    accounts += await seed(pool, start + timedelta(milliseconds=700), 6)
    await renew(client, pool, task_queue, accounts[0])
    cohort = CohortRange(
        bucket_cleanup_id(start, 1000, task_queue), start, start + timedelta(seconds=1), "small cohort", partitions=1
    )
    await _start_cohort(client, task_queue, DEFAULTS, cohort)
    await client.get_workflow_handle(cohort.workflow_id).result()
    await save(client, "renewal_cleanup_small_cohort", cohort.workflow_id)
    instant = deadline_in(3)
    await seed(pool, instant, 5)
    alone = CohortRange(bucket_cleanup_id(instant, 0, task_queue), instant, None, "small instant", partitions=1)
    await _start_cohort(client, task_queue, DEFAULTS, alone)
    await client.get_workflow_handle(alone.workflow_id).result()
    await save(client, "renewal_cleanup_small_instant", alone.workflow_id)


async def record_planner(client: Client, pool: asyncpg.Pool, task_queue: str) -> None:
    bucketed = await seed(pool, deadline_in(3), 50)
    await renew(client, pool, task_queue, bucketed[0])
    settled = "SELECT count(*) FROM cleanup_settlements WHERE cleanup_id LIKE 'cleanup-bucket-%'"
    before = await pool.fetchval(settled)  # the small cohort's
    await ensure_planner(
        client, task_queue, PlannerSettings(tick_seconds=1, max_idle_seconds=2, iterations_per_run=1000)
    )

    async def bucket_settled() -> bool:
        return bool(await pool.fetchval(settled) > before)

    await wait_until(bucket_settled, within=120, interval=1)
    planner = planner_workflow_id(task_queue)
    await save(client, "deadline_planner", planner)
    await client.get_workflow_handle(planner).terminate("recorded")


async def main() -> None:
    async with scratch_stack("record_cleanup") as (client, pool, task_queue):
        await record_cleanup(client, pool, task_queue)
        await record_small_cohort(client, pool, task_queue)
        await record_planner(client, pool, task_queue)


if __name__ == "__main__":
    asyncio.run(main())
