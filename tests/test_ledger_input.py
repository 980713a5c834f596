"""Malformed ledger input: refused at the CLI (exit 2) or failed non-retryably in an activity."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.ledger import LedgerActivities
from core.errors import InputError
from ledger.models import LedgerReconciliationInput, ReconcileShardInput, SettleLedgerInput
from ledger.operations import (
    ReconcileRequest,
    ledger_target,
    parse_business_date,
    recheck_workflow_id,
    start_reconciliation,
)
from ledger.schedule import backfill_range, parse_time_of_day
from ledger.seed import seed_spec
from starter import main
from tests.ledger_helpers import seed_day

D = date(2026, 10, 25)
TODAY = date(2026, 11, 30)


@pytest.mark.parametrize("text", ["2026-13-01", "2026-02-30", "25/10/2026", "2026-10-25T00:00", "", "20261025"])
def test_malformed_business_dates_are_refused(text):
    with pytest.raises(InputError, match="not a business date"):
        parse_business_date(text, today=TODAY)


@pytest.mark.parametrize(
    ("value", "says"), [(TODAY, "is not over yet"), (TODAY + timedelta(days=3), "is in the future")]
)
def test_a_business_date_that_is_not_over_is_refused(value, says):
    with pytest.raises(InputError, match=says):
        parse_business_date(value.isoformat(), today=TODAY)


def test_a_bad_seed_value_names_its_flag():
    with pytest.raises(InputError, match="--payments: Input should be greater than or equal to 1"):
        seed_spec(business_date=D, payments=0, shards=4)


def test_ledger_targets_accept_a_date_or_the_workflow_id():
    assert ledger_target("ledger-reconciliation-2026-10-25") == (D, "ledger-reconciliation-2026-10-25")
    assert ledger_target("2026-10-25") == (D, "ledger-reconciliation-2026-10-25")
    # A re-check's own workflow ID shows the status of its date (with every settlement revision).
    recheck = recheck_workflow_id(D, now=datetime(2026, 11, 30, 21, 5, 7, 123456, tzinfo=UTC))
    assert recheck == "ledger-reconciliation-2026-10-25-recheck-20261130T210507123456Z"
    assert ledger_target(recheck) == (D, "ledger-reconciliation-2026-10-25")
    with pytest.raises(InputError):
        ledger_target("ledger-reconciliation-2026-10-25-recheck-soon")
    with pytest.raises(InputError):
        ledger_target("cleanup-cohort-20261101T090000Z")


def test_models_forbid_bad_fields():
    with pytest.raises(ValidationError):
        LedgerReconciliationInput(business_date=D, shards=0)
    with pytest.raises(ValidationError):
        LedgerReconciliationInput(business_date=D, shards=300)
    with pytest.raises(ValidationError):
        LedgerReconciliationInput.model_validate({"business_date": "2026-10-25", "shard_count": 4})
    with pytest.raises(ValidationError):
        LedgerReconciliationInput.model_validate({"business_date": "yesterday"})


def test_seed_and_schedule_inputs_are_checked():
    with pytest.raises(InputError, match="add up to"):
        seed_spec(business_date=D, payments=10, refund_rate=0.6, small_mismatch_rate=0.5)
    with pytest.raises(InputError, match="payments"):
        seed_spec(business_date=D, payments=0)
    with pytest.raises(InputError, match="before --from"):
        backfill_range(date(2026, 10, 25), date(2026, 10, 20))
    with pytest.raises(InputError, match="time of day"):
        parse_time_of_day("25:00")
    window = backfill_range(date(2026, 10, 24), date(2026, 10, 25))
    assert window.start_at.isoformat() == "2026-10-24T23:59:59+00:00"
    assert window.end_at.isoformat() == "2026-10-26T23:59:59+00:00"


@pytest.mark.parametrize(
    "argv",
    [
        ["reconcile", "--date", "2026-10-32"],
        ["reconcile", "--date", "tomorrow"],
        ["ledger", "seed", "--date", "2026-10-25", "--payments", "0"],
        ["ledger", "seed", "--date", "2026-10-25"],
        ["ledger", "status", "not-a-date"],
        ["schedule", "backfill", "--from", "2026-10-25", "--to", "2026-10-20"],
        ["schedule", "backfill", "--from", "2026-10-25"],
        ["schedule", "create", "--at", "2:00:30"],
        ["schedule", "create", "--shards", "0"],
    ],
)
def test_cli_exits_2_on_bad_input_without_starting_anything(argv, capsys):
    # An unreachable Temporal and database: input is judged before anything is contacted.
    code: object
    try:
        code = main(["--temporal-address", "127.0.0.1:1", "--database-url", "postgresql://nobody@127.0.0.1:1/x", *argv])
    except SystemExit as exit:  # a flag's own type refused it while parsing (argparse's usage error)
        code = exit.code
    assert code == 2
    assert "error: " in capsys.readouterr().err


async def test_unknown_shard_and_unknown_date_fail_non_retryably(pool):
    await seed_day(pool, D, payments=50, shards=4)
    env = ActivityEnvironment()
    acts = LedgerActivities(pool)
    with pytest.raises(ApplicationError, match=r"unknown shard 7: shards are 0-3") as err:
        await env.run(acts.reconcile_shard, ReconcileShardInput(business_date=D, shard=7, shards=4, workflow_id="wf"))
    assert err.value.non_retryable
    with pytest.raises(ApplicationError, match="no ledger data loaded for business date 2026-10-20") as err:
        await env.run(
            acts.reconcile_shard,
            ReconcileShardInput(business_date=date(2026, 10, 20), shard=0, shards=4, workflow_id="wf"),
        )
    assert err.value.non_retryable
    with pytest.raises(ApplicationError, match=r"split into 4 shard.*not 8") as err:
        await env.run(acts.settle_ledger_date, SettleLedgerInput(business_date=D, shards=8, workflow_id="wf"))
    assert err.value.non_retryable
    # Settling before the shards reported is refused (retryably: the join is not complete yet).
    with pytest.raises(ApplicationError, match=r"shards \[0, 1, 2, 3\] of 2026-10-25 have not reported") as err:
        await env.run(acts.settle_ledger_date, SettleLedgerInput(business_date=D, shards=4, workflow_id="wf"))
    assert not err.value.non_retryable
    assert await pool.fetchval("SELECT count(*) FROM ledger_settlements") == 0


async def test_a_manual_run_of_a_date_without_data_is_refused(client, pool, task_queue):
    with pytest.raises(InputError, match="no ledger data loaded for business date 2026-10-20"):
        await start_reconciliation(client, pool, task_queue, ReconcileRequest(business_date=date(2026, 10, 20)))
    await seed_day(pool, D, payments=50, shards=4)
    with pytest.raises(InputError, match="has 4 shard"):
        await start_reconciliation(client, pool, task_queue, ReconcileRequest(business_date=D, shards=16))
