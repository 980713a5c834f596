"""Cohort cleanup, pipeline vs. the physical limit: `python -m bench.cohort_cleanup --accounts 100000`.

Three cohorts of the same size are seeded into one fresh database. The *direct* runs execute the
same claim, partition batch and settlement SQL from this process (same batch size, same partition
parallelism, no Temporal), once before and once after the pipeline; the faster one is the limit.
The *pipeline* run is the real thing: `start_cleanup`, a durable sleep to a deadline 2 s ahead,
the claim, P partition activities on a separate worker process, the join and the settlement.
The ratio is accounts/s of the pipeline (deadline to settled result) over that of the direct run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

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

    reports = await asyncio.gather(*(partition(p) for p, n in enumerate(claim.claimed_per_partition) if n))
    settlement = await acts.settle_cleanup(
        SettleCleanupInput(
            cleanup_id=cleanup_id, deadline=deadline, partitions=partitions, claim=claim, reports=list(reports)
        )
    )
    return {"seconds": time.perf_counter() - t0, "cleaned": settlement.cleaned}


def _noop(_: PartitionCheckpoint) -> None:
    return None


async def run(accounts: int, partitions: int = 16, parallel: int = 8, batch_size: int = 1000) -> dict[str, Any]:
    async with stack() as s:
        # Deadlines already passed by the database clock: the claim never takes an account before it.
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        direct_deadline, pipeline_deadline_seed, direct_after = (
            base,
            base + timedelta(hours=1),
            base + timedelta(hours=2),
        )
        t = time.perf_counter()
        await seed_accounts(s.pool, prefix="d", deadline=direct_deadline, count=accounts)
        await seed_accounts(s.pool, prefix="p", deadline=pipeline_deadline_seed, count=accounts)
        await seed_accounts(s.pool, prefix="q", deadline=direct_after, count=accounts)
        seed_seconds = time.perf_counter() - t
        await s.pool.execute("VACUUM ANALYZE")

        worker = s.start_worker()
        await wait_for_worker(s.client, s.settings.task_queue)

        acts = await CleanupActivities.create(s.pool, load_targets())
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
        direct_2 = await direct_cleanup(acts, direct_after, partitions, parallel, batch_size)
        history = await handle.fetch_history()
        memory = s.memory()
        assert worker.poll() is None
    assert result.settlement is not None
    direct_rate = max(d["cleaned"] / d["seconds"] for d in (direct, direct_2))
    pipeline_rate = result.settlement.cleaned / after_deadline
    return {
        "scenario": "cohort_cleanup",
        "accounts": accounts,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "seed_seconds": round(seed_seconds, 2),
        "direct_seconds_before_and_after": [round(direct["seconds"], 3), round(direct_2["seconds"], 3)],
        "direct_accounts_per_s": round(direct_rate, 1),
        "pipeline_seconds_from_deadline": round(after_deadline, 3),
        "pipeline_seconds_from_start": round(t_end - t_start, 3),
        "pipeline_accounts_per_s": round(pipeline_rate, 1),
        "ratio": round(pipeline_rate / direct_rate, 3),
        "target": ">= 0.8",
        "pipeline_cleaned": result.settlement.cleaned,
        "direct_cleaned": [direct["cleaned"], direct_2["cleaned"]],
        "history_events": len(history.events),
        "history_bytes": len(history.to_json()),
        **memory,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.accounts, args.partitions, args.parallel, args.batch_size)), indent=2))


if __name__ == "__main__":
    main()
