"""Ledger reconciliation, floor vs. direct path vs. pipeline: `python -m bench.ledger_reconciliation --payments 200000`.

Five business dates of the same size are seeded into one fresh database (the same generator as
`starter.py ledger seed`, default discrepancy rates). The *direct* runs reconcile a date from this
process with no Temporal: `check_day`, then every shard through `reconcile_shard_batches` (the
very loop and batch statement the activity runs, same batch size, same shard parallelism), each
shard's report, and the settlement; once before and once after the pipeline, and the faster one
is the limit. The *pipeline* run is the real thing: `start_reconciliation` (the CLI's start path,
date-keyed workflow ID) of `LedgerReconciliationWorkflow`, executed by a separate worker process,
timed from the start call to the settled result.
The ratio is payments/s of the pipeline over that of the faster direct run. The *floor* runs
reconcile a date with `ledger_floor` (bench/floor.sql) on as many backends as there are cores
(`bench.floor.FLOOR_BACKENDS`, printed as `floor_backends`; no more than the date has shards): the
date's shards dealt to that many slices (shard % n = k) by one untimed query, each slice on its
own backend, all at once, one set-based statement per shard of the slice in turn (each in its own
transaction: over a whole slice the statement sorted on disk, see `floor_reconciliation`), timed from the
start of the first to the end of the last, the outcomes summed. The same rules and effects (every
ledger row of the slice locked, corrections under their idempotency key and their ledger updates,
review rows), no keyset batches, no shard lock, no fingerprint, no reports; once before and once
after the pipeline, the faster one is the floor. Also printed: direct / floor and pipeline /
floor. (Figures measured before the floor was sliced used one statement on one backend.)

Every run starts from the same effect tables: after each run its corrections and review rows
(only those: its ledger updates and reports stay) are deleted and both tables vacuumed; the checked
outcome of every run is read before that. (The batch statement looks the effect rows up by the
batch's key range, so the previous runs' rows would cost little; the floor's join would pay for
them.)

Besides wall-clock throughput, each run's Postgres CPU time is printed where the server's processes
can be read (`database_cpu_seconds`, summed over every backend of the database: the floor's over all
its slices' backends): on a shared machine it moves far less with the load than the
wall clock, and `direct_over_floor_by_cpu` (floor CPU / direct CPU for the same payments) says
what the batches cost next to the floor whatever the other tenants do. The pipeline runs with the
load budget off (`Stack.budget_off`; the budget is measured by scenario 6).

While the pipeline runs, pg_stat_activity is sampled every 0.2 s for the longest-running statement
of the database and the longest-open transaction holding an XID (its row locks):
`pipeline_longest_statement_seconds`, `pipeline_longest_locking_transaction_seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import date, timedelta
from typing import Any

import asyncpg

import bench
from activities.ledger import LedgerActivities, check_day, reconcile_shard_batches, report_shard
from bench.common import cpu_used, database_cpu_seconds, load_average, machine, run_benchmark, stack, wait_for_worker
from bench.floor import FLOOR_BACKENDS, STACK_POOL_SIZE, run_slice_sequences
from budget.controller import LoadBudget, budget_status
from core.queries import load
from ledger.models import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ID_PREFIX,
    LedgerReconciliationResult,
    LedgerSettlement,
    ReconcileShardInput,
    SettleLedgerInput,
    ShardCheckpoint,
    ShardReport,
)
from ledger.operations import ReconcileRequest, start_reconciliation
from ledger.seed import LedgerSeedResult, seed_ledger_day, seed_spec
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

# Business dates well in the past (a date must be over to be reconciled).
FIRST_DATE = date(2026, 10, 1)
TOLERANCE_CENTS = 50
FLOOR = load(bench.__file__, "floor.sql")


def business_dates(n: int) -> list[date]:
    return [FIRST_DATE + timedelta(days=i) for i in range(n)]


async def seed(pool: asyncpg.Pool, business_date: date, payments: int, shards: int) -> LedgerSeedResult:
    """One business day with the generator's default discrepancy rates (ANALYZEd afterwards)."""
    result = await seed_ledger_day(pool, seed_spec(business_date=business_date, payments=payments, shards=shards))
    assert result.created, f"{business_date} was already loaded"
    return result


async def clear_effects(pool: asyncpg.Pool, business_date: date) -> None:
    """Remove one date's corrections and review rows, so the next run sees the same effect tables."""
    await pool.execute("DELETE FROM ledger_corrections WHERE business_date = $1", business_date)
    await pool.execute("DELETE FROM ledger_review WHERE business_date = $1", business_date)
    await pool.execute("VACUUM ANALYZE ledger_corrections, ledger_review")


async def floor_reconciliation(pool: asyncpg.Pool, business_date: date, workflow_id: str) -> dict[str, Any]:
    """The date cut into `FLOOR_BACKENDS` slices of whole shards (shard % n = k; the slices read by
    one untimed query), each on its own backend, all at once: one statement and one transaction per
    shard of the slice, in turn; timed together (start of the first to end of the last), outcomes
    summed. One statement per shard reads the shard in the order of its (date, shard, ...) indexes;
    one statement per slice of 8 shards read both tables whole and sorted the report rows on disk
    (EXPLAIN: Seq Scan, Sort Method: external merge), at 1.6x the CPU (400,000 payments: 9.7 s
    against 6.0 s), more than the batches spend."""
    dealt = FLOOR.bind("ledger_floor_slices", business_date=business_date, slices=FLOOR_BACKENDS)
    slices = [
        [
            FLOOR.bind(
                "ledger_floor",
                business_date=business_date,
                tolerance_cents=TOLERANCE_CENTS,
                workflow_id=workflow_id,
                shard=shard,
            )
            for shard in r["shards"]
        ]
        for r in await pool.fetch(FLOOR.ledger_floor_slices, *dealt)
    ]
    # One statement over a whole shard may outlast the pool's 300 s timeout on a loaded machine.
    run = await run_slice_sequences(pool, FLOOR.ledger_floor, slices, 3600)
    return {
        "seconds": run.seconds,
        "backends": len(slices),
        "outcome": {k: run.total(k) for k in FLOOR_OUTCOME},
        "backend_cpu_s": run.backend_cpu_s,
        "load": run.load,
    }


FLOOR_OUTCOME = ("keys_examined", "discrepancies_found", "corrected", "sent_to_review")


def _noop(_: ShardCheckpoint, __: asyncpg.Record) -> None:
    return None


async def direct_reconciliation(
    pool: asyncpg.Pool,
    business_date: date,
    shards: int,
    parallel: int,
    batch_size: int,
    workflow_id: str,
    budget: LoadBudget | None = None,
) -> dict[str, Any]:
    """The date's reconciliation without orchestration: the activities' code paths called in-process
    (each batch under `budget` when one is given, as the activity's are)."""
    load_before, cpu_before = load_average(), await database_cpu_seconds(pool)
    t0 = time.perf_counter()
    await check_day(pool, business_date, shards)
    limit = asyncio.Semaphore(min(parallel, shards))
    shard_seconds: list[float] = []

    async def shard(s: int) -> ShardReport:
        async with limit:
            t = time.perf_counter()
            inp = ReconcileShardInput(
                business_date=business_date,
                shard=s,
                shards=shards,
                batch_size=batch_size,
                tolerance_cents=TOLERANCE_CENTS,
                workflow_id=workflow_id,
            )
            checkpoint = await reconcile_shard_batches(pool, inp, ShardCheckpoint(), _noop, budget=budget)
            report = await report_shard(pool, inp, checkpoint)
            shard_seconds.append(time.perf_counter() - t)
            return report

    reports = await asyncio.gather(*(shard(s) for s in range(shards)))
    settlement: LedgerSettlement = await LedgerActivities(pool).settle_ledger_date(
        SettleLedgerInput(business_date=business_date, shards=shards, workflow_id=workflow_id)
    )
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "settlement": settlement,
        "batches": sum(r.batches for r in reports),
        "shard_seconds_sum": sum(shard_seconds),
        "backend_cpu_s": cpu_used(cpu_before, await database_cpu_seconds(pool)),
        "load": [load_before, load_average()],
    }


async def pipeline_reconciliation(
    s: Any,
    business_date: date,
    parallel: int,
    batch_size: int,
    id_prefix: str = DEFAULT_ID_PREFIX,
    recheck: bool = False,
) -> dict[str, Any]:
    """The real start path (date-keyed workflow ID, or a re-check's own) to the settled result, on
    the worker process."""
    load_before, cpu_before, orchestration_before = load_average(), await database_cpu_seconds(s.pool), s.process_cpu()
    async with longest_statement(s.pool) as longest:
        result, seconds, handle = await _start_and_wait(s, business_date, parallel, batch_size, id_prefix, recheck)
    cpu_after, orchestration_after = await database_cpu_seconds(s.pool), s.process_cpu()
    load_after = load_average()
    history = await handle.fetch_history()
    return {
        "seconds": seconds,
        "longest": longest,
        "backend_cpu_s": cpu_used(cpu_before, cpu_after),
        "orchestration_cpu_s": {
            k: round(v - b, 2) if v is not None and (b := orchestration_before.get(k)) is not None else None
            for k, v in orchestration_after.items()
        },
        "load": [load_before, load_after],
        "settlement": result.settlement,
        "result": result,
        "batches": sum(r.batches_this_attempt for r in result.shards),
        "history_events": len(history.events),
        "history_bytes": len(history.to_json()),
        "timeline": timeline(history.events, seconds),
    }


async def _start_and_wait(
    s: Any, business_date: date, parallel: int, batch_size: int, id_prefix: str, recheck: bool
) -> tuple[LedgerReconciliationResult, float, Any]:
    """The CLI's start path to the settled result: (result, seconds from the start call, handle)."""
    t0 = time.perf_counter()
    started = await start_reconciliation(
        s.client,
        s.pool,
        s.settings.task_queue,
        ReconcileRequest(
            business_date=business_date,
            max_parallel=parallel,
            batch_size=batch_size,
            tolerance_cents=TOLERANCE_CENTS,
            id_prefix=id_prefix,
            recheck=recheck,
        ),
    )
    assert started.started, f"{started.workflow_id} already existed"
    handle = s.client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)
    result: LedgerReconciliationResult = await handle.result()
    return result, time.perf_counter() - t0, handle


LONGEST = """
SELECT coalesce(max(extract(epoch FROM clock_timestamp() - query_start))
                    FILTER (WHERE state = 'active'), 0)::float8 AS statement,
       coalesce(max(extract(epoch FROM clock_timestamp() - xact_start))
                    FILTER (WHERE backend_xid IS NOT NULL), 0)::float8 AS transaction
FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
"""


@contextlib.asynccontextmanager
async def longest_statement(pool: asyncpg.Pool, every: float = 0.2) -> AsyncIterator[dict[str, float]]:
    """While the block runs, the longest any statement of the database has been running and the longest a
    transaction holding an XID (so its row locks) has been open, sampled from pg_stat_activity every
    `every` seconds on one connection (a statement shorter than that may be missed; none longer)."""
    seen = {"statement_seconds": 0.0, "transaction_seconds": 0.0, "sample_seconds": every}

    async def sample() -> None:
        async with pool.acquire() as conn:
            while True:
                row = await conn.fetchrow(LONGEST)
                assert row is not None
                seen["statement_seconds"] = round(max(seen["statement_seconds"], row["statement"]), 3)
                seen["transaction_seconds"] = round(max(seen["transaction_seconds"], row["transaction"]), 3)
                await asyncio.sleep(every)

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def timeline(events: Any, wall_seconds: float) -> dict[str, float]:
    """Where the pipeline's time went, from the history: orchestration gaps vs. time in activities."""
    t0 = events[0].event_time.ToDatetime()

    def at(e: Any) -> float:
        return float((e.event_time.ToDatetime() - t0).total_seconds())

    scheduled: dict[int, tuple[str, float]] = {}
    spans: list[tuple[str, float, float, float]] = []  # (type, scheduled, started, completed)
    started: dict[int, float] = {}
    for e in events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            scheduled[e.event_id] = (e.activity_task_scheduled_event_attributes.activity_type.name, at(e))
        elif e.HasField("activity_task_started_event_attributes"):
            started[e.activity_task_started_event_attributes.scheduled_event_id] = at(e)
        elif e.HasField("activity_task_completed_event_attributes"):
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            name, s_at = scheduled[sid]
            spans.append((name, s_at, started.get(sid, s_at), at(e)))
    shards = [sp for sp in spans if sp[0] == "reconcile_shard"]
    first_shard, last_shard = min(sp[1] for sp in shards), max(sp[3] for sp in shards)
    waits = [sp[2] - sp[1] for sp in spans]
    return {
        "until_first_shard_scheduled": round(first_shard, 3),
        "shards_first_scheduled_to_last_completed": round(last_shard - first_shard, 3),
        "after_last_shard_to_workflow_closed": round(at(events[-1]) - last_shard, 3),
        "start_call_and_result_outside_history": round(wall_seconds - at(events[-1]), 3),
        "activity_schedule_to_start_mean_ms": round(1000 * sum(waits) / len(waits), 1),
        "activity_schedule_to_start_max_ms": round(1000 * max(waits), 1),
        "shard_activity_seconds_sum": round(sum(sp[3] - sp[2] for sp in shards), 3),
    }


def outcome(settlement: LedgerSettlement) -> dict[str, int]:
    return {
        "keys_examined": settlement.keys_examined,
        "discrepancies_found": settlement.discrepancies_found,
        "corrected": settlement.corrected,
        "sent_to_review": settlement.sent_to_review,
    }


def expected(seeded: LedgerSeedResult) -> dict[str, int]:
    return {
        "keys_examined": seeded.payments + seeded.unknown_payments,
        "discrepancies_found": seeded.expected_discrepancies,
        "corrected": seeded.expected_corrections,
        "sent_to_review": seeded.expected_review,
    }


async def run(
    payments: int, shards: int = 16, parallel: int = 8, batch_size: int = DEFAULT_BATCH_SIZE, budget: str = "off"
) -> dict[str, Any]:
    """`budget`: "off", or "default": the load budget as shipped for the pipeline and the direct runs."""
    load_before = load_average()
    async with stack(pool_size=STACK_POOL_SIZE) as s:
        direct_date, pipeline_date, direct_after_date, floor_date, floor_after_date = business_dates(5)
        t = time.perf_counter()
        seeded = [
            await seed(s.pool, d, payments, shards)
            for d in (direct_date, pipeline_date, direct_after_date, floor_date, floor_after_date)
        ]
        await s.pool.execute("VACUUM ANALYZE")
        seed_seconds = time.perf_counter() - t

        worker = s.start_worker()
        await wait_for_worker(s.client, s.settings.task_queue)
        budgeted = None
        if budget == "off":
            await s.budget_off()
        else:
            budgeted = LoadBudget(s.pool)

        floor = await floor_reconciliation(s.pool, floor_date, "floor-before")
        await clear_effects(s.pool, floor_date)
        direct = await direct_reconciliation(
            s.pool, direct_date, shards, parallel, batch_size, "direct-before", budgeted
        )
        await clear_effects(s.pool, direct_date)
        pipeline = await pipeline_reconciliation(s, pipeline_date, parallel, batch_size)
        budget_after_pipeline = (await budget_status(s.pool)).model_dump()
        await clear_effects(s.pool, pipeline_date)
        # The direct run again, after the pipeline: the limit is the faster of the two direct runs.
        direct_2 = await direct_reconciliation(
            s.pool, direct_after_date, shards, parallel, batch_size, "direct-after", budgeted
        )
        await clear_effects(s.pool, direct_after_date)
        floor_2 = await floor_reconciliation(s.pool, floor_after_date, "floor-after")
        memory = s.memory()
        assert worker.poll() is None, "the worker process died"

    direct_rate = max(payments / d["seconds"] for d in (direct, direct_2))
    pipeline_rate = payments / pipeline["seconds"]
    floor_rate = max(payments / f["seconds"] for f in (floor, floor_2))
    cpu = {
        "floor": [floor["backend_cpu_s"], floor_2["backend_cpu_s"]],
        "direct": [direct["backend_cpu_s"], direct_2["backend_cpu_s"]],
        "pipeline": [pipeline["backend_cpu_s"]],
    }
    least = {k: min(v) for k, v in cpu.items() if all(x is not None for x in v)}
    return {
        "scenario": "ledger_reconciliation",
        "load_budget": budget,
        "load_budget_after_pipeline": {
            k: budget_after_pipeline[k]
            for k in ("doing", "limited_by", "last_stress", "stressed_at", "observed", "commit_probe_baseline_ms")
        },
        "payments": payments,
        "shards": shards,
        "parallel_shards": parallel,
        "batch_size": batch_size,
        "floor_backends": floor["backends"],
        "seed_seconds": round(seed_seconds, 2),
        "floor_seconds_before_and_after": [round(floor["seconds"], 3), round(floor_2["seconds"], 3)],
        "floor_payments_per_s": round(floor_rate, 1),
        "direct_seconds_before_and_after": [round(direct["seconds"], 3), round(direct_2["seconds"], 3)],
        "direct_payments_per_s": round(direct_rate, 1),
        "pipeline_seconds": round(pipeline["seconds"], 3),
        "pipeline_payments_per_s": round(pipeline_rate, 1),
        "ratio": round(pipeline_rate / direct_rate, 3),
        "target": ">= 0.85",
        "direct_over_floor": round(direct_rate / floor_rate, 3),
        "direct_over_floor_target": ">= 0.7",
        "pipeline_over_floor": round(pipeline_rate / floor_rate, 3),
        "pipeline_over_floor_target": ">= 0.6",
        "postgres_cpu_seconds": cpu,
        "direct_over_floor_by_cpu": round(least["floor"] / least["direct"], 3) if len(least) == 3 else None,
        "pipeline_over_floor_by_cpu": round(least["floor"] / least["pipeline"], 3) if len(least) == 3 else None,
        "pipeline_orchestration_cpu_s": pipeline["orchestration_cpu_s"],
        "load_average_1m_floor_direct_pipeline_direct_floor": [
            floor["load"],
            direct["load"],
            pipeline["load"],
            direct_2["load"],
            floor_2["load"],
        ],
        "floor_outcomes": [floor["outcome"], floor_2["outcome"]],
        "floor_expected": [expected(seeded[3]), expected(seeded[4])],
        "expected": expected(seeded[1]),
        "pipeline_outcome": outcome(pipeline["settlement"]),
        "direct_outcomes": [outcome(direct["settlement"]), outcome(direct_2["settlement"])],
        "direct_expected": [expected(seeded[0]), expected(seeded[2])],
        "batches": {"pipeline": pipeline["batches"], "direct": [direct["batches"], direct_2["batches"]]},
        "pipeline_timeline": pipeline["timeline"],
        "direct_shard_seconds_sum": [round(direct["shard_seconds_sum"], 3), round(direct_2["shard_seconds_sum"], 3)],
        "pipeline_longest_statement_seconds": pipeline["longest"]["statement_seconds"],
        "pipeline_longest_locking_transaction_seconds": pipeline["longest"]["transaction_seconds"],
        "history_events": pipeline["history_events"],
        "history_bytes": pipeline["history_bytes"],
        **memory,
        "load_average_1m_before_and_after": [load_before, load_average()],
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--payments", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument(
        "--budget", choices=["off", "default"], default="off", help="the load budget: off, or as shipped"
    )
    args = parser.parse_args()
    print(
        json.dumps(
            run_benchmark(run(args.payments, args.shards, args.parallel, args.batch_size, args.budget)),
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
