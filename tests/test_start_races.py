"""A start that finds the run already there says so: `already running: <workflow id> (run <run id>)`
from the CLI, `joined=True` from the Python API, whether the run was there before the start or a
racing start created it between this one's look and its start (USE_EXISTING hands the running run
back; the server's answer says it did not start one). No worker polls these task queues: every run
stays RUNNING for the whole test."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from datetime import date

import pytest_asyncio
from temporalio.client import Client
from temporalio.service import RPCError

from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from core.config import Settings
from core.temporal import StartOutcome, WorkflowStart, start_idempotently
from ledger.models import LEDGER_WORKFLOW
from ledger.operations import ReconcileRequest, start_reconciliation
from tests.helpers import deadline_in, seed
from tests.ledger_helpers import seed_day
from tests.test_cleanup_input import run_cli_all


@pytest_asyncio.fixture
async def started_ids(client: Client) -> AsyncIterator[list[str]]:
    """Workflow IDs a test started: terminated at its end (no worker would ever finish them)."""
    ids: list[str] = []
    yield ids
    for workflow_id in set(ids):
        with contextlib.suppress(RPCError):  # closed already: nothing to stop
            await client.get_workflow_handle(workflow_id).terminate(reason="test over")


def a_date() -> date:
    """A past business date, most likely used by no other test (its workflow ID is the date's)."""
    return date(random.randint(1990, 2020), random.randint(1, 12), random.randint(1, 28))  # past: reconcilable


async def test_the_second_of_two_racing_starts_joins_the_first(client: Client, task_queue: str, started_ids) -> None:
    """The platform call itself, where the race is decided: both pass any look before starting."""
    workflow_id = f"race-{task_queue}"
    started_ids.append(workflow_id)

    async def start() -> StartOutcome:
        return await start_idempotently(
            client, WorkflowStart(LEDGER_WORKFLOW, None, workflow_id=workflow_id, task_queue=task_queue, summary="race")
        )

    first, second = await asyncio.gather(start(), start())
    assert sorted([first.started, second.started]) == [False, True], (first, second)
    assert first.joined is not first.started and second.joined is not second.started
    assert first.run_id == second.run_id == (await client.get_workflow_handle(workflow_id).describe()).run_id


async def test_a_reconciliation_started_twice_is_started_once_and_joined_once(
    client: Client, pool, task_queue: str, started_ids
) -> None:
    day = a_date()
    await seed_day(pool, day, payments=20, shards=2)
    racing = await asyncio.gather(
        *(start_reconciliation(client, pool, task_queue, ReconcileRequest(business_date=day)) for _ in range(2))
    )
    started_ids.append(racing[0].workflow_id)
    assert sorted(r.started for r in racing) == [False, True] and sorted(r.joined for r in racing) == [False, True]
    later = await start_reconciliation(
        client, pool, task_queue, ReconcileRequest(business_date=day)
    )  # found by its look: joined too
    assert later.joined and not later.started
    assert racing[0].run_id == racing[1].run_id == later.run_id


async def test_two_reconcile_commands_print_started_and_already_running(
    client: Client, pool, settings: Settings, started_ids
) -> None:
    day = a_date().isoformat()
    await seed_day(pool, date.fromisoformat(day), payments=20, shards=2)
    outs = run_cli_all(settings, [["reconcile", "--date", day]] * 2)
    assert all(out.returncode == 0 for out in outs), [out.stderr for out in outs]
    workflow_id = f"ledger-reconciliation-{day}"
    started_ids.append(workflow_id)
    run_id = (await client.get_workflow_handle(workflow_id).describe()).run_id
    heads = sorted(out.stdout.splitlines()[0] for out in outs)
    assert heads == [f"already running: {workflow_id} (run {run_id})", f"started: {workflow_id}"], heads


async def test_a_cleanup_started_twice_is_started_once_and_joined_once(
    client: Client, pool, settings: Settings, task_queue: str, started_ids
) -> None:
    deadline = deadline_in(3600)
    await seed(pool, deadline, 3)
    racing = await asyncio.gather(
        *(start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline)) for _ in range(2))
    )
    workflow_id = racing[0].workflow_id
    started_ids.append(workflow_id)
    assert sorted(r.started for r in racing) == [False, True] and sorted(r.joined for r in racing) == [False, True]
    run_id = (await client.get_workflow_handle(workflow_id).describe()).run_id
    assert racing[0].run_id == racing[1].run_id == run_id
    iso = deadline.isoformat()
    (out,) = run_cli_all(settings, [["cleanup", "--deadline", iso]])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"already running: {workflow_id} (run {run_id})", out.stdout
