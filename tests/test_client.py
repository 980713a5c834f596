"""CleanupClient is the front door of every job: built once from the settings, it fills in their
defaults (a manual cleanup runs as the planner's do, the ledger's and the outbox's heartbeats) and
answers with the same models as the functions it calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import date

import pytest_asyncio
from temporalio.client import Client

from core.config import CleanupDefaults, CleanupSettings, LedgerSettings, OutboxSettings, Settings
from deadline_cleanup import CleanupClient, ReconcileRequest, StartCleanup
from ledger.models import LedgerReconciliationInput, LedgerReconciliationResult
from tests.helpers import deadline_in, seed
from tests.ledger_helpers import id_prefix, seed_day

DAY = date(2012, 5, 9)
OWN = Settings(
    cleanup=CleanupSettings(defaults=CleanupDefaults(partitions=3, max_parallel_partitions=2, batch_size=7)),
    ledger=LedgerSettings(heartbeat_timeout_seconds=5.0),
    outbox=OutboxSettings(heartbeat_timeout_seconds=6.0),
)


@pytest_asyncio.fixture
async def cleanup(client: Client, pool, settings: Settings) -> AsyncIterator[CleanupClient]:
    yield CleanupClient(OWN.model_copy(update={"task_queue": settings.task_queue}), client, pool)


async def started_input(client: Client, workflow_id: str) -> bytes:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return history.events[0].workflow_execution_started_event_attributes.input.payloads[0].data


async def test_a_cleanup_started_through_the_client_takes_the_settings_defaults(cleanup, client, pool):
    deadline = deadline_in(3600)
    await seed(pool, deadline, 4)
    started = await cleanup.start_cleanup(StartCleanup(deadline=deadline))
    given = await cleanup.start_cleanup(StartCleanup(deadline=deadline_in(3600), allow_empty=True, batch_size=11))
    try:
        shape = json.loads(await started_input(client, started.workflow_id))
        assert (shape["partitions"], shape["max_parallel_partitions"], shape["batch_size"]) == (3, 2, 7)
        assert json.loads(await started_input(client, given.workflow_id))["batch_size"] == 11  # the request wins
        assert (await cleanup.status(started.workflow_id)).temporal_status == "RUNNING"
    finally:
        for run in (started, given):
            await client.get_workflow_handle(run.workflow_id).terminate("test over")


async def test_accounts_are_held_released_and_their_history_told(cleanup, pool):
    [account] = await seed(pool, deadline_in(3600), 1)
    assert (await cleanup.hold(account, "legal case 17")).result == "held"
    assert (await cleanup.release(account)).result == "released"
    history = await cleanup.history(account)
    assert history.account_id == account and not history.held
    assert (await cleanup.outbox_status()).total >= 0


async def test_a_reconciliation_through_the_client_takes_the_ledger_heartbeat(cleanup, client, pool, worker):
    await seed_day(pool, DAY, payments=40, shards=2)
    started = await cleanup.reconcile(
        ReconcileRequest(business_date=DAY, id_prefix=id_prefix(cleanup.settings.task_queue))
    )
    input = LedgerReconciliationInput.model_validate_json(await started_input(client, started.workflow_id))
    assert (input.heartbeat_timeout_seconds, input.shards, input.max_parallel) == (5.0, 2, 2)
    result = await client.get_workflow_handle(started.workflow_id, result_type=LedgerReconciliationResult).result()
    assert result.business_date == DAY
