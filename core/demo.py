"""The README's first command: a cohort cleanup end to end, on the embedded defaults."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from core.config import PROJECT_ROOT, Settings
from core.models import CleanupResult
from core.operations import renew, seed_accounts, start_cleanup
from workflows.renewal_cleanup import RenewalCleanupWorkflow

if TYPE_CHECKING:
    from starter import Context


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    assert settings.temporal_address is not None and settings.database_url is not None
    env.update(
        TEMPORAL_ADDRESS=settings.temporal_address,
        TEMPORAL_NAMESPACE=settings.temporal_namespace,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
        DATABASE_URL=settings.database_url,
        **extra,
    )
    return env


def spawn_worker(settings: Settings, log_path: str, **extra_env: str) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "worker.py")],
            env=worker_env(settings, **extra_env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
        )


async def run_demo(ctx: Context, *, accounts: int, renew_share: float, workers: int) -> dict[str, Any]:
    settings, pool, client = ctx.settings, ctx.pool, ctx.client
    deadline = (datetime.now(UTC) + timedelta(seconds=15)).replace(microsecond=0)
    prefix = f"demo{deadline:%H%M%S}"
    print(f"seeding {accounts} accounts with renewal deadline {deadline.isoformat()} ...", flush=True)
    seeded = await seed_accounts(pool, prefix=prefix, deadline=deadline, count=accounts)

    settings.state_dir.mkdir(parents=True, exist_ok=True)
    procs = [spawn_worker(settings, str(settings.state_dir / f"demo-worker-{i}.log")) for i in range(workers)]
    try:
        started = await start_cleanup(client, pool, settings.task_queue, deadline=deadline, partitions=8)
        print(f"cleanup {started.workflow_id} sleeps until the deadline; {workers} workers running", flush=True)

        ids = [
            r["account_id"]
            for r in await pool.fetch(
                "SELECT account_id FROM accounts WHERE account_id LIKE $1 ORDER BY account_id",
                f"acct_{prefix}_%",
            )
        ]
        to_renew = random.Random(deadline.timestamp()).sample(ids, int(len(ids) * renew_share))
        limit = asyncio.Semaphore(16)

        async def renew_one(account_id: str) -> bool:
            async with limit:
                return (await renew(client, pool, settings.task_queue, account_id)).in_time

        renewed_in_time = sum(await asyncio.gather(*(renew_one(a) for a in to_renew)))
        print(f"renewed {renewed_in_time} accounts before the deadline; waiting for the cleanup ...", flush=True)
        t0 = time.monotonic()
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await handle.result()
        waited = time.monotonic() - t0

        late = next(a for a in ids if a not in set(to_renew))
        late_renewal = await renew(client, pool, settings.task_queue, late)
        dupes = await pool.fetchval(
            "SELECT (SELECT count(*) FROM outbox WHERE source_id = $1)"
            " - (SELECT count(DISTINCT account_id) FROM outbox WHERE source_id = $1)",
            started.workflow_id,
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)

    s = result.settlement
    assert s is not None
    rows = [
        ("accounts seeded", seeded["accounts"]),
        ("renewed before the deadline", renewed_in_time),
        ("claimed at the deadline", s.claimed),
        ("cleaned", s.cleaned),
        ("skipped as renewed", s.skipped_renewed),
        ("skipped as stale version", s.skipped_stale),
        ("duplicates absorbed (already applied)", s.already_applied),
        ("renewal reminders in the outbox", s.reminders),
        ("duplicate reminders", dupes),
        (f"late renewal of {late}", "reported too late" if not late_renewal.in_time else "in time?!"),
        ("seconds from deadline wait to settlement", f"{waited:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    report = "\n".join(
        [f"\nResult of {started.workflow_id} ({result.outcome})", "-" * (width + 12)]
        + [f"{k.ljust(width)}  {v}" for k, v in rows]
        + [
            f"\nBrowse it in the Temporal UI: {settings.workflow_url(started.workflow_id)}",
            "Stop the embedded Temporal server with: python starter.py dev down",
        ]
    )
    return {
        "workflow_id": started.workflow_id,
        "outcome": result.outcome,
        "renewed_in_time": renewed_in_time,
        "settlement": s.model_dump(mode="json"),
        "duplicate_reminders": dupes,
        "late_renewal_reported": not late_renewal.in_time,
        "ui": settings.workflow_url(started.workflow_id),
        "report": report,
    }
