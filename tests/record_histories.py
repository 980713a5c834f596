"""Record workflow histories for the replay tests: `python -m tests.record_histories`.

Re-record only when a change is meant to break compatibility with running workflows; the point
of the recorded files is that today's code must replay yesterday's histories (sleeps last days).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import asyncpg
from temporalio.client import Client, WorkflowFailureError

from cleanup.operations import renew, start_cleanup
from core import db, embedded
from core.config import Settings
from core.temporal import connect
from demo.fixture import create_game_schema
from tests.helpers import deadline_in, seed
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

HISTORIES = Path(__file__).resolve().parent / "histories"
# Recorded after the `chunked-claim` patch: `python -m tests.record_histories planner`
# records only these, so the files recorded before it keep proving that older runs replay.
PLANNER_HISTORIES = ("chunked_cohort_completed", "bucket_cohort_completed", "deadline_planner_running")


async def record_failed_tolerance(client: Client, pool: asyncpg.Pool, task_queue: str) -> None:
    """A cohort with one account poisoned by a trigger and `max_failed=0`: the run settles, then
    fails behind the `failed-tolerance` patch."""
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 20)
    await pool.execute(
        """
        CREATE OR REPLACE FUNCTION record_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'inventory of % is under legal hold', OLD.account_id;
        END $$
        """
    )
    await pool.execute(
        "CREATE TRIGGER record_poison BEFORE DELETE ON demo_game.inventory_items FOR EACH ROW"
        f" WHEN (OLD.account_id = '{accounts[7]}') EXECUTE FUNCTION record_poison()"
    )
    try:
        started = await start_cleanup(client, pool, task_queue, deadline=deadline, partitions=2, max_failed=0)
        try:
            await client.get_workflow_handle(started.workflow_id).result()
            raise AssertionError("the run should have failed its tolerance")
        except WorkflowFailureError:
            pass
        history = await client.get_workflow_handle(started.workflow_id).fetch_history()
        (HISTORIES / "cohort_failed_tolerance.json").write_text(history.to_json())
        print(f"recorded cohort_failed_tolerance: {len(history.events)} events")
    finally:
        await pool.execute("DROP TRIGGER record_poison ON demo_game.inventory_items; DROP FUNCTION record_poison()")


async def record_renewed_phase_kept(client: Client, pool: asyncpg.Pool, task_queue: str) -> None:
    """A single-account cleanup ended by a renewal, after the `renewed-phase-kept` patch: it settles
    without upserting `settling`/`settled` over the phase `renewed`."""
    [account] = await seed(pool, deadline_in(3600), 1)
    single = await start_cleanup(client, pool, task_queue, account_id=account)
    await renew(client, pool, task_queue, account)
    await client.get_workflow_handle(single.workflow_id).result()
    history = await client.get_workflow_handle(single.workflow_id).fetch_history()
    (HISTORIES / "single_account_renewed_phase_kept.json").write_text(history.to_json())
    print(f"recorded single_account_renewed_phase_kept: {len(history.events)} events")


async def record_overlapped_claim(
    client: Client,
    pool: asyncpg.Pool,
    task_queue: str,
    name: str = "overlapped_cohort_completed",
    streams: int = 1,
    parallel: int = 8,
) -> None:
    """A cohort after the `claim-overlap` patch: every partition starts with the claim (chunks of
    30 accounts, in `streams` claim streams) and follows it; some accounts renewed before the
    deadline. `overlapped_cohort_completed` was recorded before claim streams existed (one claim);
    `capped_cohort_completed` after the `following-partitions-at-once` patch (4 partitions, 2 at a
    time: 2 run)."""
    deadline = deadline_in(3)
    accounts = await seed(pool, deadline, 200)
    cohort = await start_cleanup(
        client,
        pool,
        task_queue,
        deadline=deadline,
        partitions=4,
        claim_chunk_size=30,
        claim_streams=streams,
        max_parallel_partitions=parallel,
    )
    for account_id in accounts[:5]:
        await renew(client, pool, task_queue, account_id)
    await client.get_workflow_handle(cohort.workflow_id).result()
    history = await client.get_workflow_handle(cohort.workflow_id).fetch_history()
    (HISTORIES / f"{name}.json").write_text(history.to_json())
    print(f"recorded {name}: {len(history.events)} events")


async def main(only: list[str] | None = None) -> None:
    settings = embedded.resolve(Settings.from_env())
    assert settings.database_url is not None
    await db.migrate_url(settings.database_url)
    await create_game_schema(settings.database_url)
    pool = await db.create_pool(settings.database_url)
    client = await connect(settings)
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    if only == ["cohort_failed_tolerance"]:  # record just the newest one, leave the others as they are
        async with build_worker(client, task_queue, await build_activities(pool)):
            await record_failed_tolerance(client, pool, task_queue)
        await pool.close()
        return
    if only == ["two_stream_cohort_completed"]:
        async with build_worker(client, task_queue, await build_activities(pool)):
            await record_overlapped_claim(client, pool, task_queue, "two_stream_cohort_completed", streams=2)
        await pool.close()
        return
    if only == ["capped_cohort_completed"]:
        async with build_worker(client, task_queue, await build_activities(pool)):
            await record_overlapped_claim(client, pool, task_queue, "capped_cohort_completed", streams=2, parallel=2)
        await pool.close()
        return
    if only == ["single_account_renewed_phase_kept"]:
        async with build_worker(client, task_queue, await build_activities(pool)):
            await record_renewed_phase_kept(client, pool, task_queue)
        await pool.close()
        return
    async with build_worker(client, task_queue, await build_activities(pool)):
        sleeping_deadline = deadline_in(2 * 24 * 3600)
        await seed(pool, sleeping_deadline, 20)
        sleeping = await start_cleanup(client, pool, task_queue, deadline=sleeping_deadline, partitions=4)
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, sleeping.workflow_id)
        await handle.query(RenewalCleanupWorkflow.status)  # the first task has run: the timer exists

        deadline = deadline_in(3)
        accounts = await seed(pool, deadline, 200)
        cohort = await start_cleanup(client, pool, task_queue, deadline=deadline, partitions=4)
        single = await start_cleanup(client, pool, task_queue, account_id=accounts[0])
        for account_id in accounts[:5]:
            await renew(client, pool, task_queue, account_id)
        await client.get_workflow_handle(cohort.workflow_id).result()
        await client.get_workflow_handle(single.workflow_id).result()

        for name, workflow_id in [
            ("cohort_mid_sleep", sleeping.workflow_id),
            ("cohort_completed", cohort.workflow_id),
            ("single_account_renewed", single.workflow_id),
        ]:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
            (HISTORIES / f"{name}.json").write_text(history.to_json())
            print(f"recorded {name}: {len(history.events)} events")
        await handle.terminate("recorded")
        await record_failed_tolerance(client, pool, task_queue)
        await record_renewed_phase_kept(client, pool, task_queue)
    await pool.close()


async def record_planner() -> None:
    from cleanup.models import planner_workflow_id
    from cleanup.planner import ensure_planner
    from cleanup.planner_models import PlannerSettings

    settings = embedded.resolve(Settings.from_env())
    assert settings.database_url is not None
    await db.migrate_url(settings.database_url)
    await create_game_schema(settings.database_url)
    pool = await db.create_pool(settings.database_url)
    client = await connect(settings)
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    async with build_worker(client, task_queue, await build_activities(pool)):
        deadline = deadline_in(3)
        await seed(pool, deadline, 200)
        bucketed = await seed(pool, deadline_in(6), 50)
        cohort = await start_cleanup(client, pool, task_queue, deadline=deadline, partitions=4)
        await renew(client, pool, task_queue, bucketed[0])
        await ensure_planner(client, task_queue, PlannerSettings(tick_seconds=1, iterations_per_run=1000))
        await client.get_workflow_handle(cohort.workflow_id).result()
        bucket_id = None
        while bucket_id is None:
            await asyncio.sleep(1)
            bucket_id = await pool.fetchval(
                "SELECT cleanup_id FROM cleanup_settlements WHERE cleanup_id LIKE 'cleanup-bucket-%' LIMIT 1"
            )
        planner = planner_workflow_id(task_queue)
        for name, workflow_id in zip(PLANNER_HISTORIES, [cohort.workflow_id, bucket_id, planner], strict=True):
            history = await client.get_workflow_handle(workflow_id).fetch_history()
            (HISTORIES / f"{name}.json").write_text(history.to_json())
            print(f"recorded {name}: {len(history.events)} events")
        await client.get_workflow_handle(planner).terminate("recorded")
    await pool.close()


if __name__ == "__main__":
    # `python -m tests.record_histories` records them all; `... cohort_failed_tolerance` only that one.
    asyncio.run(main(sys.argv[1:] or None))
