"""A database clock far behind the timer is reported (WARNING, `planner status`) and waited for:
the claim never runs ahead of the renewal rule's clock, and never ends the run as if nothing were due."""

from __future__ import annotations

import logging

from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from cleanup.planner import planner_status
from tests.helpers import deadline_in, seed, shift_database_clock, wait_until
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

BEHIND = 120  # seconds the database clock is set behind: far more than a claim waits for it


async def test_a_database_clock_far_behind_is_reported_and_waited_for_not_ended_stale(client, pool, task_queue, caplog):
    caplog.set_level(logging.WARNING)
    [account] = await seed(pool, deadline_in(-2), 1)  # due by every clock but the skewed database's
    await shift_database_clock(pool, f"-{BEHIND} seconds")
    async with build_worker(client, task_queue, await build_activities(pool)):
        started = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))

        async def reported() -> bool:  # the claim (a local activity for one account) says so
            return "behind the timer: " + started.workflow_id in caplog.text

        await wait_until(reported, within=90)
        status = await planner_status(client, pool, task_queue)
        assert "behind the timer of" in str(status.database_clock_behind)
        assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", account) == "active"

        # The database clock catches up: the same run claims and cleans the account.
        await shift_database_clock(pool, None)
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await handle.result()
    assert result.outcome == "cleaned", result
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", account) == "cleaned"
