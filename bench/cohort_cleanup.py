"""Cohort cleanup, floor vs. direct path vs. pipeline: `python -m bench.cohort_cleanup --accounts 100000`.

Five cohorts of the same size are seeded into one fresh database.

- *floor*: the least work with the same effects and guarantees, `cleanup_floor` (bench/floor.sql):
  one set-based statement for the whole cohort on one backend (mark cleaned, idempotency record,
  delete saves and items, archive matches, outbox row), no claim, no batches, no Temporal. Run
  once before and once after the pipeline; the faster one is the floor.
- *direct*: the same claim, partition batch and settlement SQL as the pipeline, from this process
  (same batch size, same partition parallelism, no Temporal), once before and once after the
  pipeline; the faster one is the direct path.
- *pipeline*: the real thing: `start_cleanup`, a durable sleep to a deadline 2 s ahead, the claim,
  P partition activities on a separate worker process, the join and the settlement (accounts/s
  from the deadline to the settled result).

Ratios (accounts/s over accounts/s, all measured in this run): direct / floor, pipeline / direct
and pipeline / floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import bench
import cleanup
from activities.cleanup import CleanupActivities, claim_in_chunks, clean_partition_batches
from bench.common import machine, stack, wait_for_worker
from cleanup.models import (
    ClaimChunkedInput,
    CleanupPartitionInput,
    CleanupResult,
    PartitionCheckpoint,
    PartitionReport,
    SettleCleanupInput,
)
from cleanup.operations import seed_accounts, start_cleanup
from cleanup.targets import load_targets
from core.queries import load
from workflows.renewal_cleanup import RenewalCleanupWorkflow

SQL = load(cleanup.__file__)
FLOOR = load(bench.__file__, "floor.sql")


async def floor_cleanup(acts: CleanupActivities, deadline: datetime) -> dict[str, Any]:
    """The whole cohort in one statement and one transaction, on one backend."""
    cleanup_id = f"floor-{deadline:%H%M%S}"
    t0 = time.perf_counter()
    async with acts.pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(FLOOR.cleanup_floor, cleanup_id, deadline)
    assert row is not None
    return {"seconds": time.perf_counter() - t0, "cleaned": row["cleaned"], "reminders": row["reminders"]}


async def direct_cleanup(
    acts: CleanupActivities, deadline: datetime, partitions: int, parallel: int, batch_size: int
) -> dict[str, Any]:
    cleanup_id = f"direct-{deadline:%H%M%S}"
    t0 = time.perf_counter()
    # The same chunked claim as the pipeline's `claim_cleanup_in_chunks` activity.
    claim = await claim_in_chunks(
        acts.pool,
        ClaimChunkedInput(
            cleanup_id=cleanup_id,
            deadline_from=deadline,
            deadline_until=deadline + timedelta(microseconds=1),
            partitions=partitions,
        ),
    )
    limit = asyncio.Semaphore(parallel)

    async def partition(p: int) -> PartitionReport:
        async with limit:
            inp = CleanupPartitionInput(cleanup_id=cleanup_id, partition_no=p, batch_size=batch_size)
            cp = await clean_partition_batches(
                acts.pool, acts.partition_batch_sql, inp, PartitionCheckpoint(), _noop, compiled=acts.compiled
            )
            c = cp.counts
            await acts.pool.execute(
                SQL.record_partition_report,
                cleanup_id,
                p,
                c.cleaned,
                c.skipped_renewed,
                c.skipped_stale,
                c.already_applied,
                c.failed,
            )
            return PartitionReport(partition_no=p, counts=c, batches=cp.batches)

    claim_seconds = time.perf_counter() - t0
    reports = await asyncio.gather(*(partition(p) for p, n in enumerate(claim.claimed_per_partition) if n))
    settlement = await acts.settle_cleanup(
        SettleCleanupInput(
            cleanup_id=cleanup_id, deadline=deadline, partitions=partitions, claim=claim, reports=list(reports)
        )
    )
    return {"seconds": time.perf_counter() - t0, "claim_seconds": claim_seconds, "cleaned": settlement.cleaned}


async def _seed(pool: Any, prefix: str, deadline: datetime, accounts: int, chunk: int = 100_000) -> None:
    """One cohort with game data, in statements of at most `chunk` accounts (a 1M-account statement
    can outlast the pool's command timeout on a loaded machine)."""
    for i, start in enumerate(range(0, accounts, chunk)):
        await seed_accounts(pool, prefix=f"{prefix}{i:03d}", deadline=deadline, count=min(chunk, accounts - start))


def _noop(_: PartitionCheckpoint) -> None:
    return None


async def run(
    accounts: int,
    partitions: int = 16,
    parallel: int = 8,
    batch_size: int = 1000,
    load_budget: bool = True,
    with_floor: bool = True,
    direct_after: bool = True,
) -> dict[str, Any]:
    """`load_budget=False`: the worker takes no part in the load budget (LOAD_BUDGET=off), like the
    direct path, so the ratio is orchestration alone; with it, the pipeline's batches are limited to
    the default N in flight and R rows/s (docs/budget.md), which the direct path is not.
    `with_floor=False`: no floor cohorts (three cohorts instead of five; for the largest sizes);
    `direct_after=False`: no second direct run after the pipeline (one cohort fewer)."""
    load_before = round(os.getloadavg()[0], 2)
    async with stack() as s:
        # Deadlines already passed by the database clock: the claim never takes an account before it.
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        direct_deadline, pipeline_deadline_seed, direct_after_deadline, floor_deadline, floor_after = (
            base + timedelta(hours=h) for h in range(5)
        )
        t = time.perf_counter()
        await _seed(s.pool, "d", direct_deadline, accounts)
        await _seed(s.pool, "p", pipeline_deadline_seed, accounts)
        if direct_after:
            await _seed(s.pool, "q", direct_after_deadline, accounts)
        if with_floor:
            await _seed(s.pool, "f", floor_deadline, accounts)
            await _seed(s.pool, "g", floor_after, accounts)
        seed_seconds = time.perf_counter() - t
        await s.pool.execute("VACUUM ANALYZE")

        worker = s.start_worker(**({} if load_budget else {"LOAD_BUDGET": "off"}))
        await wait_for_worker(s.client, s.settings.task_queue)

        acts = await CleanupActivities.create(s.pool, load_targets())
        floor = await floor_cleanup(acts, floor_deadline) if with_floor else None
        direct = await direct_cleanup(acts, direct_deadline, partitions, parallel, batch_size)

        # The pipeline's cohort gets a deadline just ahead: move it there (set-based), then start the
        # cleanup a couple of seconds before it, so the durable sleep is part of the run.
        lead = 2.0
        deadline = (datetime.now(UTC) + timedelta(seconds=4 + accounts / 5000)).replace(microsecond=0)
        await s.pool.execute(
            "UPDATE accounts SET renewal_deadline = $1 WHERE renewal_deadline = $2", deadline, pipeline_deadline_seed
        )
        await s.pool.execute("VACUUM ANALYZE accounts")
        await asyncio.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds() - lead))
        t_start = time.perf_counter()
        started = await start_cleanup(
            s.client,
            s.pool,
            s.settings.task_queue,
            deadline=deadline,
            partitions=partitions,
            max_parallel_partitions=parallel,
            batch_size=batch_size,
        )
        handle = s.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await handle.result()
        t_end = time.perf_counter()
        after_deadline = (datetime.now(UTC) - deadline).total_seconds()
        # The direct run again, after the pipeline: the limit is the faster of the two direct runs.
        direct_2 = (
            await direct_cleanup(acts, direct_after_deadline, partitions, parallel, batch_size)
            if direct_after
            else None
        )
        floor_2 = await floor_cleanup(acts, floor_after) if with_floor else None
        history = await handle.fetch_history()
        memory = s.memory()
        assert worker.poll() is None
    assert result.settlement is not None
    directs = [d for d in (direct, direct_2) if d is not None]
    direct_rate = max(d["cleaned"] / d["seconds"] for d in directs)
    floors = [f for f in (floor, floor_2) if f is not None]
    floor_rate = max(f["cleaned"] / f["seconds"] for f in floors) if floors else None
    pipeline_rate = result.settlement.cleaned / after_deadline
    return {
        "scenario": "cohort_cleanup",
        "accounts": accounts,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "pipeline_load_budget": "default (LOAD_BUDGET_* of the worker)" if load_budget else "off",
        "seed_seconds": round(seed_seconds, 2),
        "floor_seconds_before_and_after": [round(f["seconds"], 3) for f in floors],
        "floor_accounts_per_s": round(floor_rate, 1) if floor_rate else None,
        "direct_seconds_before_and_after": [round(d["seconds"], 3) for d in directs],
        "direct_claim_seconds_before_and_after": [round(d["claim_seconds"], 3) for d in directs],
        "direct_accounts_per_s": round(direct_rate, 1),
        "pipeline_seconds_from_deadline": round(after_deadline, 3),
        "pipeline_seconds_from_start": round(t_end - t_start, 3),
        "pipeline_accounts_per_s": round(pipeline_rate, 1),
        "ratio": round(pipeline_rate / direct_rate, 3),
        "target": ">= 0.85",
        "direct_over_floor": round(direct_rate / floor_rate, 3) if floor_rate else None,
        "direct_over_floor_target": ">= 0.7",
        "pipeline_over_floor": round(pipeline_rate / floor_rate, 3) if floor_rate else None,
        "pipeline_cleaned": result.settlement.cleaned,
        "direct_cleaned": [d["cleaned"] for d in directs],
        "floor_cleaned": [f["cleaned"] for f in floors],
        "history_events": len(history.events),
        "history_bytes": len(history.to_json()),
        **memory,
        "load_average_1m_before_and_after": [load_before, round(os.getloadavg()[0], 2)],
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument(
        "--load-budget", choices=["on", "off"], default="on", help="off: the pipeline's worker takes no budget"
    )
    parser.add_argument("--no-floor", action="store_true", help="skip the floor cohorts (largest sizes)")
    parser.add_argument("--no-direct-after", action="store_true", help="one direct run (before the pipeline) only")
    args = parser.parse_args()
    result = asyncio.run(
        run(
            args.accounts,
            args.partitions,
            args.parallel,
            args.batch_size,
            load_budget=args.load_budget == "on",
            with_floor=not args.no_floor,
            direct_after=not args.no_direct_after,
        )
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
