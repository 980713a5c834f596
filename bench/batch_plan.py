"""One batch of each job under EXPLAIN ANALYZE: `python -m bench.batch_plan --accounts 20000 --payments 40000`.

Cleanup:
Seeds one cohort into a fresh database (no Temporal), claims it into one partition with the
pipeline's own chunked claim, then runs the compiled batch statement (the worker's, from the
declared targets) under `EXPLAIN (ANALYZE, FORMAT JSON)` for the first batch of each size, each in
a transaction that is rolled back, so every size sees the same data. Prints the execution time,
the time per account and the plan's most expensive join nodes, for the custom plan (what the first
executions of a prepared statement use) and for the generic plan (what asyncpg's cached prepared
statement may switch to after five executions).

Ledger: one business date seeded with the generator (default discrepancy rates) into one shard,
analyzed as a nightly load is, and the reconcile_batch statement for the first batch of each size,
rolled back likewise.

The guard against a plan that turns quadratic again: besides the time, each plan's *rows
processed* (every node's rows, plus the rows its filters and join filters removed, times its
loops) is counted, per key. A plan whose cost per key is flat processes about as many rows per
key at both sizes; one that compares every key of the batch with every other (the cleanup's
nested-loop join filter before the fix) processes five times as many per key at 5,000 as at
1,000. `rows_per_key_growth` is that ratio (largest size over smallest) for each job and plan
mode, `worst_rows_per_key_growth` the largest of them: tests/test_bench_smoke.py runs this at
small sizes and fails above `GROWTH_LIMIT`. It is counted, not timed, so the machine's load does
not move it; `ms_per_key_growth` (timed) is printed next to it. And a plan may stay flat per key
while reading a whole table per batch (a hash of every account): `full_table_scans` lists every
sequential scan that read more rows than its batch has keys, by plan; the smoke test wants none.
Generic plans are real ones (`PREPARE`, `EXECUTE` under `force_generic_plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg

import ledger
from activities.cleanup import claim_in_chunks
from bench.common import run_benchmark
from cleanup.batches import CompiledCleanup
from cleanup.models import ClaimChunkedInput
from cleanup.targets import load_targets
from core import db
from core.config import Settings
from core.queries import load
from demo.fixture import create_game_schema, seed_accounts
from devstack import embedded
from ledger.seed import seed_ledger_day, seed_spec

LEDGER_SQL = load(ledger.__file__)

JOIN_NODES = {"Nested Loop", "Hash Join", "Merge Join"}
# A flat plan stays near 1 (the sizes' fixed parts differ a little); a quadratic one reaches the
# ratio of the sizes (5 for 1,000 -> 5,000 or 200 -> 1,000).
GROWTH_LIMIT = 2.0
REMOVED = ("Rows Removed by Filter", "Rows Removed by Join Filter", "Rows Removed by Index Recheck")


@contextlib.asynccontextmanager
async def fresh_database_url() -> AsyncIterator[str]:
    """A fresh, migrated database in the embedded Postgres (or $DATABASE_URL's server); no Temporal."""
    base = Settings.from_env()
    admin_url = base.database_url or embedded.embedded_postgres_url(base.state_dir)
    name = f"bench_{uuid.uuid4().hex[:10]}"
    url = await db.create_database(admin_url, name, migrate=True)
    await create_game_schema(url)
    try:
        yield url
    finally:
        await db.drop_database(admin_url, name)


@contextlib.asynccontextmanager
async def fresh_database() -> AsyncIterator[asyncpg.Pool]:
    """`fresh_database_url`, as a pool of a few connections."""
    async with fresh_database_url() as url:
        pool = await db.create_pool(url, max_size=4)
        try:
            yield pool
        finally:
            await pool.close()


def _walk(node: dict[str, Any], depth: int = 0) -> list[tuple[int, dict[str, Any]]]:
    out = [(depth, node)]
    for child in node.get("Plans", []):
        out.extend(_walk(child, depth + 1))
    return out


def summarize(plan_json: Any) -> dict[str, Any]:
    doc = plan_json[0] if isinstance(plan_json, list) else plan_json
    nodes = _walk(doc["Plan"])
    joins = sorted(
        (
            {
                "node": n["Node Type"],
                "join_filter": n.get("Join Filter"),
                "estimated_rows": n.get("Plan Rows"),
                "actual_rows": n.get("Actual Rows"),
                "rows_removed_by_join_filter": n.get("Rows Removed by Join Filter", 0),
                "total_ms": round(n.get("Actual Total Time", 0.0) * n.get("Actual Loops", 1), 2),
            }
            for _, n in nodes
            if n["Node Type"] in JOIN_NODES
        ),
        key=lambda j: -j["total_ms"],
    )
    return {
        "execution_ms": round(doc["Execution Time"], 2),
        "planning_ms": round(doc["Planning Time"], 2),
        "rows_processed": rows_processed(nodes),
        "top_joins": joins[:3],
        "seq_scans": [
            {"table": n.get("Relation Name"), "rows_processed": rows_processed([(0, n)])}
            for _, n in nodes
            if n["Node Type"] == "Seq Scan"
        ],
    }


def full_scans(summary: dict[str, Any], keys: int) -> list[dict[str, Any]]:
    """Sequential scans that read more rows than the batch has keys: a plan that reads a whole table
    per batch (a hash of every account for a batch of 5,000 did) costs what the table holds, not
    what the batch does; rows per key can stay nearly flat while it does so."""
    return [s for s in summary["seq_scans"] if s["rows_processed"] > keys]


def rows_processed(nodes: list[tuple[int, dict[str, Any]]]) -> int:
    """Every row a node emitted or threw away (filters, join filters, rechecks), over all its loops."""
    total = 0.0
    for _, n in nodes:
        per_loop = n.get("Actual Rows", 0) + sum(n.get(k, 0) for k in REMOVED)
        total += per_loop * n.get("Actual Loops", 1)
    return round(total)


def growth(results: dict[str, Any], prefix: str, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Per key, the largest batch size over the smallest: rows processed (counted) and time."""
    small, big = results[f"{prefix}_{min(sizes)}"], results[f"{prefix}_{max(sizes)}"]
    per_key = {s: results[f"{prefix}_{s}"]["rows_processed"] / s for s in (min(sizes), max(sizes))}
    return {
        "rows_per_key_growth": round(per_key[max(sizes)] / per_key[min(sizes)], 3),
        "ms_per_key_growth": round(
            (big["execution_ms"] / max(sizes)) / max(small["execution_ms"] / min(sizes), 1e-9), 3
        ),
    }


async def explain_prepared(pool: asyncpg.Pool, sql: str, args: tuple[Any, ...], generic: bool) -> dict[str, Any]:
    """EXPLAIN ANALYZE of `sql` as a prepared statement, rolled back. A generic plan needs `PREPARE`
    and `EXECUTE`: `EXPLAIN` of the statement with bound parameters plans it for those values (a
    custom plan) whatever `plan_cache_mode` says (docs/decisions/0012-custom-plans.md)."""
    mode = "force_generic_plan" if generic else "force_custom_plan"
    # EXECUTE takes no bind parameters: its arguments as literals (this module's own values).
    literals = ", ".join(str(a) if isinstance(a, int) else "'" + str(a).replace("'", "''") + "'" for a in args)
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
            await conn.execute("PREPARE explained AS " + sql)
            raw = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE explained({literals})")
        finally:
            await tx.rollback()
            await conn.execute("DEALLOCATE explained")  # it outlives the transaction
    return summarize(json.loads(raw) if isinstance(raw, str) else raw)


async def explain_batch(
    pool: asyncpg.Pool, compiled: CompiledCleanup, cleanup_id: str, batch_size: int, generic: bool
) -> dict[str, Any]:
    first = compiled.batch_args(cleanup_id=cleanup_id, partition_no=0, after_account_id="", batch_size=batch_size)
    summary = await explain_prepared(pool, compiled.batch_sql, first, generic)
    summary["full_scans"] = full_scans(summary, batch_size)
    summary["ms_per_account"] = round(summary["execution_ms"] / batch_size, 4)
    summary["rows_per_account"] = round(summary["rows_processed"] / batch_size, 2)
    return summary


async def explain_ledger_batch(
    pool: asyncpg.Pool, business_date: date, batch_size: int, generic: bool
) -> dict[str, Any]:
    args = LEDGER_SQL.bind(
        "reconcile_batch",
        business_date=business_date,
        shard=0,
        after_game="",
        after_payment_id="",
        batch_size=batch_size,
        tolerance_cents=50,
        workflow_id="explain",
    )
    summary = await explain_prepared(pool, LEDGER_SQL.reconcile_batch, args, generic)
    summary["full_scans"] = full_scans(summary, batch_size)
    summary["ms_per_key"] = round(summary["execution_ms"] / batch_size, 4)
    summary["rows_per_key"] = round(summary["rows_processed"] / batch_size, 2)
    return summary


async def run_ledger(payments: int, sizes: tuple[int, ...], repeat: int) -> dict[str, Any]:
    async with fresh_database() as pool:
        business_date = date(2026, 10, 1)
        await seed_ledger_day(pool, seed_spec(business_date=business_date, payments=payments, shards=1))
        await pool.execute("VACUUM ANALYZE")
        results: dict[str, Any] = {}
        for generic in (False, True):
            for size in sizes:
                runs = [await explain_ledger_batch(pool, business_date, size, generic) for _ in range(repeat)]
                best = min(runs, key=lambda r: r["execution_ms"])
                best["execution_ms_all_runs"] = [r["execution_ms"] for r in runs]
                results[f"ledger_{'generic' if generic else 'custom'}_plan_batch_{size}"] = best
        for mode in ("custom", "generic"):
            results[f"ledger_{mode}_plan_growth"] = growth(results, f"ledger_{mode}_plan_batch", sizes)
    return results


async def run(
    accounts: int = 20_000, sizes: tuple[int, ...] = (1000, 5000), repeat: int = 3, payments: int = 40_000
) -> dict[str, Any]:
    async with fresh_database() as pool:
        deadline = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        await seed_accounts(pool, prefix="e", deadline=deadline, count=accounts)
        # Statistics as a real deadline sees them (and the cohort benchmark): the tables analyzed
        # before the claim, the claim's rows just written and not analyzed yet.
        await pool.execute("VACUUM ANALYZE")
        cleanup_id = "explain"
        await claim_in_chunks(
            pool,
            ClaimChunkedInput(
                cleanup_id=cleanup_id,
                deadline_from=deadline,
                deadline_until=deadline + timedelta(microseconds=1),
                partitions=1,
            ),
        )
        compiled = await CompiledCleanup.compile(pool, load_targets())
        results: dict[str, Any] = {}
        # Then again once the claims are analyzed (autovacuum does so during a long cleanup): with
        # the batch's size known, the planner hashed every account for a batch of 5,000.
        for analyzed in ("", "analyzed_"):
            if analyzed:
                await pool.execute("ANALYZE")
            for generic in (False, True):
                for size in sizes:
                    # The fastest of a few runs: the machine is shared, the plan is what is measured.
                    runs = [await explain_batch(pool, compiled, cleanup_id, size, generic) for _ in range(repeat)]
                    best = min(runs, key=lambda r: r["execution_ms"])
                    best["execution_ms_all_runs"] = [r["execution_ms"] for r in runs]
                    results[f"{analyzed}{'generic' if generic else 'custom'}_plan_batch_{size}"] = best
            for mode in ("custom", "generic"):
                results[f"{analyzed}{mode}_plan_growth"] = growth(results, f"{analyzed}{mode}_plan_batch", sizes)
    if payments:
        results.update(await run_ledger(payments, sizes, repeat))
    growths = {k: v["rows_per_key_growth"] for k, v in results.items() if k.endswith("_plan_growth")}
    scans = {k: v["full_scans"] for k, v in results.items() if isinstance(v, dict) and v.get("full_scans")}
    return {
        "scenario": "batch_plan",
        "accounts": accounts,
        "payments": payments,
        "sizes": list(sizes),
        "rows_per_key_growth": growths,
        "worst_rows_per_key_growth": max(growths.values()),
        # Plans that read a whole table per batch, by plan: none expected.
        "full_table_scans": scans,
        "growth_limit": GROWTH_LIMIT,
        # For run_all's summary: the guard's figure and its limit.
        "ratio": max(growths.values()),
        "target": f"<= {GROWTH_LIMIT}",
        "load_average_1m": round(os.getloadavg()[0], 2),
        **results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=20_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--payments", type=int, default=40_000, help="0: skip the ledger")
    args = parser.parse_args()
    print(json.dumps(run_benchmark(run(args.accounts, tuple(args.sizes), args.repeat, args.payments)), indent=2))


if __name__ == "__main__":
    main()
