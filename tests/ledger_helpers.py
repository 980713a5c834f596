"""Helpers of the ledger tests: seeding a day, running a date, digests and double-posting counts."""

from __future__ import annotations

import asyncio
import time
from datetime import date
from typing import Any

import asyncpg
from temporalio.client import Client

from ledger.models import LedgerReconciliationResult
from ledger.operations import ReconcileRequest, start_reconciliation
from ledger.seed import LedgerSeedResult, seed_ledger_day, seed_spec
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

# Every table the reconciliation writes, with the order that makes its digest deterministic.
DIGEST_TABLES = {
    "ledger_payments": "game, payment_id",
    "ledger_report_rows": "report_row_id",
    "ledger_corrections": "idempotency_key",
    "ledger_review": "review_key",
    "ledger_shard_reports": "business_date, shard",
    "ledger_settlements": "business_date",
    "ledger_settlement_revisions": "business_date, revision",
    "ledger_days": "business_date",
}
IDENTITY_SEQUENCES = [
    ("ledger_report_rows", "report_row_id"),
    ("ledger_corrections", "correction_id"),
    ("ledger_review", "review_id"),
]


def id_prefix(task_queue: str) -> str:
    """Workflow IDs per test: the Temporal server is shared by the whole session."""
    return f"ledger-{task_queue}"


async def seed_day(
    pool: asyncpg.Pool, business_date: date, payments: int = 2000, shards: int = 4, **rates: Any
) -> LedgerSeedResult:
    defaults: dict[str, Any] = {
        "refund_rate": 0.02,
        "small_mismatch_rate": 0.02,
        "large_mismatch_rate": 0.01,
        "unsettled_rate": 0.01,
        "unknown_rate": 0.01,
        "duplicate_rate": 0.02,
    }
    spec = seed_spec(business_date=business_date, payments=payments, shards=shards, **(defaults | rates))
    result = await seed_ledger_day(pool, spec)
    assert result.created
    return result


async def reconcile(
    client: Client, pool: asyncpg.Pool, task_queue: str, business_date: date, **options: Any
) -> LedgerReconciliationResult:
    options.setdefault("heartbeat_timeout_seconds", 2.0)
    options.setdefault("id_prefix", id_prefix(task_queue))
    started = await start_reconciliation(
        client, pool, task_queue, ReconcileRequest(business_date=business_date, **options)
    )
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)
    return await asyncio.wait_for(handle.result(), timeout=90)


async def digest(pool: asyncpg.Pool) -> dict[str, Any]:
    """Row counts and an md5 of every row (timestamps included) of each ledger table, and the
    identity sequences (an INSERT that conflicts would still consume a value)."""
    out: dict[str, Any] = {}
    for table, order in DIGEST_TABLES.items():
        row = await pool.fetchrow(
            f"SELECT count(*) AS n, md5(coalesce(string_agg(t::text, '|' ORDER BY {order}), '')) AS h FROM {table} t"
        )
        assert row is not None
        out[table] = (row["n"], row["h"])
    for table, column in IDENTITY_SEQUENCES:
        seq = await pool.fetchval("SELECT pg_get_serial_sequence($1, $2)", table, column)
        out[f"{table}.{column}"] = tuple(await pool.fetchrow(f"SELECT last_value, is_called FROM {seq}"))
    return out


async def double_postings(pool: asyncpg.Pool) -> int:
    """Corrections applied more than once, or a ledger version that does not match its corrections."""
    value = await pool.fetchval(
        """
        SELECT
          (SELECT count(*) - count(DISTINCT idempotency_key) FROM ledger_corrections)
          + (SELECT count(*) - count(DISTINCT (game, payment_id, business_date)) FROM ledger_corrections)
          + (SELECT count(*) - count(DISTINCT review_key) FROM ledger_review)
          + (SELECT count(*) FROM ledger_payments p
             WHERE p.version <> 1 + (SELECT count(*) FROM ledger_corrections c
                                     WHERE c.game = p.game AND c.payment_id = p.payment_id))
        """
    )
    return int(value)


async def wait_for_process(proc: Any, within: float = 90) -> int:
    deadline = time.monotonic() + within
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError("worker process did not exit in time")
        await asyncio.sleep(0.2)
    return int(proc.returncode)
