"""The database gauges of core/fleet.py: each reads what it says from the tables."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import asyncpg

from core import fleet
from tests.helpers import deadline_in, seed
from tests.ledger_helpers import reconcile, seed_day


async def state(pool: asyncpg.Pool) -> dict[str, float | None]:
    row = await pool.fetchrow(fleet.SQL.fleet_state)
    assert row is not None
    return dict(row)


async def test_fleet_gauges_read_held_accounts_outbox_lateness_and_ledger(pool, client, task_queue, worker) -> None:
    empty = await state(pool)
    assert empty == {
        "held_accounts": 0,
        "cleanups_in_flight": 0,
        "outbox_backlog": 0,
        "outbox_dead_letters": 0,
        "lateness_max_15m": 0,
        "ledger_last_settled_date": None,
    }
    accounts = await seed(pool, deadline_in(-60), 10)
    await pool.execute(
        "UPDATE accounts SET status = 'cleaning', claimed_by = CASE WHEN account_id = ANY($1) THEN 'c1' ELSE 'c2' END "
        "WHERE account_id = ANY($2)",
        accounts[:2],
        accounts[:5],
    )
    late = datetime.now(UTC) - timedelta(seconds=30)
    await pool.execute(
        "UPDATE accounts SET status = 'cleaned', cleaned_at = $2, "
        "renewal_deadline = $2::timestamptz - interval '7 seconds' WHERE account_id = ANY($1)",
        accounts[5:7],
        late,
    )
    for i, status in enumerate(["pending", "pending", "pending", "dead", "delivered"]):
        await pool.execute(
            "INSERT INTO outbox (event_key, kind, account_id, source_id, payload, status, dead_reason) "
            "VALUES ($1, 'renewal_reminder', $2, 'test', '{}', $3, CASE WHEN $3 = 'dead' THEN 'test' END)",
            f"fleet-{i}",
            accounts[0],
            status,
        )
    business_date = date(2026, 3, 2)
    await seed_day(pool, business_date, payments=50, shards=1)
    await reconcile(client, pool, task_queue, business_date)

    got = await state(pool)
    assert (got["held_accounts"], got["cleanups_in_flight"]) == (5, 2)
    assert (got["outbox_backlog"], got["outbox_dead_letters"]) == (3, 1)
    assert abs(float(got["lateness_max_15m"] or 0) - 7.0) < 0.01
    assert got["ledger_last_settled_date"] == datetime(2026, 3, 2, tzinfo=UTC).timestamp()
