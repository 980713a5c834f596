"""The planner next to one workflow per account: `python -m bench.planner_vs_single --accounts 10000 --spread 600`.

Two private stacks (Temporal dev server + fresh database each), run at the same time so both
designs share the same minutes of machine noise; both databases get the same N accounts with the
shipped game data and the same deadlines, spread uniformly over the same window:

- *planner*: worker processes with the planner on (`python -m worker`), nothing else; the planner
  starts one sleeping cohort cleanup per 1 s deadline bucket.
- *single*: worker processes with the planner off (`python -m bench.worker`) and this process
  calling `start_cleanup(..., account=...)` once per account, in deadline order, before the first
  deadline when it can (each run sleeps until its own account's deadline); starts that finished
  after their account's deadline are counted.

Printed per design: lateness (`cleaned_at - renewal_deadline`, from the database) p50/p99/max, the
Temporal server's CPU seconds over the window (utime + stime from /proc/<pid>/stat, from just
before the deadlines are set until every account is cleaned, so the single design's starts are
included, and apart: during the starts) and its peak RSS (VmHWM), the workers' CPU seconds and peak
RSS, how many workflows ran, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import timedelta
from typing import Any

import bench
from bench.common import LoadSampler, Stack, machine, run_benchmark, stack, wait_for_worker
from bench.planner_lateness import (
    database_now,
    lateness_report,
    seed_cohort,
    spread_deadlines,
    start_planner_workers,
    wait_all_cleaned,
)
from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from core.queries import load

SQL = load(bench.__file__, "scale.sql")


async def _start_single(s: Stack, parallel: int) -> dict[str, Any]:
    """One single-account cleanup per account, in deadline order, `parallel` starts in flight."""
    rows = await s.pool.fetch(SQL.account_ids_by_deadline)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(rows)):
        queue.put_nowait(i)
    late: list[float] = []
    cpu_before = s.cpu()["temporal_server"]
    t0 = time.monotonic()

    async def starter() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await start_cleanup(s.client, s.pool, s.settings.task_queue, StartCleanup(account_id=rows[i]["account_id"]))
            behind = (await database_now(s.pool) - rows[i]["renewal_deadline"]).total_seconds()
            if behind > 0:
                late.append(behind)

    await asyncio.gather(*(starter() for _ in range(parallel)))
    return {
        "workflows_started": len(rows),
        "start_seconds": round(time.monotonic() - t0, 1),
        "temporal_server_cpu_seconds_during_starts": round(s.cpu()["temporal_server"] - cpu_before, 1),
        "started_after_own_deadline": len(late),
        "started_after_own_deadline_max_seconds": round(max(late), 3) if late else 0.0,
    }


async def run(
    accounts: int,
    spread_seconds: float = 600.0,
    lead_seconds: float | None = None,
    workers: int = 2,
    start_parallel: int = 32,
    drain_seconds: float = 600.0,
) -> dict[str, Any]:
    # Starting one workflow per account takes a while (about 10-30 starts/s on 2 shared cores):
    # by default the first deadline comes after that, so the starts are not billed as lateness.
    lead_seconds = lead_seconds if lead_seconds is not None else 60 + accounts / 25
    async with stack() as p, stack() as s:
        seed = await asyncio.gather(seed_cohort(p.pool, accounts, "v"), seed_cohort(s.pool, accounts, "v"))
        await start_planner_workers(p, workers, {})
        for _ in range(workers):
            s.start_worker("bench.worker")
        await wait_for_worker(s.client, s.settings.task_queue)
        cpu_before = {"planner": p.cpu(), "single": s.cpu()}
        with LoadSampler() as load:
            first = max(await database_now(p.pool), await database_now(s.pool)) + timedelta(seconds=lead_seconds)
            await asyncio.gather(
                spread_deadlines(p.pool, first, spread_seconds), spread_deadlines(s.pool, first, spread_seconds)
            )
            t0 = time.monotonic()
            until = t0 + lead_seconds + spread_seconds + drain_seconds
            starts, planner_done = await asyncio.gather(
                _start_single(s, start_parallel), wait_all_cleaned(p.pool, accounts, until)
            )
            single_done = await wait_all_cleaned(s.pool, accounts, until)
            wall = time.monotonic() - t0
        cpu_after = {"planner": p.cpu(), "single": s.cpu()}
        designs: dict[str, Any] = {}
        for name, st, done in (("planner", p, planner_done), ("single", s, single_done)):
            report = await lateness_report(st.pool, first)
            workflows = (await st.client.count_workflows(f"TaskQueue = '{st.settings.task_queue}'")).count
            cpu = {k: round(cpu_after[name][k] - cpu_before[name][k], 1) for k in cpu_after[name]}
            designs[name] = {
                "all_cleaned": done,
                "cleaned": report["cleaned"],
                "not_cleaned": report["not_cleaned"],
                "lateness_seconds": report["lateness_seconds"],
                "claim_lateness_seconds": report["claim_lateness_seconds"],
                "idempotency_records_per_account": report["idempotency_records_per_account"],
                "cleaned_by": report["cleaned_by"],
                "load_budget": report["load_budget"],
                "workflows": workflows,
                "temporal_server_cpu_seconds": cpu["temporal_server"],
                "worker_cpu_seconds": [v for k, v in sorted(cpu.items()) if k.startswith("worker_")],
                **st.memory(),
            }
        designs["single"].update(starts)
    pl, si = designs["planner"], designs["single"]
    return {
        "scenario": "planner_vs_single",
        "accounts": accounts,
        "spread_seconds": spread_seconds,
        "lead_seconds": lead_seconds,
        "workers_per_design": workers,
        "how": "both designs at the same time, each on its own Temporal dev server and database",
        "database": "the $DATABASE_URL server (else the embedded Postgres), two fresh databases",
        "seed_seconds": [round(x, 1) for x in seed],
        "seconds_from_spread_to_both_cleaned": round(wall, 1),
        "planner": pl,
        "single": si,
        "server_cpu_single_over_planner": round(
            si["temporal_server_cpu_seconds"] / pl["temporal_server_cpu_seconds"], 2
        ),
        "server_peak_rss_single_over_planner": round(
            si["temporal_server_peak_rss_mib"] / pl["temporal_server_peak_rss_mib"], 2
        ),
        "load_average_1m": load.summary(),
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=10_000)
    parser.add_argument("--spread", type=float, default=600.0)
    parser.add_argument(
        "--lead", type=float, help="first deadline this long after the workers are up (default 60 s + 40 ms/account)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes per design")
    parser.add_argument("--start-parallel", type=int, default=32, help="single-account starts in flight")
    parser.add_argument("--drain", type=float, default=600.0, help="give up this long after the last deadline")
    args = parser.parse_args()
    result = run_benchmark(run(args.accounts, args.spread, args.lead, args.workers, args.start_parallel, args.drain))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
