"""Single-account cleanups vs. a bare workflow: `python -m bench.single_accounts --workflows 2000`.

N one-account cleanups sleep to a common deadline; completions per second after the deadline are
divided by those of N bare workflows (sleep to a common deadline, one no-op activity) on the same
server and worker process, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import Client

from bench.bare_workflow import BareDeadlineWorkflow
from bench.common import machine, run_benchmark, stack, wait_for_worker
from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from demo.fixture import seed_accounts


async def _bounded(n: int, make: Callable[[int], Awaitable[Any]], parallel: int = 32) -> None:
    limit = asyncio.Semaphore(parallel)

    async def one(i: int) -> None:
        async with limit:
            await make(i)

    await asyncio.gather(*(one(i) for i in range(n)))


async def _completions_per_second(client: Client, query: str, n: int, deadline: datetime) -> float:
    """Wait until n runs completed; rate = n / seconds from the deadline to the last completion."""
    give_up = time.monotonic() + 600
    while True:
        done = (await client.count_workflows(query)).count
        if done >= n:
            break
        if time.monotonic() > give_up:
            raise TimeoutError(f"only {done} of {n} runs completed within 10 minutes ({query})")
        await asyncio.sleep(0.1)
    return n / (datetime.now(UTC) - deadline).total_seconds()


async def run(workflows: int) -> dict[str, Any]:
    async with stack() as s:
        s.start_worker()
        await wait_for_worker(s.client, s.settings.task_queue)
        # Starting is slow on a busy dev server: a generous lead, counted from after the seeding.
        lead = timedelta(seconds=5 + workflows / 25)

        await seed_accounts(s.pool, prefix="s", deadline=datetime(2100, 1, 1, tzinfo=UTC), count=workflows)
        ids = [r[0] for r in await s.pool.fetch("SELECT account_id FROM accounts ORDER BY account_id")]
        deadline = (datetime.now(UTC) + lead).replace(microsecond=0)
        await s.pool.execute("UPDATE accounts SET renewal_deadline = $1", deadline)
        t = time.perf_counter()
        await _bounded(
            workflows,
            lambda i: start_cleanup(s.client, s.pool, s.settings.task_queue, StartCleanup(account_id=ids[i])),
        )
        start_seconds = time.perf_counter() - t
        assert datetime.now(UTC) < deadline, "starting took longer than the lead; raise the lead"
        cleanup_rate = await _completions_per_second(
            s.client,
            f"WorkflowType = 'RenewalCleanupWorkflow' AND ExecutionStatus = 'Completed'"
            f" AND TaskQueue = '{s.settings.task_queue}'",
            workflows,
            deadline,
        )
        cleaned = await s.pool.fetchval("SELECT count(*) FROM cleanup_applied")

        bare_deadline = (datetime.now(UTC) + lead).replace(microsecond=0)
        await _bounded(
            workflows,
            lambda i: s.client.start_workflow(
                BareDeadlineWorkflow.run, bare_deadline, id=f"bare-{i}", task_queue=s.settings.task_queue
            ),
        )
        assert datetime.now(UTC) < bare_deadline, "starting took longer than the lead; raise the lead"
        bare_rate = await _completions_per_second(
            s.client,
            f"WorkflowType = 'BareDeadlineWorkflow' AND ExecutionStatus = 'Completed'"
            f" AND TaskQueue = '{s.settings.task_queue}'",
            workflows,
            bare_deadline,
        )
        memory = s.memory()
    return {
        "scenario": "single_account_cleanups",
        "workflows": workflows,
        "start_seconds": round(start_seconds, 2),
        "cleanup_completions_per_s": round(cleanup_rate, 1),
        "bare_completions_per_s": round(bare_rate, 1),
        "ratio": round(cleanup_rate / bare_rate, 3),
        "target": ">= 0.5",
        "accounts_cleaned": cleaned,
        **memory,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workflows", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(run_benchmark(run(args.workflows)), indent=2))


if __name__ == "__main__":
    main()
