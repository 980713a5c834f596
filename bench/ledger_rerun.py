"""Re-checks of a reconciled night: `python -m bench.ledger_rerun --payments 1000000`.

One business date is reconciled through the pipeline (`start_reconciliation`, date-keyed workflow
ID, worker process). Then, as an operator does after late data (`starter.py ledger reconcile --date D
--recheck`), it is re-checked twice, each a new run of the same workflow under its own ID:

1. **unchanged**: nothing changed since the night. Every shard's fingerprint (read under the
   shard's lock) equals its recorded report's, so no key is judged and nothing is written: no
   revision, no row. Ratio = re-check seconds / first-run seconds (target <= 0.3).
2. **changed**: first 1% of the payments change (`--changed-per-10000`, spread over every shard;
   bench/late_data.sql): half get a hand edit of their ledger amount within tolerance, half a late
   provider row that conflicts with the reported one. Every shard's inputs differ, so every shard
   is judged again in full; the re-check writes only the new corrections and review rows and
   records revision 2. Ratio = re-check seconds / first-run seconds (no target: it re-judges every
   shard, which is the first run's work); also the rows it wrote, its dead tuples and what its
   revision says, against what the change must add.

Around each re-check, after the server's statistics have been flushed (each pipeline run has a
worker process of its own, stopped before the counters are read: a backend flushes its statistics
when it exits, at once, where an idle one waits up to 10 s), the cumulative counters of
pg_stat_user_tables (inserts, updates, deletes, dead tuples, vacuums), the relation sizes and the
identity sequences of every ledger table are compared: a write would show as an insert, update or
delete, a rejected INSERT as a dead tuple, a grown relation or a consumed identity value. Before
each first snapshot the tables just written are vacuumed (untimed), so an autovacuum of them
cannot run during the re-check and reset its counters.

The unchanged re-check is also measured for the direct path (first and second run of the same
batch statement from this process on a second date, no Temporal, no shortcut): the cost of
judging everything again, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from datetime import date
from typing import Any

import asyncpg

import bench
from bench.common import Stack, machine, peak_rss_mib, run_benchmark, stack, wait_for_worker
from bench.ledger_reconciliation import (
    business_dates,
    direct_reconciliation,
    expected,
    outcome,
    pipeline_reconciliation,
    seed,
)
from budget.controller import BudgetChange, set_budget
from core.queries import load

LEDGER_TABLES = [
    "ledger_payments",
    "ledger_report_rows",
    "ledger_corrections",
    "ledger_review",
    "ledger_shard_reports",
    "ledger_settlements",
    "ledger_settlement_revisions",
    "ledger_days",
]
IDENTITY_SEQUENCES = {
    "ledger_report_rows": "report_row_id",
    "ledger_corrections": "correction_id",
    "ledger_review": "review_id",
}
LATE = load(bench.__file__, "late_data.sql")
OTHER_BACKENDS = """SELECT coalesce(array_agg(pid), '{}') FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend' AND NOT (pid = ANY($1::int[]))"""
TOLERANCE_CENTS = 50
COUNTERS = ["n_tup_ins", "n_tup_upd", "n_tup_del", "n_dead_tup", "vacuum_count", "autovacuum_count"]
VACUUM_EFFECTS = "VACUUM ANALYZE ledger_corrections, ledger_review"
VACUUM_CHANGED = "VACUUM ANALYZE ledger_payments, ledger_report_rows, ledger_corrections, ledger_review"
# How long the backends of a stopped worker may take to exit (and flush their statistics).
BACKEND_EXIT_SECONDS = 30.0


async def _read_stats(pool: asyncpg.Pool) -> dict[str, dict[str, int]]:
    rows = await pool.fetch(
        f"SELECT relname, {', '.join(COUNTERS)}, pg_relation_size(relid) AS heap_bytes,"
        " pg_indexes_size(relid) AS index_bytes"
        " FROM pg_stat_user_tables WHERE relname = ANY($1::text[])",
        LEDGER_TABLES,
    )
    out = {r["relname"]: {k: int(v) for k, v in r.items() if k != "relname"} for r in rows}
    for table, column in IDENTITY_SEQUENCES.items():
        seq = await pool.fetchval("SELECT pg_get_serial_sequence($1, $2)", table, column)
        last = await pool.fetchrow(f"SELECT last_value, is_called FROM {seq}")
        assert last is not None
        out[table]["identity_last_value"] = int(last["last_value"]) if last["is_called"] else 0
    return out


async def table_stats(s: Stack) -> dict[str, dict[str, int]]:
    """Cumulative statistics of the ledger tables once every backend has flushed its own.

    A backend flushes pending statistics when it exits, or when idle at most every 10 s
    (PGSTAT_IDLE_INTERVAL), or at once after `pg_stat_force_next_flush()` (PG15+, the calling
    backend only). So: stop the worker processes first (`pipeline_on_a_worker_of_its_own`); here
    every connection of this process's pools is told to flush, then the reading
    waits until no other backend of the database is left (the stopped worker's have exited), then
    until two reads agree.
    """
    pool, ours = s.pool, set()
    for p in (s.pool, *([s.claim_backends] if s.claim_backends is not None else [])):
        conns = [await p.acquire() for _ in range(p.get_max_size())]  # every connection of the pool
        try:
            for conn in conns:
                ours.add(conn.get_server_pid())
                if await conn.fetchval("SELECT to_regproc('pg_stat_force_next_flush') IS NOT NULL"):
                    await conn.execute("SELECT pg_stat_force_next_flush()")
        finally:
            for conn in conns:
                await p.release(conn)
    deadline = time.monotonic() + BACKEND_EXIT_SECONDS
    while set(await pool.fetchval(OTHER_BACKENDS, list(ours))):
        if time.monotonic() > deadline:
            raise RuntimeError("backends of a stopped worker still connected: statistics incomplete")
        await asyncio.sleep(0.1)
    previous = await _read_stats(pool)
    while True:
        await asyncio.sleep(0.5)
        current = await _read_stats(pool)
        if current == previous:
            return current
        previous = current


async def pipeline_on_a_worker_of_its_own(s: Stack, peaks: list[float], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`pipeline_reconciliation` on a worker process started for it and stopped after it, so its
    backends have flushed their statistics by the time `table_stats` reads them. Start-up is not
    billed to the run (`wait_for_worker` waits for this process's pollers); its peak RSS goes to `peaks`."""
    worker = s.start_worker()
    await wait_for_worker(s.client, s.settings.task_queue, pid=worker.pid)
    try:
        return await pipeline_reconciliation(s, *args, **kwargs)
    finally:
        peaks.append(peak_rss_mib(worker.pid))
        assert worker.poll() is None, "the worker process died"
        worker.terminate()
        await asyncio.to_thread(worker.wait, BACKEND_EXIT_SECONDS)


def deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {t: {k: after[t][k] - before[t][k] for k in before[t]} for t in LEDGER_TABLES if t in before}


def writes(table_deltas: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Rows written (inserted, updated, deleted) and dead tuples left, per ledger table and in all."""
    per_table = {
        t: {"written": d["n_tup_ins"] + d["n_tup_upd"] + d["n_tup_del"], "dead_tuples": d["n_dead_tup"]}
        for t, d in table_deltas.items()
        if d["n_tup_ins"] or d["n_tup_upd"] or d["n_tup_del"] or d["n_dead_tup"]
    }
    return {
        "rows_written": sum(v["written"] for v in per_table.values()),
        # A negative delta is a read pruning an older run's row versions, not this run's doing.
        "dead_tuples": sum(max(0, v["dead_tuples"]) for v in per_table.values()),
        "dead_tuples_in_effect_tables": sum(
            table_deltas[t]["n_dead_tup"] for t in ("ledger_corrections", "ledger_review")
        ),
        "per_table": per_table,
    }


async def changed_recheck(
    s: Stack,
    peaks: list[float],
    business_date: date,
    first_seconds: float,
    per_10000: int,
    parallel: int,
    batch_size: int,
) -> dict[str, Any]:
    """Change `per_10000` of the date's payments, then re-check it: seconds, writes, the revision."""
    t = time.perf_counter()
    change = await s.pool.fetchrow(
        LATE.change_payments,
        *LATE.bind(
            "change_payments", business_date=business_date, per_10000=per_10000, tolerance_cents=TOLERANCE_CENTS
        ),
    )
    assert change is not None
    await s.pool.execute(VACUUM_CHANGED)
    change_seconds = time.perf_counter() - t
    before = await table_stats(s)
    recheck = await pipeline_on_a_worker_of_its_own(s, peaks, business_date, parallel, batch_size, recheck=True)
    after = await table_stats(s)
    revision = await s.pool.fetchrow(LATE.latest_revision, business_date)
    assert revision is not None
    table_deltas = deltas(before, after)
    shards = recheck["result"].shards
    return {
        "change": dict(change),
        "change_and_vacuum_seconds_untimed": round(change_seconds, 2),
        "seconds": round(recheck["seconds"], 3),
        "ratio": round(recheck["seconds"] / first_seconds, 3),
        "shards_judged_again": sum(not r.unchanged_since_report for r in shards),
        "batches": recheck["batches"],
        "revision": {k: (list(v) if k == "changed_shards" else v) for k, v in dict(revision).items()},
        "revision_adds_what_the_change_must": (
            revision["new_corrections"] == change["expect_new_corrections"]
            and revision["new_review_rows"] == change["expect_new_review_rows"]
            and revision["new_discrepancies"] == change["expect_new_corrections"] + change["expect_new_review_rows"]
        ),
        **writes(table_deltas),
        "table_deltas": table_deltas,
        "timeline": recheck["timeline"],
    }


async def run(
    payments: int,
    shards: int = 16,
    parallel: int = 8,
    batch_size: int = 1000,
    with_direct: bool = True,
    changed_per_10000: int = 100,
    budget: bool = True,
) -> dict[str, Any]:
    load_before = round(os.getloadavg()[0], 2)
    async with stack() as s:
        if not budget:
            # Every ledger batch takes the database load budget's rows (4,000/s by default), which
            # then bounds a run that judges keys; off, runs go as fast as the machine allows.
            await set_budget(s.pool, BudgetChange(enabled=False))
        pipeline_date, direct_date = business_dates(2)
        t = time.perf_counter()
        seeded = await seed(s.pool, pipeline_date, payments, shards)
        seeded_direct = await seed(s.pool, direct_date, payments, shards) if with_direct else None
        await s.pool.execute("VACUUM ANALYZE")
        seed_seconds = time.perf_counter() - t

        peaks: list[float] = []
        at_start = await table_stats(s)
        first = await pipeline_on_a_worker_of_its_own(s, peaks, pipeline_date, parallel, batch_size)
        # The first run's inserts would trigger an autovacuum of the effect tables during the rerun,
        # which resets n_dead_tup; vacuum them now (untimed) so the rerun's counters stand alone.
        await s.pool.execute(VACUUM_EFFECTS)
        before = await table_stats(s)
        # The counters must see what a run wrote, or "the rerun wrote nothing" proves nothing: the
        # first run's inserts as counted, beside the rows its effect tables hold (only it wrote them).
        first_inserts = {
            t: [before[t]["n_tup_ins"] - at_start[t]["n_tup_ins"], await s.pool.fetchval(f"SELECT count(*) FROM {t}")]
            for t in ("ledger_corrections", "ledger_review")
        }
        rerun = await pipeline_on_a_worker_of_its_own(s, peaks, pipeline_date, parallel, batch_size, recheck=True)
        after = await table_stats(s)
        unchanged_revision = await s.pool.fetchrow(LATE.latest_revision, pipeline_date)
        changed = await changed_recheck(
            s, peaks, pipeline_date, first["seconds"], changed_per_10000, parallel, batch_size
        )

        direct: dict[str, Any] | None = None
        if with_direct:
            d1 = await direct_reconciliation(s.pool, direct_date, shards, parallel, batch_size, "direct-first")
            await s.pool.execute(VACUUM_EFFECTS)
            d_before = await table_stats(s)
            d2 = await direct_reconciliation(s.pool, direct_date, shards, parallel, batch_size, "direct-rerun")
            d_after = await table_stats(s)
            assert seeded_direct is not None
            direct = {
                "first_seconds": round(d1["seconds"], 3),
                "rerun_seconds": round(d2["seconds"], 3),
                "ratio": round(d2["seconds"] / d1["seconds"], 3),
                "first_outcome": outcome(d1["settlement"]),
                "rerun_outcome": outcome(d2["settlement"]),
                "expected": expected(seeded_direct),
                "rerun_table_deltas": deltas(d_before, d_after),
            }
        # One worker process per pipeline run (see table_stats): the largest of their peaks.
        memory = {
            "worker_peak_rss_mib": round(max(peaks), 1),
            "temporal_server_peak_rss_mib": s.memory()["temporal_server_peak_rss_mib"],
        }

    per_run = {"batches_this_attempt", "unchanged_since_report"}
    rerun_shards = [r.model_dump(exclude=per_run) for r in rerun["result"].shards]
    first_shards = [r.model_dump(exclude=per_run) for r in first["result"].shards]
    table_deltas = deltas(before, after)
    return {
        "scenario": "ledger_rerun",
        "payments": payments,
        "shards": shards,
        "parallel_shards": parallel,
        "batch_size": batch_size,
        "load_budget": "default (LOAD_BUDGET_* settings)" if budget else "off (budget set --enabled off)",
        "seed_seconds": round(seed_seconds, 2),
        "rerun_how": "a re-check (`ledger reconcile --date D --recheck`): a new run of the date under its own"
        " workflow ID",
        "first_run_seconds": round(first["seconds"], 3),
        "rerun_seconds": round(rerun["seconds"], 3),
        "first_run_payments_per_s": round(payments / first["seconds"], 1),
        "rerun_payments_per_s": round(payments / rerun["seconds"], 1),
        "ratio": round(rerun["seconds"] / first["seconds"], 3),
        "target": "<= 0.3",
        "expected": expected(seeded),
        "first_outcome": outcome(first["settlement"]),
        "rerun_outcome": outcome(rerun["settlement"]),
        "rerun_reports_same_as_first": rerun_shards == first_shards,
        "rerun_shards_unchanged_since_report": sum(r.unchanged_since_report for r in rerun["result"].shards),
        "rerun_batches": rerun["batches"],
        "first_timeline": first["timeline"],
        "rerun_timeline": rerun["timeline"],
        "first_run_inserts_counted_and_held": first_inserts,
        "counters_saw_the_first_run": all(counted == held > 0 for counted, held in first_inserts.values()),
        "rerun_table_deltas": table_deltas,
        "rerun_rows_inserted": sum(table_deltas[t]["n_tup_ins"] for t in LEDGER_TABLES),
        "rerun_dead_tuples_in_effect_tables": sum(
            table_deltas[t]["n_dead_tup"] for t in ("ledger_corrections", "ledger_review")
        ),
        "rerun_rows_written": writes(table_deltas)["rows_written"],
        "rerun_dead_tuples": writes(table_deltas)["dead_tuples"],
        "rerun_latest_revision": unchanged_revision["revision"] if unchanged_revision else None,
        "changed": changed,
        "direct": direct,
        **memory,
        "load_average_1m_before_and_after": [load_before, round(os.getloadavg()[0], 2)],
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--payments", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--no-direct", action="store_true", help="skip the direct first/rerun comparison")
    parser.add_argument(
        "--changed-per-10000", type=int, default=100, help="payments changed before the second re-check (100: 1%%)"
    )
    parser.add_argument(
        "--no-budget", action="store_true", help="turn the database load budget off (it bounds runs that judge keys)"
    )
    args = parser.parse_args()
    result = run_benchmark(
        run(
            args.payments,
            args.shards,
            args.parallel,
            args.batch_size,
            not args.no_direct,
            args.changed_per_10000,
            not args.no_budget,
        )
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
