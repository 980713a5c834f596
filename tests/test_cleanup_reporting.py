"""What renewals signal, what a finished cleanup reports, and where the CLI links to a UI.

Real Temporal + real Postgres; every wait polls with a bounded timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from cleanup.inputs import StartCleanup
from cleanup.models import (
    ClaimResult,
    CleanupPartitionInput,
    CleanupResult,
    PartitionReport,
    SettleCleanupInput,
)
from cleanup.operations import CleanupListing, list_cleanups, renew, start_cleanup
from core import search_attributes as sa
from core.config import Settings
from core.errors import InputError
from tests.helpers import (
    cohort_claim,
    deadline_in,
    effect_counts,
    listed_workflow_ids,
    redeliver,
    seed,
    wait_until,
    workflow_ids,
)
from tests.test_cleanup_input import run_cli


async def _signals(client: Client, workflow_id: str) -> int:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)


async def test_a_renewal_signals_only_the_single_account_cleanup(client, pool, task_queue, worker):
    deadline = deadline_in(3600)
    accounts = await seed(pool, deadline, 3)
    cohort = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
    single = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[0]))

    in_cohort_only = await renew(client, pool, task_queue, accounts[1])
    with_own_cleanup = await renew(client, pool, task_queue, accounts[0])

    assert in_cohort_only.in_time and in_cohort_only.signalled == []
    assert with_own_cleanup.in_time and with_own_cleanup.signalled == [single.workflow_id]
    assert in_cohort_only.signal_errors == with_own_cleanup.signal_errors == []
    # A signal that arrives during a workflow task is written after it: count once the run is over.
    assert (
        await client.get_workflow_handle(single.workflow_id, result_type=CleanupResult).result()
    ).outcome == "renewed"
    assert await _signals(client, single.workflow_id) == 1
    assert await _signals(client, cohort.workflow_id) == 0, "the cohort ignores the signal: it gets none"
    await client.get_workflow_handle(cohort.workflow_id).terminate("test over")


async def test_a_refused_renewal_signal_is_reported_not_swallowed(client, pool, task_queue, monkeypatch, caplog):
    [account] = await seed(pool, deadline_in(3600), 1)
    single = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))

    async def refused(self: WorkflowHandle[Any, Any], *args: object, **kwargs: object) -> None:
        raise RPCError("signal count limit exceeded", RPCStatusCode.RESOURCE_EXHAUSTED, b"")

    monkeypatch.setattr(WorkflowHandle, "signal", refused)
    with caplog.at_level(logging.WARNING, logger="cleanup"):
        outcome = await renew(client, pool, task_queue, account)

    assert outcome.in_time, "the database decided the renewal; the refused signal does not undo it"
    assert outcome.signalled == []
    assert outcome.signal_errors == [f"{single.workflow_id}: signal count limit exceeded"]
    assert "signal count limit exceeded" in caplog.text
    await client.get_workflow_handle(single.workflow_id).terminate("test over")


async def test_a_cleanup_ended_by_a_renewal_stays_in_phase_renewed_and_list_shows_the_outcome(
    client, pool, task_queue, worker
):
    [account] = await seed(pool, deadline_in(3600), 1)
    started = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    handle = client.get_workflow_handle(started.workflow_id, result_type=CleanupResult)
    assert (await renew(client, pool, task_queue, account)).signalled == [started.workflow_id]

    result: CleanupResult = await handle.result()

    assert result.outcome == "renewed"
    desc = await handle.describe()
    assert desc.typed_search_attributes.get(sa.CLEANUP_PHASE) == "renewed"

    async def listed() -> list[CleanupListing]:
        return [r for r in await list_cleanups(client) if r.workflow_id == started.workflow_id]

    async def visible() -> bool:
        rows = await listed()
        return bool(rows) and rows[0].phase == "renewed"

    await wait_until(visible, within=30)
    [row] = await listed()
    assert (row.status, row.phase, row.outcome) == ("COMPLETED", "renewed", "renewed")


async def test_cleanup_of_an_account_whose_cleanup_finished_returns_that_run_and_its_outcome(
    client, pool, task_queue, worker
):
    accounts = await seed(pool, deadline_in(1), 2)
    first = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[0]))
    await client.get_workflow_handle(first.workflow_id).result()

    again = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[0]))

    assert not again.started and again.workflow_id == first.workflow_id and again.run_id == first.run_id
    assert (again.temporal_status, again.outcome) == ("COMPLETED", "cleaned")

    # An account cleaned by its cohort: the same answer, the cohort's run.
    cohort = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=again.deadline, partitions=1))
    await client.get_workflow_handle(cohort.workflow_id).result()
    by_cohort = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[1]))
    assert not by_cohort.started and by_cohort.workflow_id == cohort.workflow_id
    assert by_cohort.outcome == "cleaned"
    expected = [first.workflow_id, cohort.workflow_id]
    assert sorted(await listed_workflow_ids(client, task_queue, expected)) == sorted(expected)
    assert (await effect_counts(pool))["applied"] == 2


async def test_cleanup_of_an_account_renewed_for_good_says_so_and_starts_nothing(client, pool, task_queue):
    [account] = await seed(pool, deadline_in(3600), 1)
    assert (await renew(client, pool, task_queue, account)).in_time

    with pytest.raises(InputError, match="is renewed"):
        await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    assert await workflow_ids(client, task_queue) == []


async def test_partition_reports_say_what_the_database_applied_whatever_the_attempt(client, pool, task_queue, worker):
    deadline = deadline_in(-60)
    await seed(pool, deadline, 120)
    [claim] = await redeliver(
        client,
        task_queue,
        "claim_cleanup_in_chunks",
        cohort_claim("cohort-rep", deadline, 2),
        1,
    )
    per_partition = ClaimResult.model_validate(claim).claimed_per_partition
    reports = []
    for p in range(2):
        runs = await redeliver(
            client, task_queue, "cleanup_partition", CleanupPartitionInput(cleanup_id="cohort-rep", partition_no=p)
        )
        reports.append([PartitionReport.model_validate(r) for r in runs])
    [settlement] = await redeliver(
        client,
        task_queue,
        "settle_cleanup",
        SettleCleanupInput(
            cleanup_id="cohort-rep",
            deadline=deadline,
            partitions=2,
            claim=ClaimResult.model_validate(claim),
            reports=[runs[1] for runs in reports],
        ),
        1,
    )

    for p, (first, second) in enumerate(reports):
        assert first.claimed == second.claimed == first.applied == second.applied == per_partition[p]
        assert first.attempt_counts.cleaned == per_partition[p]
        assert (second.attempt_counts.cleaned, second.attempt_counts.already_applied) == (0, per_partition[p])
    assert sum(runs[1].applied for runs in reports) == settlement["cleaned"] == 120


async def test_the_cli_links_to_a_ui_only_where_one_is_known(client, pool, settings, task_queue, worker, monkeypatch):
    assert Settings(temporal_address="temporal.internal:7233").workflow_url("w") is None
    assert Settings().workflow_url("w") == "http://127.0.0.1:8233/namespaces/default/workflows/w"
    known = Settings(temporal_address="temporal.internal:7233", temporal_ui_url="https://ui.example/")
    assert known.workflow_url("w") == "https://ui.example/namespaces/default/workflows/w"

    monkeypatch.delenv("TEMPORAL_UI_URL", raising=False)
    deadline = deadline_in(3600)
    await seed(pool, deadline, 2)
    iso = deadline.isoformat().replace("+00:00", "Z")
    done = await asyncio.to_thread(run_cli, settings, "cleanup", "--deadline", iso)  # the test server runs headless
    assert done.returncode == 0, done.stderr
    assert "http" not in done.stdout, done.stdout
    workflow_id = done.stdout.splitlines()[0].removeprefix("started: ")
    status = await asyncio.to_thread(run_cli, settings, "status", workflow_id)
    assert status.returncode == 0 and "http" not in status.stdout, status.stdout

    monkeypatch.setenv("TEMPORAL_UI_URL", "https://ui.example")
    again = await asyncio.to_thread(run_cli, settings, "cleanup", "--deadline", iso)
    assert f"https://ui.example/namespaces/default/workflows/{workflow_id}" in again.stdout, again.stdout
    await client.get_workflow_handle(workflow_id).terminate("test over")


async def test_heartbeat_timeout_and_interval_come_from_the_cli_or_the_environment(
    client, pool, settings, task_queue, monkeypatch
):
    async def input_of(workflow_id: str) -> dict[str, Any]:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        data: dict[str, Any] = json.loads(started.input.payloads[0].data)
        return data

    for name in ("CLEANUP_HEARTBEAT_TIMEOUT_SECONDS", "CLEANUP_HEARTBEAT_INTERVAL_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    by_default = await start_cleanup(
        client, pool, task_queue, StartCleanup(deadline=deadline_in(3600), allow_empty=True)
    )
    defaults = await input_of(by_default.workflow_id)
    assert (defaults["heartbeat_timeout_seconds"], defaults["heartbeat_interval_seconds"]) == (7.0, None)

    monkeypatch.setenv("CLEANUP_HEARTBEAT_TIMEOUT_SECONDS", "6")
    monkeypatch.setenv("CLEANUP_HEARTBEAT_INTERVAL_SECONDS", "1.5")
    read_once = Settings.from_env().cleanup.defaults  # the environment is read into the settings, once
    from_env = await start_cleanup(
        client, pool, task_queue, StartCleanup(deadline=deadline_in(3600), allow_empty=True), read_once
    )
    assert (await input_of(from_env.workflow_id))["heartbeat_timeout_seconds"] == 6.0
    assert (await input_of(from_env.workflow_id))["heartbeat_interval_seconds"] == 1.5

    iso = deadline_in(3600).isoformat().replace("+00:00", "Z")
    bad = await asyncio.to_thread(
        run_cli, settings, "cleanup", "--deadline", iso, "--allow-empty", "--heartbeat-timeout", "-1"
    )
    assert bad.returncode == 2 and "heartbeat_timeout_seconds" in bad.stderr, bad.stderr
    done = await asyncio.to_thread(
        run_cli,
        settings,
        "cleanup",
        "--deadline",
        iso,
        "--allow-empty",
        "--heartbeat-timeout",
        "4",
        "--heartbeat-interval",
        "1",
    )
    assert done.returncode == 0, done.stderr
    cli_run = done.stdout.splitlines()[0].removeprefix("started: ")
    cli_input = await input_of(cli_run)
    assert (cli_input["heartbeat_timeout_seconds"], cli_input["heartbeat_interval_seconds"]) == (4.0, 1.0)
    for workflow_id in (by_default.workflow_id, from_env.workflow_id, cli_run):
        await client.get_workflow_handle(workflow_id).terminate("test over")
