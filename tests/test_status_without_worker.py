"""Status answers without a worker: with no worker polling a run's task queue (every worker down,
the moment an operator most needs a status), `status` and the Python status functions answer within
a few seconds from Temporal's describe and the database, and say that no worker answered the query,
instead of waiting out the SDK's 30 s and failing with `RPCError: Timeout expired`."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator
from datetime import date

import pytest_asyncio
from temporalio.client import Client
from temporalio.service import RPCError

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from cleanup.planner import ensure_planner, planner_status
from core.config import Settings
from core.temporal import STATUS_QUERY_TIMEOUT
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from tests.helpers import deadline_in, seed
from tests.ledger_helpers import seed_day
from tests.test_cleanup_input import run_cli

NO_ANSWER = "no worker answered the status query"
BOUND = STATUS_QUERY_TIMEOUT + 3  # the query's bound, plus the describe and the database's reads


@pytest_asyncio.fixture
async def started_ids(client: Client) -> AsyncIterator[list[str]]:
    """Workflow IDs a test started: terminated at its end (no worker would ever finish them)."""
    ids: list[str] = []
    yield ids
    for workflow_id in ids:
        with contextlib.suppress(RPCError):  # closed already: nothing to stop
            await client.get_workflow_handle(workflow_id).terminate(reason="test over")


async def test_a_cleanup_status_answers_from_describe_and_the_database(
    client: Client, pool, settings: Settings, task_queue: str, started_ids
) -> None:
    deadline = deadline_in(3600)
    await seed(pool, deadline, 3)
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
    started_ids.append(started.workflow_id)
    began = time.monotonic()
    report = await cleanup_status(client, pool, started.workflow_id)
    took = time.monotonic() - began
    assert took < BOUND, f"{took:.1f} s"
    assert report.live_status is not None and NO_ANSWER in report.live_status, report
    assert task_queue in report.live_status
    assert report.temporal_status == "RUNNING" and report.run_id == started.run_id
    assert report.phase == "sleeping" and report.deadline == deadline  # the run's search attributes
    assert report.settled is False and report.partitions_reported is not None  # from the database
    assert report.database is None

    began = time.monotonic()
    out = run_cli(settings, "status", started.workflow_id)
    took = time.monotonic() - began
    assert out.returncode == 0, out.stderr
    assert NO_ANSWER in out.stdout and "RUNNING" in out.stdout and "sleeping" in out.stdout, out.stdout
    assert took < BOUND + 3, f"{took:.1f} s"  # and the interpreter's start


async def test_a_ledger_status_answers_from_describe_and_the_database(
    client: Client, pool, task_queue: str, started_ids
) -> None:
    day = date(random.randint(1990, 2020), random.randint(1, 12), random.randint(1, 28))
    await seed_day(pool, day, payments=20, shards=2)
    started = await start_reconciliation(client, pool, task_queue, ReconcileRequest(business_date=day))
    started_ids.append(started.workflow_id)
    began = time.monotonic()
    report = await ledger_status(client, pool, day)
    took = time.monotonic() - began
    assert took < BOUND, f"{took:.1f} s"
    assert report.live_status is not None and NO_ANSWER in report.live_status, report
    assert report.temporal_status == "RUNNING" and report.shards_done == "0/2" and report.settled is False


async def test_the_planner_status_answers_from_describe_and_the_database(
    client: Client, pool, task_queue: str, started_ids
) -> None:
    workflow_id, started = await ensure_planner(client, task_queue, pool=pool)
    started_ids.append(workflow_id)
    assert started
    began = time.monotonic()
    report = await planner_status(client, pool, task_queue)
    took = time.monotonic() - began
    assert took < BOUND, f"{took:.1f} s"
    assert report.live_status is not None and NO_ANSWER in report.live_status, report
    assert report.temporal_status == "RUNNING" and report.database is None and report.overdue is not None
