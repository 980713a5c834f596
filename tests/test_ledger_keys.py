"""The ledger's idempotency record is the payment's (date, game, payment_id), never a string that
two payments can share, and IDs that would make the readable key ambiguous are refused at load."""

from __future__ import annotations

from datetime import date

import asyncpg
import pytest

from tests.ledger_helpers import reconcile

D = date(2026, 10, 25)
# Two distinct payments whose 'game:payment_id' strings are the same.
TWINS = [("a:b", "c"), ("a", "b:c")]
INSERT_PAYMENT = (
    "INSERT INTO ledger_payments (game, payment_id, business_date, shard, amount_cents, currency, status)"
    " VALUES ($1, $2, $3, ledger_shard_of($1, $2, 1), 500, 'EUR', 'captured')"
)
INSERT_REPORT_ROW = (
    "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)"
    " VALUES ($3, ledger_shard_of($1, $2, 1), $1, $2, 500, 'EUR', 'refunded')"
)


@pytest.mark.parametrize("game, payment_id", [("a:b", "c"), ("a", "b:c"), ("a|b", "c"), ("", "c"), ("a", "b c")])
async def test_ids_that_would_make_the_key_ambiguous_are_refused(pool, game, payment_id):
    await pool.execute("INSERT INTO ledger_days (business_date, shards, payments) VALUES ($1, 1, 1)", D)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(INSERT_PAYMENT, game, payment_id, D)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(INSERT_REPORT_ROW, game, payment_id, D)


async def test_payments_loaded_before_the_id_checks_are_corrected_each_once(client, pool, task_queue, worker):
    # Rows loaded before the checks existed keep their IDs (the checks are NOT VALID); bypass the
    # checks the way such rows got in, if they exist at all.
    for table in ("ledger_payments", "ledger_report_rows"):
        for name in await pool.fetch(
            "SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'c'"
            " AND pg_get_constraintdef(oid) LIKE '%game%' OR conrelid = $1::regclass AND contype = 'c'"
            " AND pg_get_constraintdef(oid) LIKE '%payment_id%'",
            table,
        ):
            await pool.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name["conname"]}"')
    await pool.execute("INSERT INTO ledger_days (business_date, shards, payments) VALUES ($1, 1, $2)", D, len(TWINS))
    for game, payment_id in TWINS:
        await pool.execute(INSERT_PAYMENT, game, payment_id, D)
        await pool.execute(INSERT_REPORT_ROW, game, payment_id, D)

    result = await reconcile(client, pool, task_queue, D, shards=1, batch_size=100)

    statuses = await pool.fetch("SELECT game, payment_id, status FROM ledger_payments ORDER BY game, payment_id")
    assert [r["status"] for r in statuses] == ["refunded"] * len(TWINS)
    corrected = await pool.fetch("SELECT game, payment_id FROM ledger_corrections ORDER BY game, payment_id")
    assert sorted((r["game"], r["payment_id"]) for r in corrected) == sorted(TWINS)
    assert result.settlement.corrected == len(TWINS) and result.settlement.balanced
