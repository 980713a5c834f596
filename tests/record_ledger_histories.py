"""Record the ledger histories for the replay tests: `python -m tests.record_ledger_histories`.

With DATABASE_URL pointing at a Postgres server (a private Temporal dev server and a scratch
database are started and removed): the scheduled parent run by hand for a small ledger day
(`scheduled_ledger_reconciliation.json`) and the night it starts, two shards
(`ledger_reconciliation.json`).
"""

from __future__ import annotations

import asyncio
from datetime import date

from ledger.models import ScheduledLedgerInput
from tests.ledger_helpers import id_prefix, seed_day
from tests.record_histories import save, scratch_stack
from workflows.ledger_reconciliation import ScheduledLedgerReconciliationWorkflow

D = date(2026, 10, 25)


async def main() -> None:
    async with scratch_stack("record_ledger") as (client, pool, task_queue):
        await seed_day(pool, D, payments=200, shards=2)
        parent_id = f"{id_prefix(task_queue)}-scheduled"
        result = await client.execute_workflow(
            ScheduledLedgerReconciliationWorkflow.run,
            ScheduledLedgerInput(
                business_date=D, id_prefix=id_prefix(task_queue), shards=2, batch_size=50, heartbeat_timeout_seconds=2.0
            ),
            id=parent_id,
            task_queue=task_queue,
        )
        await save(client, "scheduled_ledger_reconciliation", parent_id)
        await save(client, "ledger_reconciliation", result.workflow_id)


if __name__ == "__main__":
    asyncio.run(main())
