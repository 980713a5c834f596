"""Cohort cleanup, floor vs. direct path vs. pipeline: `python -m bench.cohort_cleanup --accounts 100000`.

Six cohorts of the same size are seeded into one fresh database. Order of the runs: floor, direct,
pipeline, direct, floor, pipeline; each path counts by its faster run (one run of each would leave
a path to the machine's noise alone: the floor's two runs differ by up to 50%).

- *floor*: the least work with the same effects and guarantees, `cleanup_floor` (bench/floor.sql)
  on as many backends as there are cores (`bench.floor.FLOOR_BACKENDS`, printed as
  `floor_backends`): the cohort cut into that many account_id ranges of equal size by one untimed
  query, then one set-based statement per range (mark cleaned, idempotency record, delete saves and
  items, archive matches, outbox row), each in its own transaction on its own backend, all at once,
  timed from the start of the first to the end of the last; no claim, no batches, no Temporal. Run
  once before and once after the pipeline; the faster one is the floor. (Figures measured before
  the floor was sliced used one statement on one backend.)
- *direct*: the same claim, partition batch and settlement SQL as the pipeline, from this process
  (same batch size, same partition parallelism, no Temporal), once before and once after the
  pipeline; the faster one is the direct path.
- *pipeline*: the real thing: `start_cleanup`, a durable sleep to a deadline 2 s ahead, the claim,
  P partition activities on a separate worker process, the join and the settlement (accounts/s
  from the deadline to the settled result), twice; each run's activities on a timeline
  (`pipeline_activities_seconds_after_deadline`: scheduled, started, closed).

Partitions at a time: the planner's default (`DEFAULT_PARALLEL`), `--parallel` to change it;
`--compare-parallel N` adds two direct runs at N (two more cohorts), one before the first direct run
and one after the second, printed as `direct_over_compare_parallel`.

Ratios (accounts/s over accounts/s, all measured in this run): direct / floor, pipeline / direct
and pipeline / floor. Also printed: each run's Postgres CPU time where the server's processes can
be read, summed over every backend of the database (the floor's: all its slices' backends;
`direct_over_floor_by_cpu`: floor CPU / direct CPU for the same accounts; it moves far less
with the machine's load than wall-clock time), the claim's share of the direct run (wall clock and
CPU), the CPU of the worker process and the Temporal server during the pipeline, and the load
average around every run. The pipeline runs with the load budget off (`Stack.budget_off`), or
with `--budget default` under the budget as shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import operator
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

import bench
import bench.floor
import cleanup
from activities.cleanup import CleanupActivities, PartitionRun, claim_in_chunks, clean_partition_batches
from bench.common import (
    Stack,
    cpu_seconds,
    cpu_used,
    database_cpu_seconds,
    load_average,
    machine,
    run_benchmark,
    stack,
    wait_for_worker,
)
from bench.observe import Observer
from budget.controller import budget_status
from cleanup.inputs import StartCleanup
from cleanup.models import (
    DEFAULTS,
    ClaimChunkedInput,
    ClaimResult,
    CleanupPartitionInput,
    CleanupResult,
    PartitionCheckpoint,
    PartitionReport,
    SettleCleanupInput,
    following_partitions,
)
from cleanup.operations import start_cleanup
from cleanup.targets import load_targets
from core.queries import load
from demo.fixture import seed_accounts
from workflows.renewal_cleanup import RenewalCleanupWorkflow

SQL = load(cleanup.__file__)
FLOOR = load(bench.__file__, "floor.sql")


# One statement over a whole cohort (the floor, or seeding 1,000,000 accounts with their game data)
# can outlast the pool's 300 s command timeout on a loaded machine.
LONG_STATEMENT_SECONDS = 3600.0
SEED_CHUNK = 100_000
# pg_stat_activity sampled this often during a sweep run's batches (a run lasts a few seconds).
SWEEP_SAMPLE_SECONDS = 0.02
# Partitions at a time: the planner's default, the cohort cleanups that run with nobody starting
# them (8, `starter.py cleanup`'s default, is 10 backends with the claim streams on a 2-core server:
# `--compare-parallel 8` measures what that costs beside it).
DEFAULT_PARALLEL = DEFAULTS.max_parallel_partitions


async def seed_cohort(pool: Any, prefix: str, deadline: datetime, count: int) -> None:
    """`count` accounts due at `deadline`, seeded 100,000 at a time (one statement each)."""
    for chunk, start in enumerate(range(0, count, SEED_CHUNK)):
        n = min(SEED_CHUNK, count - start)
        await seed_accounts(pool, prefix=f"{prefix}{chunk:02d}", deadline=deadline, count=n)


async def claim_in_streams(
    pool: asyncpg.Pool, cleanup_id: str, deadline: datetime, partitions: int, streams: int
) -> list[ClaimResult]:
    """The cohort due at `deadline` claimed by the pipeline's chunked claim, its streams at once."""
    return list(
        await asyncio.gather(
            *(
                claim_in_chunks(
                    pool,
                    ClaimChunkedInput(
                        cleanup_id=cleanup_id,
                        deadline_from=deadline,
                        deadline_until=deadline + timedelta(microseconds=1),
                        partitions=partitions,
                        stream=k,
                        streams=streams,
                    ),
                )
                for k in range(streams)
            )
        )
    )


async def floor_cleanup(acts: CleanupActivities, deadline: datetime) -> dict[str, Any]:
    """The cohort cut into `bench.floor.FLOOR_BACKENDS` account_id ranges of equal size (their
    bounds read by one untimed query), one statement and one transaction per range, each on its own
    backend, all at once; timed together (start of the first to end of the last), counts summed."""
    return await floor_cleanup_on(acts.pool, deadline)


async def floor_cleanup_on(pool: asyncpg.Pool, deadline: datetime) -> dict[str, Any]:
    """`floor_cleanup` on `pool` (bench.planner_cohort: a pool whose clock is ahead, so a cohort due
    far in the future, out of the planner's sight, is past its deadline for the floor alone)."""
    cleanup_id = f"floor-{deadline:%H%M%S}"
    cut = FLOOR.bind("cleanup_floor_bounds", deadline=deadline, slices=bench.floor.FLOOR_BACKENDS)
    bounds = await pool.fetchval(FLOOR.cleanup_floor_bounds, *cut)
    edges: list[str | None] = [None, *(bounds or []), None]
    slices = [
        FLOOR.bind("cleanup_floor", cleanup_id=cleanup_id, deadline=deadline, from_account=lo, until_account=hi)
        for lo, hi in itertools.pairwise(edges)
    ]
    run = await bench.floor.run_slices(pool, FLOOR.cleanup_floor, slices, LONG_STATEMENT_SECONDS)
    return {
        "seconds": run.seconds,
        "backends": len(slices),
        "cleaned": run.total("cleaned"),
        "reminders": run.total("reminders"),
        "receipts": run.total("receipts"),
        "backend_cpu_s": run.backend_cpu_s,
        "load": run.load,
    }


async def direct_cleanup(
    acts: CleanupActivities,
    claim_pool: asyncpg.Pool | None,
    deadline: datetime,
    partitions: int,
    parallel: int,
    batch_size: int,
    follow: bool = True,
    observer: Observer | None = None,
) -> dict[str, Any]:
    """The pipeline's steps without Temporal: the chunked claim in `DEFAULTS.claim_streams` streams
    (on `claim_pool`, one connection per stream, so the claim's own CPU can be read) with every
    partition following its stream, the join, the settlement.

    `follow=False` (the batch-size sweep): the claim first, then the batches alone, timed and their
    CPU read apart (`batches_seconds`, `batches_cpu_s`): the batch size changes only the batches, and
    a claim the same for every size, overlapping them, would hide what it changes. `observer`: what
    the batches' backends waited on and how busy the cores were while the batches ran (`batches_observed`)."""
    cleanup_id = f"direct-{deadline:%H%M%S}"
    assert claim_pool is not None
    if follow:
        partitions = following_partitions(partitions, parallel)  # as the pipeline: all of them at once
    streams = min(DEFAULTS.claim_streams, partitions)
    claim_pids = await backend_pids(claim_pool, streams)
    claim_cpu_before = [cpu_seconds(pid) for pid in claim_pids]
    load_before, cpu_before = load_average(), await database_cpu_seconds(acts.pool)
    t0 = time.perf_counter()
    claim_seconds = 0.0
    claim_cpu: float | None = None

    async def claim() -> ClaimResult:
        # The same chunked claim as the pipeline's `claim_cleanup_in_chunks` activities.
        nonlocal claim_seconds, claim_cpu
        results = await claim_in_streams(claim_pool, cleanup_id, deadline, partitions, streams)
        claim_seconds = time.perf_counter() - t0
        before = [c for c in claim_cpu_before if c is not None]
        after = [c for c in (cpu_seconds(pid) for pid in claim_pids) if c is not None]
        if len(before) == len(after) == len(claim_pids):
            claim_cpu = round(sum(after) - sum(before), 2)
        return functools.reduce(operator.add, results)

    limit = asyncio.Semaphore(parallel)

    async def partition(p: int) -> PartitionReport:
        async with limit:
            # As in the pipeline: every partition starts with the claim and follows it.
            inp = CleanupPartitionInput(
                cleanup_id=cleanup_id,
                partition_no=p,
                batch_size=batch_size,
                follow_claim=follow,
                claim_streams=streams,
            )
            cp = await clean_partition_batches(PartitionRun(acts.pool, acts.compiled, inp), PartitionCheckpoint())
            c = cp.counts
            await acts.pool.execute(
                SQL.record_partition_report,
                *SQL.bind("record_partition_report", cleanup_id=cleanup_id, partition_no=p, **c.model_dump()),
            )
            return PartitionReport(partition_no=p, counts=c, batches=cp.batches)

    batches_seconds: float | None = None
    batches_cpu: float | None = None
    batches_observed: dict[str, Any] | None = None
    if follow:
        claim_task = asyncio.ensure_future(claim())
        partition_tasks = [asyncio.ensure_future(partition(p)) for p in range(partitions)]
        await asyncio.gather(claim_task, *partition_tasks)  # a failed claim fails the run at once
        claim_result = claim_task.result()
        reports = [t.result() for t in partition_tasks]
    else:
        claim_result = await claim()
        batches_cpu_before, t_batches = await database_cpu_seconds(acts.pool), time.perf_counter()

        async def batches() -> list[PartitionReport]:
            return list(await asyncio.gather(*(partition(p) for p in range(partitions))))

        if observer is None:
            reports = await batches()
        else:
            batches_observed, reports = await observer.observe(batches)
        batches_seconds = time.perf_counter() - t_batches
        batches_cpu = cpu_used(batches_cpu_before, await database_cpu_seconds(acts.pool))
    settlement = await acts.settle_cleanup(
        SettleCleanupInput(
            cleanup_id=cleanup_id,
            deadline=deadline,
            partitions=partitions,
            claim=claim_result,
            reports=list(reports),
        )
    )
    seconds = time.perf_counter() - t0
    cpu_after = await database_cpu_seconds(acts.pool)
    return {
        "seconds": seconds,
        "claim_seconds": claim_seconds,
        "cleaned": settlement.cleaned,
        "backend_cpu_s": cpu_used(cpu_before, cpu_after),
        "claim_backend_cpu_s": claim_cpu,
        "batches_seconds": batches_seconds,
        "batches_cpu_s": batches_cpu,
        "batches_observed": batches_observed,
        "load": [load_before, load_average()],
    }


AUTOVACUUM_OFF = """
DO $$
DECLARE t regclass;
BEGIN
    FOR t IN SELECT c.oid::regclass FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname IN (current_schema(), 'demo_game') AND c.relkind = 'r'
    LOOP
        EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', t);
    END LOOP;
END $$
"""


async def settle(pool: asyncpg.Pool) -> None:
    """Untimed, before every timed run: the runs before it vacuumed and their dirty pages written, so
    no run pays for another's dead tuples (autovacuum on the same 2 cores) or checkpoint. Without it
    six sweep runs of the same statement measured 120, 136, 152, 151, 155, 161 us of CPU per account,
    in the order they ran. The benchmark's database runs with autovacuum off (`AUTOVACUUM_OFF`, set
    once after seeding), so a vacuum of one run's dead tuples never lands in the middle of another."""
    await pool.execute("VACUUM ANALYZE", timeout=LONG_STATEMENT_SECONDS)
    await pool.execute("CHECKPOINT", timeout=LONG_STATEMENT_SECONDS)


async def pipeline_cleanup(
    s: Stack, seed_deadline: datetime, lead_seconds: float, partitions: int, parallel: int, batch_size: int
) -> tuple[dict[str, Any], float]:
    """The real thing, timed from the deadline to settled: the cohort seeded at `seed_deadline` gets
    a deadline `lead_seconds` ahead (set-based), the cleanup starts 2 s before it, so the durable
    sleep is part of the run. Returns the run and a lead that suffices for another cohort this size
    (three times what moving this one took, at least 5 s). The runs before it are settled first
    (untimed), so the lead covers this cohort's move and nothing that the runs before left behind
    (the floor's dead tuples, vacuumed inside a pipeline's lead, would make it late)."""
    lead = 2.0
    await settle(s.pool)
    moved_at = datetime.now(UTC)
    deadline = (moved_at + timedelta(seconds=lead_seconds)).replace(microsecond=0)
    await s.pool.execute(
        "UPDATE accounts SET renewal_deadline = $1 WHERE renewal_deadline = $2",
        deadline,
        seed_deadline,
        timeout=LONG_STATEMENT_SECONDS,
    )
    await settle(s.pool)
    next_lead = max(5.0, 3 * (datetime.now(UTC) - moved_at).total_seconds())
    ahead = (deadline - datetime.now(UTC)).total_seconds()
    # Started after the deadline, the pipeline's time from the deadline would include the delay.
    assert ahead > lead, f"moving the cohort took longer than its lead ({ahead:.1f} s left); raise the lead"
    await asyncio.sleep(ahead - lead)
    load = [load_average()]
    cpu_before, orchestration_before = await database_cpu_seconds(s.pool), s.process_cpu()
    t_start = time.perf_counter()
    started = await start_cleanup(
        s.client,
        s.pool,
        s.settings.task_queue,
        StartCleanup(deadline=deadline, partitions=partitions, max_parallel_partitions=parallel, batch_size=batch_size),
    )
    handle = s.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()
    t_end = time.perf_counter()
    after_deadline = (datetime.now(UTC) - deadline).total_seconds()
    cpu = cpu_used(cpu_before, await database_cpu_seconds(s.pool))
    orchestration_after = s.process_cpu()
    load.append(load_average())
    history = await handle.fetch_history()
    assert result.settlement is not None
    return {
        "seconds_from_deadline": after_deadline,
        "seconds_from_start": t_end - t_start,
        "cleaned": result.settlement.cleaned,
        "backend_cpu_s": cpu,
        "orchestration_cpu_s": {
            k: round(v - b, 2) if v is not None and (b := orchestration_before.get(k)) is not None else None
            for k, v in orchestration_after.items()
        },
        "load": load,
        "activities": activity_timeline(history, deadline),
        "history_events": len(history.events),
        "history_bytes": len(history.to_json()),
    }, next_lead


async def backend_pids(pool: asyncpg.Pool, n: int) -> list[int]:
    """The backend PIDs of a pool of exactly `n` connections (all held at once to read them)."""
    conns = [await pool.acquire() for _ in range(n)]
    try:
        return [await c.fetchval("SELECT pg_backend_pid()") for c in conns]
    finally:
        for c in conns:
            await pool.release(c)


def activity_timeline(history: Any, deadline: datetime) -> dict[str, list[float | None]]:
    """Each activity of the pipeline's history as [scheduled, started, closed], in seconds after the
    deadline (its summary, e.g. "claim stream 0", "partition 3"; markers (patches, local activities) as "marker N" with
    the time their marker was recorded): where a run's time went between the deadline and settled."""
    out: dict[str, list[float | None]] = {}
    names: dict[int, str] = {}
    local = 0

    def at(event: Any) -> float:
        seconds: float = (event.event_time.ToDatetime(UTC) - deadline).total_seconds()
        return round(seconds, 3)

    for e in history.events:
        kind = e.WhichOneof("attributes")
        if kind == "activity_task_scheduled_event_attributes":
            summary = e.user_metadata.summary.data.decode().strip('"') if e.HasField("user_metadata") else ""
            name = summary or e.activity_task_scheduled_event_attributes.activity_type.name
            names[e.event_id] = name
            out[name] = [at(e), None, None]
        elif kind == "activity_task_started_event_attributes":
            out[names[e.activity_task_started_event_attributes.scheduled_event_id]][1] = at(e)
        elif (
            kind is not None
            and kind.startswith("activity_task_")
            and kind != "activity_task_cancel_requested_event_attributes"
        ):
            scheduled = getattr(e, kind).scheduled_event_id
            out[names[scheduled]][2] = at(e)
        elif kind == "marker_recorded_event_attributes":
            local += 1
            out[f"marker {local}"] = [None, None, at(e)]
        elif kind == "timer_fired_event_attributes":
            out["timer fired"] = [None, None, at(e)]
    return out


def compared_summary(
    compare_parallel: int | None, compared: list[dict[str, Any]], direct_rate: float, direct_cpu: float | None
) -> dict[str, Any]:
    """The direct runs at `compare_parallel` partitions at a time beside the main ones: seconds, CPU,
    and the main direct path's rate over theirs (each the faster of two runs), and its least CPU
    (`direct_cpu`) against theirs."""
    if not compare_parallel:
        return {}
    cpu = [c["backend_cpu_s"] for c in compared]
    rate = max(c["cleaned"] / c["seconds"] for c in compared)
    return {
        "compare_parallel_partitions": compare_parallel,
        "compare_direct_seconds_before_and_after": [round(c["seconds"], 3) for c in compared],
        "compare_direct_claim_seconds": [round(c["claim_seconds"], 3) for c in compared],
        "compare_direct_cpu_seconds": cpu,
        "compare_direct_cleaned": [c["cleaned"] for c in compared],
        "direct_over_compare_parallel": round(direct_rate / rate, 3),
        "direct_over_compare_parallel_by_cpu": (
            round(min(cpu) / direct_cpu, 3) if direct_cpu and None not in cpu else None
        ),
    }


def sweep_result(size: int, d: dict[str, Any]) -> dict[str, Any]:
    """One direct run of the batch-size sweep (claim first, then the batches alone): the batches'
    throughput and Postgres CPU per account, and the whole run's."""
    batches_s, batches_cpu = d["batches_seconds"], d["batches_cpu_s"]
    return {
        "batch_size": size,
        "seconds": round(d["seconds"], 3),
        "claim_seconds": round(d["claim_seconds"], 3),
        "batches_seconds": round(batches_s, 3),
        "batches_accounts_per_s": round(d["cleaned"] / batches_s, 1),
        "batches_cpu_us_per_account": round(1e6 * batches_cpu / d["cleaned"], 1) if batches_cpu is not None else None,
        "accounts_per_s": round(d["cleaned"] / d["seconds"], 1),
        "backend_cpu_s": d["backend_cpu_s"],
        "cleaned": d["cleaned"],
        "load": d["load"],
        **observed_summary(d.get("batches_observed")),
    }


def observed_summary(o: dict[str, Any] | None) -> dict[str, Any]:
    """What the batches' backends did while they ran: the busy fraction of the machine's cores, their
    run-queue delay (runnable, no free core) per second of their CPU, and the share of pg_stat_activity
    samples that found them on a CPU or waiting on what."""
    if o is None:
        return {}
    backends = o["cpu"].get("client backend", {})
    samples = o["wait_samples"].get("client backend", {})
    total = sum(samples.values())
    return {
        "batches_machine_busy": o["machine_busy"],
        "batches_runqueue_wait_per_cpu_s": (
            round(backends["runqueue_wait_s"] / backends["cpu_s"], 3) if backends.get("cpu_s") else None
        ),
        "batches_wait_samples": {k: round(v / total, 3) for k, v in samples.items()} if total else {},
        **({"batches_idle_core_seconds": o["idle_core_seconds"]} if "idle_core_seconds" in o else {}),
    }


def sweep_by_size(sizes: tuple[int, ...], swept: list[dict[str, Any]]) -> dict[str, Any]:
    """All runs of each size taken together (the batches' accounts over their seconds; their CPU per
    account), and whether each size's batches are no slower per account than the one before (the goal).
    `run_to_run_spread`: the widest (max - min) / mean of one size's runs, the noise of one run here."""
    out: list[dict[str, Any]] = []
    spreads: list[float] = []
    for size in sizes:
        runs = [r for r in swept if r["batch_size"] == size]
        cleaned = sum(r["cleaned"] for r in runs)
        cpu = [r["batches_cpu_us_per_account"] for r in runs]
        each = [r["batches_accounts_per_s"] for r in runs]
        spreads.append((max(each) - min(each)) / statistics.fmean(each))
        out.append(
            {
                "batch_size": size,
                "runs": len(runs),
                "batches_accounts_per_s": round(cleaned / sum(r["batches_seconds"] for r in runs), 1),
                "batches_accounts_per_s_each_run": each,
                "batches_cpu_us_per_account": round(sum(cpu) / len(cpu), 1) if None not in cpu else None,
                "accounts_per_s_with_the_claim": round(cleaned / sum(r["seconds"] for r in runs), 1),
                **pooled_observations(runs),
            }
        )
    rates = [r["batches_accounts_per_s"] for r in out]
    return {
        "sizes": out,
        "each_no_slower_than_the_one_before": all(b >= a for a, b in itertools.pairwise(rates)),
        "run_to_run_spread": round(max(spreads), 3) if spreads else None,
    }


def pooled_observations(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """`observed_summary` over one size's runs: means of the busy fraction and the run-queue delay,
    and the wait samples' shares averaged."""
    observed = [r for r in runs if "batches_machine_busy" in r]
    if not observed:
        return {}
    waits: dict[str, float] = {}
    for r in observed:
        for k, v in r["batches_wait_samples"].items():
            waits[k] = waits.get(k, 0.0) + v / len(observed)
    delays = [
        r["batches_runqueue_wait_per_cpu_s"] for r in observed if r["batches_runqueue_wait_per_cpu_s"] is not None
    ]
    return {
        "batches_machine_busy": round(statistics.fmean(r["batches_machine_busy"] for r in observed), 3),
        "batches_runqueue_wait_per_cpu_s": round(statistics.fmean(delays), 3) if delays else None,
        "batches_wait_samples": {k: round(v, 3) for k, v in sorted(waits.items(), key=lambda kv: -kv[1])[:8]},
    }


async def run(
    accounts: int,
    partitions: int = 16,
    parallel: int = DEFAULT_PARALLEL,
    batch_size: int = 1000,
    sweep: tuple[int, ...] = (),
    sweep_rounds: int = 2,
    timeline_file: str | None = None,
    compare_parallel: int | None = None,
    budget: str = "off",
) -> dict[str, Any]:
    """`budget`: "off" (the pipeline measures orchestration, as the direct runs take no budget) or
    "default" (the load budget as shipped: the pipeline runs under it; its state after each
    pipeline run is in the result).
    `compare_parallel`: two more direct runs with that many partitions at a time (one before the
    first direct run, one after the second, two more cohorts), so the cost of a parallelism against
    `parallel` is a ratio of this run (`direct_over_compare_parallel`).
    `sweep`: batch sizes of extra direct runs after the others, `sweep_rounds` rounds, in the
    given order then in reverse, and so on (ABC CBA ABC), one more cohort each: a drift over the run
    (a growing database) then weighs on every size alike instead of on the last one.
    `timeline_file`: where to write each sweep run's timeline (`bench.observe`, every 20 ms: cores
    busy, backends on a CPU and waiting), as JSON."""
    load_before = load_average()
    async with stack(pool_size=bench.floor.STACK_POOL_SIZE) as s:
        # Deadlines already passed by the database clock: the claim never takes an account before it.
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        direct_deadline, pipeline_deadline_seed, direct_after, floor_deadline, floor_after, pipeline_again_seed = (
            base + timedelta(hours=h) for h in range(6)
        )
        t = time.perf_counter()
        await seed_cohort(s.pool, "d", direct_deadline, accounts)
        await seed_cohort(s.pool, "p", pipeline_deadline_seed, accounts)
        await seed_cohort(s.pool, "q", direct_after, accounts)
        await seed_cohort(s.pool, "f", floor_deadline, accounts)
        await seed_cohort(s.pool, "g", floor_after, accounts)
        await seed_cohort(s.pool, "r", pipeline_again_seed, accounts)
        compare_deadlines = [base + timedelta(hours=6 + i) for i in range(2 if compare_parallel else 0)]
        for i, d in enumerate(compare_deadlines):
            await seed_cohort(s.pool, f"c{i}", d, accounts)
        sweep_order = [size for r in range(sweep_rounds) for size in (sweep if r % 2 == 0 else sweep[::-1])]
        first_sweep = 6 + len(compare_deadlines)
        sweep_deadlines = [base + timedelta(hours=first_sweep + i) for i in range(len(sweep_order))]
        for i, d in enumerate(sweep_deadlines):
            await seed_cohort(s.pool, f"s{i}", d, accounts)
        seed_seconds = time.perf_counter() - t
        await s.pool.execute("VACUUM ANALYZE", timeout=LONG_STATEMENT_SECONDS)
        await s.pool.execute(AUTOVACUUM_OFF)

        worker = s.start_worker()
        await wait_for_worker(s.client, s.settings.task_queue)
        if budget == "off":
            await s.budget_off()

        acts = await CleanupActivities.create(s.pool, load_targets())
        await settle(s.pool)
        floor = await floor_cleanup(acts, floor_deadline)
        compared: list[dict[str, Any]] = []

        async def compare(deadline: datetime) -> None:
            assert compare_parallel is not None
            await settle(s.pool)
            compared.append(
                await direct_cleanup(acts, s.claim_backends, deadline, partitions, compare_parallel, batch_size)
            )

        if compare_parallel:
            await compare(compare_deadlines[0])
        await settle(s.pool)
        direct = await direct_cleanup(acts, s.claim_backends, direct_deadline, partitions, parallel, batch_size)

        pipeline, lead = await pipeline_cleanup(
            s, pipeline_deadline_seed, 10 + accounts / 2000, partitions, parallel, batch_size
        )
        budget_after = [(await budget_status(s.pool)).model_dump()]
        # The direct run again, after the pipeline: the limit is the faster of the two direct runs.
        await settle(s.pool)
        direct_2 = await direct_cleanup(acts, s.claim_backends, direct_after, partitions, parallel, batch_size)
        if compare_parallel:
            await compare(compare_deadlines[1])
        await settle(s.pool)
        floor_2 = await floor_cleanup(acts, floor_after)
        # The pipeline again, last: like the floor and the direct path, it counts by its faster run.
        pipeline_2, _ = await pipeline_cleanup(s, pipeline_again_seed, lead, partitions, parallel, batch_size)
        budget_after.append((await budget_status(s.pool)).model_dump())
        swept = []
        assert s.settings.database_url is not None
        observer = Observer(
            s.settings.database_url, {}, interval=SWEEP_SAMPLE_SECONDS, timeline=timeline_file is not None
        )
        timelines = []
        for size, d in zip(sweep_order, sweep_deadlines, strict=True):
            await settle(s.pool)
            one = await direct_cleanup(
                acts, s.claim_backends, d, partitions, parallel, size, follow=False, observer=observer
            )
            timelines.append({"batch_size": size, **one["batches_observed"].pop("timeline", {})})
            swept.append(sweep_result(size, one))
        if timeline_file is not None:
            await asyncio.to_thread(Path(timeline_file).write_text, json.dumps(timelines) + "\n")
        memory = s.memory()
        assert worker.poll() is None
    pipelines = (pipeline, pipeline_2)
    best_pipeline = max(pipelines, key=lambda p: p["cleaned"] / p["seconds_from_deadline"])
    direct_rate = max(d["cleaned"] / d["seconds"] for d in (direct, direct_2))
    floor_rate = max(f["cleaned"] / f["seconds"] for f in (floor, floor_2))
    pipeline_rate = best_pipeline["cleaned"] / best_pipeline["seconds_from_deadline"]
    cpu = {
        "floor": [floor["backend_cpu_s"], floor_2["backend_cpu_s"]],
        "direct": [direct["backend_cpu_s"], direct_2["backend_cpu_s"]],
        "pipeline": [p["backend_cpu_s"] for p in pipelines],
    }
    least = {k: min(v) for k, v in cpu.items() if all(x is not None for x in v)}
    claim_cpu = [d["claim_backend_cpu_s"] for d in (direct, direct_2)]
    return {
        "scenario": "cohort_cleanup",
        "accounts": accounts,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "floor_backends": floor["backends"],
        "seed_seconds": round(seed_seconds, 2),
        "floor_seconds_before_and_after": [round(floor["seconds"], 3), round(floor_2["seconds"], 3)],
        "floor_accounts_per_s": round(floor_rate, 1),
        "direct_seconds_before_and_after": [round(direct["seconds"], 3), round(direct_2["seconds"], 3)],
        "direct_claim_seconds_before_and_after": [
            round(direct["claim_seconds"], 3),
            round(direct_2["claim_seconds"], 3),
        ],
        "direct_accounts_per_s": round(direct_rate, 1),
        "pipeline_seconds_from_deadline": [round(p["seconds_from_deadline"], 3) for p in pipelines],
        "pipeline_seconds_from_start": [round(p["seconds_from_start"], 3) for p in pipelines],
        "pipeline_accounts_per_s": round(pipeline_rate, 1),
        "ratio": round(pipeline_rate / direct_rate, 3),
        "target": ">= 0.85",
        "direct_over_floor": round(direct_rate / floor_rate, 3),
        "direct_over_floor_target": ">= 0.7",
        "pipeline_over_floor": round(pipeline_rate / floor_rate, 3),
        "pipeline_over_floor_target": ">= 0.6",
        "postgres_cpu_seconds": cpu,
        "direct_over_floor_by_cpu": round(least["floor"] / least["direct"], 3) if len(least) == 3 else None,
        "pipeline_over_floor_by_cpu": round(least["floor"] / least["pipeline"], 3) if len(least) == 3 else None,
        "claim_share_of_direct_seconds": [round(d["claim_seconds"] / d["seconds"], 3) for d in (direct, direct_2)],
        "claim_share_of_direct_cpu": [
            round(c / d["backend_cpu_s"], 3) if c is not None and d["backend_cpu_s"] else None
            for c, d in zip(claim_cpu, (direct, direct_2), strict=True)
        ],
        "direct_claim_backend_cpu_s": claim_cpu,
        "pipeline_orchestration_cpu_s": [p["orchestration_cpu_s"] for p in pipelines],
        "load_average_1m_floor_direct_pipeline_direct_floor_pipeline": [
            floor["load"],
            direct["load"],
            pipeline["load"],
            direct_2["load"],
            floor_2["load"],
            pipeline_2["load"],
        ],
        "load_average_1m_before_and_after": [load_before, load_average()],
        "load_budget": budget,
        "load_budget_after_each_pipeline": [
            {
                k: b[k]
                for k in (
                    "enabled",
                    "doing",
                    "limited_by",
                    "stress",
                    "last_stress",
                    "stressed_at",
                    "observed",
                    "peak_in_flight",
                )
            }
            | {"commit_probe_baseline_ms": b["commit_probe_baseline_ms"]}
            for b in budget_after
        ],
        "pipeline_cleaned": [p["cleaned"] for p in pipelines],
        "direct_cleaned": [direct["cleaned"], direct_2["cleaned"]],
        "floor_cleaned": [floor["cleaned"], floor_2["cleaned"]],
        "floor_receipts": [floor["receipts"], floor_2["receipts"]],
        **compared_summary(compare_parallel, compared, direct_rate, least.get("direct")),
        "direct_batch_size_sweep": swept,
        "direct_batch_size_sweep_by_size": sweep_by_size(sweep, swept),
        "pipeline_activities_seconds_after_deadline": [p["activities"] for p in pipelines],
        "history_events": pipeline["history_events"],
        "history_bytes": pipeline["history_bytes"],
        **memory,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument(
        "--parallel",
        type=int,
        default=DEFAULT_PARALLEL,
        help="partitions at a time (default: the planner's, which starts every cohort cleanup by itself)",
    )
    parser.add_argument(
        "--compare-parallel",
        type=int,
        metavar="N",
        help="two more direct runs with N partitions at a time, as a ratio against --parallel (e.g. 8)",
    )
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument(
        "--budget",
        choices=["off", "default"],
        default="off",
        help="the pipeline's load budget: off (default), or as shipped (docs/budget.md)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[],
        help="batch sizes of extra direct runs, in rounds (forward, reverse, ...), e.g. --sweep 500 1000 5000",
    )
    parser.add_argument("--sweep-rounds", type=int, default=2, help="runs of each sweep size (default 2)")
    parser.add_argument(
        "--timeline", metavar="FILE", help="write each sweep run's timeline here (cores busy, backends waiting)"
    )
    args = parser.parse_args()
    result = run_benchmark(
        run(
            args.accounts,
            args.partitions,
            args.parallel,
            args.batch_size,
            tuple(args.sweep),
            args.sweep_rounds,
            args.timeline,
            args.compare_parallel,
            args.budget,
        )
    )
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
