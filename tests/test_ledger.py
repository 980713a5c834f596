"""Nightly ledger reconciliation against real Temporal and real Postgres.

1. replaying a night leaves the database unchanged;  2. a worker killed after a batch COMMIT
resumes from its heartbeated cursor;  3. a delayed shard holds the settlement back;  4. a manual
and a scheduled run of the same date at once;  5. pause, unpause, backfill;  6. review reasons.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import date
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Replayer

from activities.ledger import LedgerActivities
from core import db
from ledger import schedule as ls
from ledger.models import (
    LedgerStatus,
    ReconcileShardInput,
    ScheduledLedgerInput,
    ScheduledLedgerResult,
    ledger_workflow_id,
)
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from tests.helpers import wait_until
from tests.ledger_helpers import digest, double_postings, id_prefix, reconcile, seed_day, wait_for_process
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

D = date(2026, 10, 25)


async def executions(client: Client, workflow_id: str) -> int:
    return len([wf async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'")])


async def test_a_night_reconciles_balanced_and_replaying_it_changes_nothing(client, pool, task_queue, worker):
    seeded = await seed_day(pool, D)
    first = await reconcile(client, pool, task_queue, D, batch_size=200)

    s = first.settlement
    assert (s.discrepancies_found, s.corrected, s.sent_to_review) == (
        seeded.expected_discrepancies,
        seeded.expected_corrections,
        seeded.expected_review,
    )
    assert s.balanced and s.corrected > 0 and s.sent_to_review > 0
    assert s.duplicate_report_rows == seeded.duplicate_report_rows > 0
    assert sum(r.keys_examined for r in first.shards) == seeded.payments + seeded.unknown_payments
    assert await double_postings(pool) == 0
    before = await digest(pool)

    # The same date again through the CLI path: the date-keyed workflow already exists.
    again = await start_reconciliation(
        client, pool, task_queue, ReconcileRequest(business_date=D, id_prefix=id_prefix(task_queue))
    )
    assert not again.started
    # A second run under another workflow ID: the inputs are unchanged since each shard's report,
    # so nothing is re-judged and nothing written.
    replay = await reconcile(client, pool, task_queue, D, batch_size=350, id_prefix=f"replay-{task_queue}")
    assert await digest(pool) == before
    assert replay.settlement == first.settlement
    assert all(r.unchanged_since_report and r.batches_this_attempt == 0 for r in replay.shards)

    # Without the fingerprints (reports written before they existed): every shard is re-judged in
    # full, nothing is written, and the fingerprints come back as they were.
    await pool.execute("UPDATE ledger_shard_reports SET input_fingerprint = NULL")
    rejudged = await reconcile(client, pool, task_queue, D, batch_size=350, id_prefix=f"rejudge-{task_queue}")

    assert await digest(pool) == before
    assert rejudged.settlement == first.settlement
    assert all(not r.unchanged_since_report and r.batches_this_attempt > 0 for r in rejudged.shards)
    keep = {"unchanged_since_report", "batches_this_attempt"}
    assert [r.model_dump(exclude=keep) for r in rejudged.shards] == [r.model_dump(exclude=keep) for r in first.shards]
    assert await double_postings(pool) == 0


async def test_a_shard_whose_inputs_changed_is_judged_again(client, pool, task_queue, worker):
    """The rerun shortcut only applies to unchanged inputs: a late report row sends its shard back
    through judging (and into review), the other shards keep their recorded reports."""
    await seed_day(pool, D, payments=400, shards=2)
    await reconcile(client, pool, task_queue, D)
    reviewed = await pool.fetchval("SELECT count(*) FROM ledger_review")
    late_shard = await pool.fetchval(
        "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)"
        " VALUES ($1, ledger_shard_of('arena-1', 'pay-late-1', 2), 'arena-1', 'pay-late-1', 1999, 'EUR', 'settled')"
        " RETURNING shard",
        D,
    )
    activities = LedgerActivities(pool)
    env = ActivityEnvironment()
    reports = [
        await env.run(
            activities.reconcile_shard,
            ReconcileShardInput(business_date=D, shard=shard, shards=2, workflow_id=f"late-{task_queue}"),
        )
        for shard in (0, 1)
    ]

    assert [r.unchanged_since_report for r in reports] == [shard != late_shard for shard in (0, 1)]
    assert await pool.fetchval("SELECT count(*) FROM ledger_review") == reviewed + 1
    assert await pool.fetchval("SELECT reason FROM ledger_review WHERE payment_id = 'pay-late-1'")
    assert await double_postings(pool) == 0


@pytest.mark.whole_machine  # which throttled heartbeat reached Temporal before the kill depends on timing
async def test_worker_killed_after_commit_resumes_from_heartbeated_cursor(client, pool, task_queue, worker_processes):
    seeded = await seed_day(pool, D, payments=1200, shards=2)
    dying = worker_processes.start(CLEANUP_FAILPOINTS="reconcile_shard.after_commit=exit@3")
    started = await start_reconciliation(
        client,
        pool,
        task_queue,
        ReconcileRequest(
            business_date=D,
            max_parallel=1,
            batch_size=100,
            heartbeat_timeout_seconds=2.0,
            id_prefix=id_prefix(task_queue),
        ),
    )
    assert await wait_for_process(dying) == 86
    committed = await pool.fetchval("SELECT count(*) FROM ledger_corrections")
    assert committed > 0, "batches 1-3 of shard 0 committed before the worker died"

    worker_processes.start()
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)
    result = await asyncio.wait_for(handle.result(), timeout=90)

    shard0 = result.shards[0]
    assert shard0.attempt == 2, "the killed attempt was retried"
    # Heartbeats after the first are throttled, so the last one that reached Temporal before the
    # kill is batch 1's or batch 2's; batch 3 committed unheartbeated and was re-judged as applied.
    assert shard0.resumed_from_batch in (1, 2), "resumed after a heartbeated batch, not from zero"
    assert shard0.batches_this_attempt == shard0.batches - 1
    assert result.shards[1].attempt == 1
    resumed = f"shard 0 of 2026-10-25 attempt 2 resumes after batch {shard0.resumed_from_batch} at (game-"
    assert resumed in worker_processes.logs()
    assert await double_postings(pool) == 0
    assert result.settlement.corrected == seeded.expected_corrections
    assert result.settlement.sent_to_review == seeded.expected_review
    assert result.settlement.balanced


async def test_a_delayed_shard_holds_the_settlement_back(client, pool, db_url, task_queue, worker):
    seeded = await seed_day(pool, D, payments=800, shards=4)
    blocker = await asyncpg.connect(db_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    # Hold a row lock on shard 2's first payment: its first batch waits (and keeps heartbeating).
    await blocker.execute(
        "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = 2 "
        "ORDER BY game, payment_id LIMIT 1 FOR UPDATE",
        D,
    )
    try:
        started = await start_reconciliation(
            client,
            pool,
            task_queue,
            ReconcileRequest(business_date=D, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue)),
        )
        handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)

        async def three_done() -> bool:
            status: LedgerStatus = await handle.query(LedgerReconciliationWorkflow.status)
            return status.shards_done == 3

        await wait_until(three_done, within=60)
        await asyncio.sleep(3)  # longer than the heartbeat timeout: the blocked shard is not retried
        status: LedgerStatus = await handle.query(LedgerReconciliationWorkflow.status)
        assert (status.phase, status.shards_done, status.settled) == ("reconciling", 3, False)
        assert await pool.fetchval("SELECT count(*) FROM ledger_settlements") == 0
        reported = [r["shard"] for r in await pool.fetch("SELECT shard FROM ledger_shard_reports ORDER BY 1")]
        assert reported == [0, 1, 3]
        cli_view = await ledger_status(client, pool, D, id_prefix=id_prefix(task_queue))
        assert (cli_view.shards_done, cli_view.settled) == ("3/4", False)
    finally:
        await tx.rollback()
        await blocker.close()

    result = await asyncio.wait_for(handle.result(), timeout=60)
    assert [r.attempt for r in result.shards] == [1, 1, 1, 1], "every shard ran exactly once"
    scheduled = [
        e
        async for e in handle.fetch_history_events()
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name == "reconcile_shard"
    ]
    assert len(scheduled) == 4
    # The history replays deterministically against the current workflow code.
    await Replayer(workflows=[LedgerReconciliationWorkflow], data_converter=client.data_converter).replay_workflow(
        await handle.fetch_history()
    )
    assert await pool.fetchval("SELECT count(*) FROM ledger_settlements") == 1
    assert result.settlement.discrepancies_found == seeded.expected_discrepancies
    assert await double_postings(pool) == 0


async def _wait_for_scheduled_runs(client: Client, schedule_id: str, count: int) -> list[ScheduledLedgerResult]:
    async def taken() -> bool:
        return len((await ls.describe_schedule(client, schedule_id)).recent_runs) >= count

    await wait_until(taken, within=60)
    runs = (await ls.describe_schedule(client, schedule_id)).recent_runs
    results = []
    for run in runs:
        handle = client.get_workflow_handle(str(run.workflow_id), run_id=run.run_id, result_type=ScheduledLedgerResult)
        results.append(await asyncio.wait_for(handle.result(), timeout=90))
    return results


async def test_manual_and_scheduled_run_of_the_same_date_at_once(client, pool, task_queue, worker):
    seeded = await seed_day(pool, D, payments=1000, shards=4)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=4, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, paused=True, schedule_id=schedule_id)
    try:
        manual, _ = await asyncio.gather(
            start_reconciliation(
                client,
                pool,
                task_queue,
                ReconcileRequest(business_date=D, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue)),
            ),
            ls.backfill_schedule(client, D, D, schedule_id),  # the night of 2026-10-26 02:00 UTC
        )
        (scheduled,) = await _wait_for_scheduled_runs(client, schedule_id, 1)
    finally:
        await ls.delete_schedule(client, schedule_id)

    workflow_id = ledger_workflow_id(D, id_prefix(task_queue))
    assert scheduled.business_date == D and scheduled.workflow_id == workflow_id == manual.workflow_id
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, workflow_id)
    result = await asyncio.wait_for(handle.result(), timeout=90)
    assert await executions(client, workflow_id) == 1, "one run of the date, whoever started it"
    assert await double_postings(pool) == 0
    assert await pool.fetchval("SELECT count(*) FROM ledger_settlements") == 1
    assert result.settlement.corrected == seeded.expected_corrections


async def test_pause_unpause_and_backfill_reconcile_each_missed_date_once(client, pool, task_queue, worker):
    dates = [date(2026, 10, 23), date(2026, 10, 24), date(2026, 10, 25)]
    for d in dates:
        await seed_day(pool, d, payments=300, shards=2)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, schedule_id=schedule_id)
    try:
        assert (await ls.pause_schedule(client, "maintenance", schedule_id)).paused is True
        # While paused, an operator reconciles the middle date by hand.
        await reconcile(client, pool, task_queue, dates[1])
        described = await ls.unpause_schedule(client, "", schedule_id)
        assert described.paused is False and described.overlap == "BUFFER_ALL"
        assert described.actions_taken == 0

        await ls.backfill_schedule(client, dates[0], dates[-1], schedule_id)
        first = await _wait_for_scheduled_runs(client, schedule_id, 3)
        assert sorted((r.business_date, r.outcome) for r in first) == [
            (dates[0], "reconciled"),
            (dates[1], "already_started"),
            (dates[2], "reconciled"),
        ]
        before = await digest(pool)

        # Backfilling the same nights again takes none of them: each already ran, and says so.
        again = await ls.backfill_schedule(client, dates[0], dates[-1], schedule_id)
        assert again.backfilled_dates == [] and again.already_ran is not None
        assert [(n.business_date, n.status) for n in again.already_ran] == [(d, "COMPLETED") for d in dates]
        assert again.actions_taken == 3 and len(again.recent_runs) == 3
    finally:
        await ls.delete_schedule(client, schedule_id)

    assert await digest(pool) == before
    settled = [r["business_date"] for r in await pool.fetch("SELECT business_date FROM ledger_settlements ORDER BY 1")]
    assert settled == dates
    for d in dates:
        assert await executions(client, ledger_workflow_id(d, id_prefix(task_queue))) == 1
    assert await double_postings(pool) == 0


async def test_review_rows_for_each_irreconcilable_kind_with_readable_reasons(client, pool, task_queue, worker):
    await seed_day(pool, D, payments=1500, shards=2, large_mismatch_rate=0.02, unknown_rate=0.02)
    clean = await pool.fetch(
        """
        SELECT l.game, l.payment_id FROM ledger_payments l JOIN ledger_report_rows r USING (game, payment_id)
        WHERE l.status = 'captured' AND r.status = 'settled' AND l.amount_cents = r.amount_cents
        GROUP BY l.game, l.payment_id HAVING count(*) = 1 ORDER BY l.payment_id LIMIT 3
        """
    )
    (g1, p1), (g2, p2), (g3, p3) = ((r["game"], r["payment_id"]) for r in clean)
    await pool.execute("UPDATE ledger_report_rows SET currency = 'JPY' WHERE payment_id = $1", p1)
    await pool.execute("UPDATE ledger_payments SET status = 'refunded' WHERE payment_id = $1", p2)
    await pool.execute(
        "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status) "
        "SELECT business_date, shard, game, payment_id, amount_cents + 7, currency, status "
        "FROM ledger_report_rows WHERE payment_id = $1",
        p3,
    )

    result = await reconcile(client, pool, task_queue, D)

    rows = await pool.fetch("SELECT * FROM ledger_review ORDER BY review_key")
    assert {r["kind"] for r in rows} == {
        "unknown_payment",
        "amount_beyond_tolerance",
        "currency_mismatch",
        "status_mismatch",
        "conflicting_report_rows",
    }
    assert len(rows) == result.settlement.sent_to_review
    by_key = {r["review_key"]: r for r in rows}
    assert by_key[f"{g1}:{p1}:2026-10-25"]["reason"].startswith("currency mismatch: the ledger has ")
    assert "JPY" in by_key[f"{g1}:{p1}:2026-10-25"]["reason"]
    assert by_key[f"{g2}:{p2}:2026-10-25"]["reason"] == (
        "status mismatch: the ledger says refunded, the provider reported settled; no rule reconciles this"
    )
    assert by_key[f"{g3}:{p3}:2026-10-25"]["reason"].startswith(
        "conflicting report rows: the provider reported this payment 2 times"
    )
    money = r"-?\d+\.\d\d [A-Z]{3}"
    for r in rows:
        assert r["business_date"] == D and r["resolved_at"] is None
        if r["kind"] == "amount_beyond_tolerance":
            assert re.fullmatch(
                rf"amount mismatch beyond tolerance: the ledger has {money}, the provider settled {money} "
                r"\(difference -?\d+\.\d\d, tolerance 0\.50\); check the capture before correcting by hand",
                r["reason"],
            ), r["reason"]
        if r["kind"] == "unknown_payment":
            assert re.fullmatch(
                rf"unknown payment: the provider settled {money} \(settled\) for {r['game']}:{r['payment_id']} "
                r"on 2026-10-25, but the ledger has no such payment for that date",
                r["reason"],
            ), r["reason"]
    # What rules can reconcile was corrected, once, with the ledger updated in the same transaction.
    kinds = dict(await pool.fetch("SELECT kind, count(*) FROM ledger_corrections GROUP BY kind"))
    assert set(kinds) == {"refund_not_recorded", "amount_mismatch", "not_settled"}
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM ledger_corrections c JOIN ledger_payments p USING (game, payment_id) "
            "WHERE p.status <> c.new_status OR p.amount_cents <> c.new_amount_cents OR p.version <> 2"
        )
        == 0
    )
    assert await double_postings(pool) == 0


async def test_a_wrong_shard_count_fails_the_run_without_retrying(client, pool, task_queue, worker):
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ActivityError

    from ledger.models import LedgerReconciliationInput

    await seed_day(pool, D, payments=100, shards=4)
    handle = await client.start_workflow(
        LedgerReconciliationWorkflow.run,
        LedgerReconciliationInput(business_date=D, shards=6, heartbeat_timeout_seconds=2.0),
        id=f"{id_prefix(task_queue)}-bad-shards",
        task_queue=task_queue,
    )
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), timeout=30)
    activity_error = failure.value.cause
    assert isinstance(activity_error, ActivityError)
    message = str(activity_error.cause)
    assert "split into 4 shard(s) (0-3), not 6" in message
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == 0


async def test_cli_seed_reconcile_status_and_schedule_commands(
    client, db_url, temporal_address, task_queue, worker, capsys
):
    from starter import main

    day = "2026-09-30"  # the CLI uses the real workflow ID prefix: a date no other test uses
    base = ["--temporal-address", temporal_address, "--database-url", db_url, "--task-queue", task_queue]

    async def cli(*argv: str) -> Any:
        capsys.readouterr()
        assert await asyncio.to_thread(main, [*base, *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    rates = ["--large-mismatch-rate", "0.03", "--unknown-rate", "0.02"]
    seeded = await cli("ledger", "seed", "--date", day, "--payments", "400", "--shards", "2", *rates)
    assert seeded["expected_review_rows"] > 5
    assert seeded["created"] and seeded["payments"] == 400
    again = await cli("ledger", "seed", "--date", day, "--payments", "400", "--shards", "2")
    assert not again["created"] and again["payments"] == 0
    started = await cli("reconcile", "--date", day, "--batch-size", "150")
    assert started["started"] and started["workflow_id"] == f"ledger-reconciliation-{day}"
    await client.get_workflow_handle(started["workflow_id"]).result()
    assert not (await cli("reconcile", "--date", day))["started"]

    status = await cli("ledger", "status", day)
    assert status["shards_done"] == "2/2" and status["settled"] is True and status["phase"] == "settled"
    assert status["corrections"] == seeded["expected_corrections"]
    assert status["review_rows"] == seeded["expected_review_rows"]
    assert status["settlement"]["discrepancies_found"] == status["corrections"] + status["review_rows"]
    assert len(await cli("ledger", "review", f"ledger-reconciliation-{day}", "--limit", "5")) == 5
    assert await cli("status", f"ledger-reconciliation-{day}") == status

    sid = ["--schedule-id", f"ledger-nightly-{uuid.uuid4().hex[:8]}"]
    created = await cli("schedule", "create", *sid, "--at", "03:30", "--paused", "--shards", "2")
    assert (created["runs_at"], created["paused"], created["overlap"]) == ("03:30 UTC", True, "BUFFER_ALL")
    assert created["catchup_window"] == "1 day, 0:00:00"
    assert (await cli("schedule", "unpause", *sid))["paused"] is False
    assert (await cli("schedule", "pause", *sid, "--reason", "provider outage"))["note"] == "provider outage"
    assert (await cli("schedule", "describe", *sid))["next_runs"][0].endswith("T03:30:00+00:00")
    assert (await cli("schedule", "delete", *sid))["deleted"] is True
    capsys.readouterr()
    assert await asyncio.to_thread(main, [*base, "schedule", "describe", *sid]) == 2
    assert "no schedule" in capsys.readouterr().err


async def test_a_triggered_night_reconciles_the_previous_business_date(client, pool, task_queue, worker):
    from datetime import UTC, datetime, timedelta

    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    seeded = await seed_day(pool, yesterday, payments=200, shards=2)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, paused=True, schedule_id=schedule_id)
    try:
        await ls.trigger_schedule(client, schedule_id)
        (run,) = await _wait_for_scheduled_runs(client, schedule_id, 1)
    finally:
        await ls.delete_schedule(client, schedule_id)
    assert (run.business_date, run.outcome) == (yesterday, "reconciled")
    assert run.settlement is not None and run.settlement.corrected == seeded.expected_corrections


async def test_paused_schedule_skips_real_trigger_times_and_backfill_runs_them_once(client, pool, task_queue, worker):
    """The nightly schedule with its calendar swapped for one trigger a second, so trigger times really
    pass while it is paused: nothing runs during the pause; backfilling the paused window then runs
    each missed trigger, and the date they all map to (yesterday) is reconciled exactly once."""
    from datetime import UTC, datetime, timedelta

    from temporalio.client import ScheduleBackfill, ScheduleIntervalSpec, ScheduleSpec

    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    await seed_day(pool, yesterday, payments=200, shards=2)
    schedule_id = f"ledger-every-second-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    schedule = ls.nightly_schedule(task_queue, options=options, paused=True, schedule_id=schedule_id)
    schedule.spec = ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=1))])
    await client.create_schedule(schedule_id, schedule)
    try:
        paused_from = datetime.now(UTC)
        await asyncio.sleep(3.5)  # three trigger times pass while paused
        paused_to = datetime.now(UTC)
        described = await ls.describe_schedule(client, schedule_id)
        assert described.paused is True and described.actions_taken == 0
        assert await executions(client, ledger_workflow_id(yesterday, id_prefix(task_queue))) == 0

        handle = client.get_schedule_handle(schedule_id)
        await handle.backfill(ScheduleBackfill(start_at=paused_from, end_at=paused_to, overlap=ls.OVERLAP))
        runs = await _wait_for_scheduled_runs(client, schedule_id, 3)
    finally:
        await ls.delete_schedule(client, schedule_id)

    assert {r.business_date for r in runs} == {yesterday}
    assert sorted(r.outcome for r in runs).count("reconciled") == 1, runs
    assert await executions(client, ledger_workflow_id(yesterday, id_prefix(task_queue))) == 1
    assert await pool.fetchval("SELECT count(*) FROM ledger_settlements WHERE business_date = $1", yesterday) == 1
    assert await double_postings(pool) == 0
