"""Record workflow histories for the replay tests: `python -m tests.record_histories`.

Re-record only when a change is meant to break compatibility with running workflows; the point
of the recorded files is that today's code must replay yesterday's histories (sleeps last days).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from cleanup.operations import renew, start_cleanup
from core import db, embedded
from core.config import Settings
from core.temporal import connect
from tests.helpers import deadline_in, seed
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

HISTORIES = Path(__file__).resolve().parent / "histories"


async def main() -> None:
    settings = embedded.resolve(Settings.from_env())
    assert settings.database_url is not None
    await db.migrate_url(settings.database_url)
    pool = await db.create_pool(settings.database_url)
    client = await connect(settings)
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
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
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
