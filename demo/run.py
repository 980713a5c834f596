"""The README's first command: accounts cleaned at their deadlines by the planner, end to end.

Nobody runs a cleanup command: two `worker.py` processes ensure the demo's own deadline planner,
which starts one cohort cleanup per deadline bucket; the demo only seeds, renews and watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from cleanup.models import CLEANUP_WORKFLOW, CleanupResult, planner_workflow_id
from cleanup.operations import nudge_planner, renew
from cleanup.planner import planner_status
from core.config import PROJECT_ROOT, Settings
from core.queries import load
from core.temporal import describe_or_none
from demo.fixture import seed_accounts
from demo.mail_provider import FaultShares, MailProvider, ProviderThread
from outbox.models import RELAY_STOP_SIGNAL, RelayBatchSettings, RelayTotals
from outbox.operations import start_relays

SQL = load(__file__)
COUNTS = ("claimed", "cleaned", "skipped_renewed", "skipped_stale", "already_applied", "reminders")


def say(text: str) -> None:
    """Progress goes to stderr, so `--json` output on stdout stays parseable."""
    print(text, file=sys.stderr, flush=True)


async def stop_and_wait_for_relays(client: Client, workflow_ids: list[str]) -> list[RelayTotals]:
    """Ask the given relays to stop after their batch, then wait for their totals."""
    for workflow_id in workflow_ids:
        await client.get_workflow_handle(workflow_id).signal(RELAY_STOP_SIGNAL)
    return [await client.get_workflow_handle(w, result_type=RelayTotals).result() for w in workflow_ids]


def hms(at: datetime) -> str:
    return f"{at:%H:%M:%S}.{at.microsecond // 1000:03d}"


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    assert settings.temporal_address is not None and settings.database_url is not None
    env.update(
        TEMPORAL_ADDRESS=settings.temporal_address,
        TEMPORAL_NAMESPACE=settings.temporal_namespace,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
        DATABASE_URL=settings.database_url,
        # The workers ensure the demo's planner (its ID names the demo's own task queue).
        CLEANUP_PLANNER="on",
    )
    env.update(extra)
    env.pop("DATABASE_URL_FILE", None)  # the URL is given: its file form too would be an error
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


async def wait_until(predicate: Any, within: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo waited {within:.0f} s for {what}")
        await asyncio.sleep(interval)


async def planner_cleanups(client: Client, task_queue: str) -> list[str]:
    """The cleanups the demo's planner started (on the demo's own task queue)."""
    query = f"TaskQueue = '{task_queue}' AND WorkflowType = '{CLEANUP_WORKFLOW}'"
    return sorted([w.id async for w in client.list_workflows(query)])


async def run_demo(
    settings: Settings,
    pool: asyncpg.Pool,
    client: Client,
    *,
    accounts: int,
    renew_share: float,
    workers: int,
    lead_seconds: float = 10.0,
    spread_seconds: float = 15.0,
) -> dict[str, Any]:
    """Start the workers (and so the planner), seed accounts with deadlines spread over a window,
    renew some, wait until the planner has cleaned every other one, deliver the reminders, report."""
    planner_id = planner_workflow_id(settings.task_queue)
    token = secrets.token_urlsafe(24)  # the local provider's token for this run; printed nowhere
    provider = MailProvider(token, FaultShares(share_5xx=0.02, share_429=0.01, retry_after="1"), seed=accounts)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with ProviderThread(provider) as served:
        # Batches of up to 100 reminders per request to the provider's batch endpoint (docs/outbox.md).
        env = {"MAIL_PROVIDER_URL": served.url, "MAIL_PROVIDER_TOKEN": token, "MAIL_PROVIDER_BATCH_MAX": "100"}
        procs = [
            spawn_worker(settings, str(settings.state_dir / f"demo-worker-{i}.log"), **env) for i in range(workers)
        ]
        try:
            say(f"starting {workers} workers; they ensure the demo's deadline planner {planner_id} ...")

            async def planner_running() -> bool:
                desc = await describe_or_none(client, planner_id)
                return desc is not None and desc.status == WorkflowExecutionStatus.RUNNING

            await wait_until(planner_running, 120, "the workers to start the planner")
            relays = await start_relays(
                client,
                settings.task_queue,
                relays=1,
                settings=RelayBatchSettings(request_timeout_seconds=2, backoff_initial_seconds=0.5),
                idle_sleep_seconds=1,
                id_prefix=f"{settings.task_queue}-relay-",
            )

            start = datetime.now(UTC) + timedelta(seconds=lead_seconds)
            prefix = f"demo{start:%H%M%S}"
            pattern = f"acct_{prefix}_%"
            seeded = await seed_accounts(pool, prefix=prefix, deadline=start, count=accounts)
            window = await pool.fetchrow(SQL.spread_deadlines, pattern, start, spread_seconds)
            assert window is not None
            await nudge_planner(client, settings.task_queue)  # plan now rather than at the next tick
            say(
                f"seeded {seeded['accounts']} accounts, deadlines spread from {hms(window['first'])} to "
                f"{hms(window['last'])}; no cleanup command: the planner starts one cleanup per deadline bucket"
            )

            # Renewals before the deadlines: a share for good, one to a new deadline (a bucket of
            # its own); the account due first is kept for a renewal after its deadline.
            due = [(r["account_id"], r["renewal_deadline"]) for r in await pool.fetch(SQL.deadlines_of, pattern)]
            late_account, (moved, moved_from) = due[0][0], due[-1]
            moved_to = (window["last"] + timedelta(seconds=3)).replace(microsecond=0)
            others = [a for a, _ in due[1:-1]]
            to_renew = random.Random(accounts).sample(others, min(len(others), int(len(due) * renew_share)))
            limit = asyncio.Semaphore(16)

            async def renew_one(account_id: str) -> bool:
                async with limit:
                    return (await renew(client, pool, settings.task_queue, account_id)).in_time

            moved_outcome = await renew(client, pool, settings.task_queue, moved, moved_to)
            renewed_in_time = sum(await asyncio.gather(*(renew_one(a) for a in to_renew)))
            say(
                f"renewed {renewed_in_time} accounts before their deadlines, and {moved} from "
                f"{moved_from:%H:%M:%S} to {moved_to:%H:%M:%S}; waiting for the planner to clean the rest ..."
            )

            async def all_done() -> bool:
                return int(await pool.fetchval(SQL.not_yet_terminal, pattern)) == 0

            await wait_until(all_done, lead_seconds + spread_seconds + 180, "the planner to clean every account")
            late_renewal = await renew(client, pool, settings.task_queue, late_account)
            cleanups = await planner_cleanups(client, settings.task_queue)
            results = [await client.get_workflow_handle(w, result_type=CleanupResult).result() for w in cleanups]

            say("cleaned; the outbox relay delivers the renewal reminders to the local mail provider ...")
            await wait_until(lambda: _no_pending(pool), 120, "the relay to deliver the reminders", interval=0.5)
            await stop_and_wait_for_relays(client, [r.workflow_id for r in relays])
            status = await planner_status(client, pool, settings.task_queue)
            moved_state = await pool.fetchrow(SQL.account_state, moved)
            cleaned = await pool.fetchval(SQL.cleaned_accounts, pattern)
            duplicates = await pool.fetchval(SQL.duplicate_effects)
            delivered = await pool.fetchval(SQL.delivered_reminders)
        finally:
            # The planner is the demo's own: stop it, so nothing of the demo keeps running.
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(planner_id).terminate(reason="demo over")
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
        mail = provider.stats()

    settlements = [r.settlement for r in results if r.settlement is not None]
    counts = {k: sum(getattr(s, k) for s in settlements) for k in COUNTS}
    buckets = [w for w in cleanups if w.startswith("cleanup-bucket-")]
    assert status.lateness_seconds is not None, "the demo's planner status reads the database"
    lateness = status.lateness_seconds.model_dump()
    window_s, bucket_s = status.settings.cohort_seconds, status.settings.bucket_seconds
    assert moved_state is not None
    moved_cleaned = moved_state["status"] == "cleaned" and moved_state["cleanup_version"] == 2

    def seconds(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    rows = [
        ("accounts seeded", seeded["accounts"]),
        ("deadlines spread", f"{hms(window['first'])} to {hms(window['last'])}"),
        (
            "cleanups started by the planner (no command)",
            f"{len(buckets)} cohorts (windows of {window_s:g} s, dense ones in buckets of {bucket_s:g} s), "
            f"{len(cleanups) - len(buckets)} overdue sweeps",
        ),
        ("renewed before the deadline", renewed_in_time),
        (
            f"renewed to a new deadline ({moved})",
            "cleaned once, at version 2" if moved_outcome.in_time and moved_cleaned else "NOT as expected",
        ),
        ("claimed at the deadlines", counts["claimed"]),
        ("cleaned", counts["cleaned"]),
        ("skipped as renewed", counts["skipped_renewed"]),
        ("duplicates absorbed (already applied)", counts["already_applied"]),
        ("renewal reminders written to the outbox", counts["reminders"]),
        ("duplicate effects (records, reminders)", duplicates),
        ("reminders delivered (outbox)", delivered),
        (
            "reminders sent to the provider (incl. injected 429/5xx retries)",
            f"{mail['received']} in {mail['batch_requests']} batch requests",
        ),
        ("customer mailbox (each reminder once)", mail["delivered"]),
        (f"late renewal of {late_account}", "reported too late" if not late_renewal.in_time else "in time?!"),
        (
            "lateness (cleaned - deadline) p50 / p99 / max",
            " / ".join(seconds(lateness[k]) for k in ("p50", "p99", "max")),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    links = [url for url in [settings.workflow_url(planner_id), *map(settings.workflow_url, buckets[:1])] if url]
    report = "\n".join(
        [f"\nResult of the deadline planner {planner_id}", "-" * (width + 12)]
        + [f"{k.ljust(width)}  {v}" for k, v in rows]
        + (["\nBrowse it in the Temporal UI (the planner, and its first bucket cleanup):", *links] if links else [])
        + ["Stop the embedded Temporal server and Postgres with: ./dev down"]
    )
    return {
        "task_queue": settings.task_queue,
        "planner_workflow_id": planner_id,
        "accounts": seeded["accounts"],
        "deadlines": {"first": window["first"].isoformat(), "last": window["last"].isoformat()},
        "cleanups": cleanups,
        "buckets": len(buckets),
        "outcomes": sorted({r.outcome for r in results}),
        "renewed_in_time": renewed_in_time,
        "moved": {
            "account_id": moved,
            "in_time": moved_outcome.in_time,
            "status": moved_state["status"],
            "version": moved_state["cleanup_version"],
        },
        "counts": counts,
        "cleaned_accounts": cleaned,
        "duplicate_effects": duplicates,
        "reminders_delivered": delivered,
        "customer_mailbox": mail["delivered"],
        "provider_requests": mail["batch_requests"],
        "provider_messages": mail["received"],
        "late_renewal_reported": not late_renewal.in_time,
        "lateness_seconds": {k: lateness[k] for k in ("cleanups", "p50", "p99", "max")},
        "ui": settings.workflow_url(planner_id),
        "report": report,
    }


async def _no_pending(pool: asyncpg.Pool) -> bool:
    return int(await pool.fetchval(SQL.pending_reminders)) == 0
