"""End to end: a cohort cleanup on real Temporal and real Postgres, with an in-process worker."""

from __future__ import annotations

import asyncio

from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import renew, start_cleanup
from tests.helpers import deadline_in, effect_counts, seed
from workflows.renewal_cleanup import RenewalCleanupWorkflow


async def test_cohort_cleanup_cleans_unrenewed_accounts_once(client, pool, task_queue, worker):
    deadline = deadline_in(4)
    accounts = await seed(pool, deadline, 500)
    renewed = accounts[:50]
    outcomes = await asyncio.gather(*(renew(client, pool, task_queue, a) for a in renewed))
    assert all(o.in_time for o in outcomes)
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=4))

    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()

    assert result.outcome == "cleaned"
    assert result.settlement is not None
    assert result.settlement.cleaned == 450
    assert result.settlement.skipped_renewed == 50
    counts = await effect_counts(pool)
    assert counts["applied"] == 450
    assert counts["reminders"] == 450
    assert counts["duplicate_reminders"] == 0
    assert counts["archived_matches"] == 450 * 5
    assert counts["settlements"] == 1
    left = await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = ANY($1::text[])", renewed)
    assert left == 50 * 2, "renewed accounts keep their data"
    assert await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves") == 50 * 2
