"""The README's first command: a cohort cleanup end to end, on the embedded defaults."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from temporalio.client import Client

from cleanup.models import CleanupResult
from cleanup.operations import renew, seed_accounts, start_cleanup
from core.config import PROJECT_ROOT, Settings
from core.queries import load
from outbox.mail_provider import MailProvider, ProviderThread
from outbox.models import RelayBatchSettings
from outbox.operations import start_relays, stop_and_wait_for_relays

SQL = load(__file__)


def say(text: str) -> None:
    """Progress goes to stderr, so `--json` output on stdout stays parseable."""
    print(text, file=sys.stderr, flush=True)


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    assert settings.temporal_address is not None and settings.database_url is not None
    env.update(
        TEMPORAL_ADDRESS=settings.temporal_address,
        TEMPORAL_NAMESPACE=settings.temporal_namespace,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
        DATABASE_URL=settings.database_url,
        # The demo shows the explicit cohort command; the deadline planner stays off in its workers.
        CLEANUP_PLANNER="off",
    )
    env.update(extra)
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


async def run_demo(
    settings: Settings,
    pool: asyncpg.Pool,
    client: Client,
    *,
    accounts: int,
    renew_share: float,
    workers: int,
    lead_seconds: float = 15.0,
) -> dict[str, Any]:
    """Seed, renew some, clean the rest at the deadline, deliver the reminders, report."""
    deadline = (datetime.now(UTC) + timedelta(seconds=lead_seconds)).replace(microsecond=0)
    prefix = f"demo{deadline:%H%M%S}"
    say(f"seeding {accounts} accounts with renewal deadline {deadline.isoformat()} ...")
    seeded = await seed_accounts(pool, prefix=prefix, deadline=deadline, count=accounts)

    token = secrets.token_urlsafe(24)  # the local provider's token for this run; printed nowhere
    provider = MailProvider(token, share_5xx=0.02, share_429=0.01, retry_after="1", seed=deadline.second)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with ProviderThread(provider) as served:
        env = {"MAIL_PROVIDER_URL": served.url, "MAIL_PROVIDER_TOKEN": token}
        procs = [
            spawn_worker(settings, str(settings.state_dir / f"demo-worker-{i}.log"), **env) for i in range(workers)
        ]
        try:
            started = await start_cleanup(client, pool, settings.task_queue, deadline=deadline, partitions=8)
            say(f"cleanup {started.workflow_id} sleeps until the deadline; {workers} workers running")
            relays = await start_relays(
                client,
                settings.task_queue,
                relays=1,
                settings=RelayBatchSettings(request_timeout_seconds=2, backoff_initial_seconds=0.5),
                idle_sleep_seconds=1,
                id_prefix=f"{settings.task_queue}-relay-",
            )

            ids = [r["account_id"] for r in await pool.fetch(SQL.accounts_with_prefix, f"acct_{prefix}_%")]
            to_renew = random.Random(deadline.timestamp()).sample(ids, int(len(ids) * renew_share))
            limit = asyncio.Semaphore(16)

            async def renew_one(account_id: str) -> bool:
                async with limit:
                    return (await renew(client, pool, settings.task_queue, account_id)).in_time

            renewed_in_time = sum(await asyncio.gather(*(renew_one(a) for a in to_renew)))
            say(f"renewed {renewed_in_time} accounts before the deadline; waiting for the cleanup ...")
            result = await client.get_workflow_handle(started.workflow_id, result_type=CleanupResult).result()
            waited = (datetime.now(UTC) - deadline).total_seconds()

            late = next(a for a in ids if a not in set(to_renew))
            late_renewal = await renew(client, pool, settings.task_queue, late)

            say("cleanup settled; the outbox relay delivers the renewal reminders to the local mail provider ...")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                pending = await pool.fetchval(SQL.pending_reminders)
                if pending == 0:
                    break
                await asyncio.sleep(0.5)
            await stop_and_wait_for_relays(client, [r["workflow_id"] for r in relays])
            dupes = await pool.fetchval(SQL.duplicate_reminders, started.workflow_id)
            delivered = await pool.fetchval(SQL.delivered_reminders)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
        mail = provider.stats()

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
        ("renewal reminders written to the outbox", s.reminders),
        ("duplicate reminders in the outbox", dupes),
        ("reminders delivered (outbox)", delivered),
        ("provider requests (incl. injected 429/5xx retries)", mail["received"]),
        ("customer mailbox (each reminder once)", mail["delivered"]),
        (f"late renewal of {late}", "reported too late" if not late_renewal.in_time else "in time?!"),
        ("seconds from the deadline to settlement", f"{waited:.1f}"),
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
        "reminders_delivered": delivered,
        "customer_mailbox": mail["delivered"],
        "provider_requests": mail["received"],
        "late_renewal_reported": not late_renewal.in_time,
        "ui": settings.workflow_url(started.workflow_id),
        "report": report,
    }
