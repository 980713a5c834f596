"""`starter.py outbox ...`: operate the reminder outbox and its relays.

    outbox status [--dead N] [--json]        counts by state, dead letters with the provider's answer, relays
    outbox redeliver EVENT_KEY [--json]      give a dead letter another chance (or send a pending one now)
    outbox relay start [--relays N] [...]    start the long-running relay workflows outbox-relay-1..N
    outbox relay stop [--json]               ask every running relay to stop after its batch
    outbox demo [--accounts N]               local provider + workers + a cleanup: reminders arriving

The operations are plain functions too (tests call them). Bad input raises InputError (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from pydantic import ValidationError
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from core import db, embedded
from core.cli_common import CliContext, emit
from core.config import Settings, mask_url
from core.errors import InputError, validation_message
from core.outbox_models import OutboxRelayInput, RelayBatchSettings
from core.queries import load
from core.temporal import connect
from workflows.outbox_relay import OutboxRelayWorkflow

SQL = load("outbox.sql")
Handler = Callable[[argparse.Namespace, Settings], Awaitable[Any]]
CommandFactory = Callable[..., argparse.ArgumentParser]

RELAY_ID_PREFIX = "outbox-relay-"
_EVENT_KEY = re.compile(r"^\S{1,500}$")


# -- operations -------------------------------------------------------------------------------------


def relay_workflow_id(n: int) -> str:
    return f"{RELAY_ID_PREFIX}{n}"


def check_event_key(value: str) -> str:
    if not _EVENT_KEY.match(value):
        raise InputError(
            f"malformed event key {value!r}: expected 1-500 characters without spaces, "
            "e.g. renewal-reminder:acct_123:v1"
        )
    return value


def _plain(row: asyncpg.Record | dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in dict(row).items()}


async def running_relays(client: Client) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async for wf in client.list_workflows(
        "WorkflowType = 'OutboxRelayWorkflow' AND ExecutionStatus = 'Running'", limit=100
    ):
        memo = await wf.memo()
        rows.append(
            {
                "workflow_id": wf.id,
                "task_queue": wf.task_queue,
                "delivered": memo.get("delivered"),
                "dead": memo.get("dead"),
                "batches": memo.get("batches"),
            }
        )
    return rows


async def outbox_status(pool: asyncpg.Pool, client: Client | None = None, dead_limit: int = 10) -> dict[str, Any]:
    """What an operator asks: how much is pending, due, leased, delivered, dead, and why dead."""
    if dead_limit < 0:
        raise InputError(f"--dead must be 0 or more, got {dead_limit}")
    summary = await pool.fetchrow(SQL.outbox_summary)
    assert summary is not None
    out = _plain(summary)
    out["dead_letters"] = [_plain(r) for r in await pool.fetch(SQL.dead_letters, dead_limit)] if dead_limit else []
    if client is not None:
        try:
            out["relays"] = await running_relays(client)
        except RPCError as err:  # visibility is optional for this report
            out["relays_error"] = str(err)
    return out


async def redeliver_event(pool: asyncpg.Pool, event_key: str, client: Client | None = None) -> dict[str, Any]:
    """Make a dead (or waiting) event due now; refuse delivered or currently leased ones."""
    check_event_key(event_key)
    async with pool.acquire() as conn, conn.transaction():
        current = await conn.fetchrow(SQL.event_by_key + " FOR UPDATE", event_key)
        if current is None:
            raise InputError(f"no outbox event with key {event_key!r}")
        if current["status"] == "delivered":
            raise InputError(
                f"event {event_key} was delivered at {current['delivered_at'].isoformat()}; the provider "
                "deduplicates by key, so a resend would not reach the customer again"
            )
        row = await conn.fetchrow(SQL.redeliver, event_key)
        if row is None:
            raise InputError(
                f"event {event_key} is being sent right now by {current['lease_owner']} "
                f"(lease until {current['leased_until'].isoformat()}); nothing to do"
            )
    out = _plain(row) | {"previous_status": current["status"], "previous_error": current["last_error"]}
    if client is not None:
        out["nudged"] = await nudge_relays(client)
    return out


async def nudge_relays(client: Client) -> list[str]:
    nudged: list[str] = []
    with contextlib.suppress(RPCError):
        for relay in await running_relays(client):
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(relay["workflow_id"]).signal(OutboxRelayWorkflow.nudge)
                nudged.append(relay["workflow_id"])
    return nudged


async def start_relays(
    client: Client,
    task_queue: str,
    *,
    relays: int = 1,
    settings: RelayBatchSettings | None = None,
    idle_sleep_seconds: float = 5.0,
    stop_when_drained: bool = False,
    id_prefix: str = RELAY_ID_PREFIX,
) -> list[dict[str, Any]]:
    """Start (or find) relays `<prefix>1..N`; a relay already running is left as it is."""
    if not 1 <= relays <= 64:
        raise InputError(f"--relays must be between 1 and 64, got {relays}")
    started: list[dict[str, Any]] = []
    for n in range(1, relays + 1):
        workflow_id = f"{id_prefix}{n}"
        try:
            input = OutboxRelayInput(
                relay_id=workflow_id,
                settings=settings or RelayBatchSettings(),
                idle_sleep_seconds=idle_sleep_seconds,
                stop_when_drained=stop_when_drained,
            )
        except ValidationError as err:
            raise InputError(str(err)) from None
        handle = await client.start_workflow(
            OutboxRelayWorkflow.run,
            input,
            id=workflow_id,
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"outbox relay {n} of {relays}",
        )
        started.append({"workflow_id": workflow_id, "run_id": handle.result_run_id})
    return started


async def stop_relays(client: Client) -> list[str]:
    stopped: list[str] = []
    for relay in await running_relays(client):
        with contextlib.suppress(RPCError):
            await client.get_workflow_handle(relay["workflow_id"]).signal(OutboxRelayWorkflow.stop)
            stopped.append(relay["workflow_id"])
    return stopped


# -- CLI --------------------------------------------------------------------------------------------


def _human_status(d: dict[str, Any]) -> str:
    lines = [
        f"pending    {d['pending']} (due now {d['due_now']}, leased {d['leased']}, retrying {d['retrying']})",
        f"delivered  {d['delivered']} (last at {d['last_delivered_at'] or '-'})",
        f"dead       {d['dead']}",
        f"oldest pending since {d['oldest_pending_created_at'] or '-'}; next attempt {d['next_attempt_at'] or '-'}",
    ]
    if d["dead_letters"]:
        lines.append("dead letters (newest first):")
        lines += [f"  {r['event_key']}  attempts={r['attempts']}  {r['dead_reason']}" for r in d["dead_letters"]]
    relays = d.get("relays")
    if relays is not None:
        lines.append(f"running relays: {', '.join(r['workflow_id'] for r in relays) or 'none'}")
    return "\n".join(lines)


async def cmd_outbox_status(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings) as ctx:
        data = await outbox_status(ctx.pool, ctx.client, dead_limit=args.dead)
    emit(args, data, _human_status)


async def cmd_outbox_redeliver(args: argparse.Namespace, settings: Settings) -> None:
    check_event_key(args.event_key)
    async with CliContext(settings) as ctx:
        data = await redeliver_event(ctx.pool, args.event_key, ctx.client)
    emit(
        args,
        data,
        lambda d: (
            f"{d['event_key']}: {d['previous_status']} -> pending, due now "
            f"(redelivery #{d['redeliveries']}; nudged {', '.join(d.get('nudged') or []) or 'no relay'})"
        ),
    )


def _batch_settings(args: argparse.Namespace) -> RelayBatchSettings:
    try:
        return RelayBatchSettings(
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            request_timeout_seconds=args.request_timeout,
            lease_seconds=args.lease,
        )
    except ValidationError as err:
        raise InputError(validation_message(err)) from None


async def cmd_outbox_relay_start(args: argparse.Namespace, settings: Settings) -> None:
    batch = _batch_settings(args)
    async with CliContext(settings) as ctx:
        started = await start_relays(
            ctx.client,
            ctx.settings.task_queue,
            relays=args.relays,
            settings=batch,
            idle_sleep_seconds=args.idle_sleep,
        )
        for s in started:
            s["ui"] = ctx.settings.workflow_url(s["workflow_id"])
    emit(args, started, lambda d: "\n".join(f"relay {s['workflow_id']} running: {s['ui']}" for s in d))


async def cmd_outbox_relay_stop(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings) as ctx:
        stopped = await stop_relays(ctx.client)
    emit(args, stopped, lambda d: f"asked to stop: {', '.join(d) or 'no running relay'}")


async def cmd_outbox_demo(args: argparse.Namespace, settings: Settings) -> None:
    if not 1 <= args.accounts <= 100_000:
        raise InputError(f"--accounts must be between 1 and 100000, got {args.accounts}")
    if not 1 <= args.workers <= 16:
        raise InputError(f"--workers must be between 1 and 16, got {args.workers}")
    resolved = embedded.resolve(settings)
    assert resolved.database_url is not None
    # Its own database on the same server, so the demo shows its own reminders, not a shared backlog.
    demo_url = await fresh_database(resolved.database_url, "outbox_demo")
    demo_settings = resolved.model_copy(update={"database_url": demo_url})
    pool = await db.create_pool(demo_url, max_size=4)
    try:
        client = await connect(demo_settings)
        result = await run_outbox_demo(demo_settings, pool, client, accounts=args.accounts, workers=args.workers)
    finally:
        await pool.close()
    emit(args, result, lambda d: str(d["report"]))


async def fresh_database(url: str, name: str) -> str:
    """(Re)create database `name` on the server of `url`, migrated; returns its URL."""
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    parts = urlsplit(url)
    demo_url = urlunsplit(parts._replace(path="/" + name))
    await db.migrate_url(demo_url)
    return demo_url


async def run_outbox_demo(
    settings: Settings, pool: asyncpg.Pool, client: Client, *, accounts: int, workers: int
) -> dict[str, Any]:
    """A cohort cleanup writes reminders to the outbox; two relays deliver them to the local provider."""
    from core.demo import spawn_worker
    from core.mail_provider import MailProvider, ProviderThread
    from core.operations import seed_accounts, start_cleanup

    token = secrets.token_urlsafe(24)  # for this demo only; printed nowhere
    task_queue = f"outbox-demo-{secrets.token_hex(4)}"
    settings = settings.model_copy(update={"task_queue": task_queue})
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    provider = MailProvider(token, share_429=0.02, share_5xx=0.05, share_timeout=0.005, hang_seconds=2, seed=4)
    with ProviderThread(provider) as served:
        print(f"local mail provider on {served.url}: 5% 503, 2% 429, 0.5% timeouts; live stats at {served.url}/stats")
        env = {"MAIL_PROVIDER_URL": served.url, "MAIL_PROVIDER_TOKEN": token}
        procs = [
            spawn_worker(settings, str(settings.state_dir / f"outbox-demo-worker-{i}.log"), **env)
            for i in range(workers)
        ]
        try:
            deadline = (datetime.now(UTC) + timedelta(seconds=5)).replace(microsecond=0)
            await seed_accounts(pool, prefix=f"mail{deadline:%H%M%S}", deadline=deadline, count=accounts)
            cleanup = await start_cleanup(client, pool, task_queue, deadline=deadline, partitions=4)
            relays = await start_relays(
                client,
                task_queue,
                relays=2,
                settings=RelayBatchSettings(request_timeout_seconds=1, lease_seconds=15, backoff_initial_seconds=0.5),
                idle_sleep_seconds=1,
                id_prefix=f"{task_queue}-relay-",
            )
            print(f"cleanup {cleanup.workflow_id} at {deadline.isoformat()} with {accounts} accounts; relays:")
            for r in relays:
                print(f"  {settings.workflow_url(r['workflow_id'])}")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 180:
                await asyncio.sleep(1)
                row = await pool.fetchrow(SQL.outbox_summary)
                assert row is not None
                s = provider.stats()
                print(
                    f"  t+{time.monotonic() - t0:3.0f}s  outbox: {row['total']} reminders,"
                    f" {row['delivered']} delivered,"
                    f" {row['pending']} pending; provider: {s['received']} requests, customer mailbox"
                    f" {s['delivered']}, duplicates absorbed {s['duplicates']}",
                    flush=True,
                )
                if row["total"] >= accounts and row["delivered"] + row["dead"] == row["total"]:
                    break
            for relay in relays:
                await client.get_workflow_handle(relay["workflow_id"]).signal(OutboxRelayWorkflow.stop)
            totals = [
                await client.get_workflow_handle_for(OutboxRelayWorkflow.run, r["workflow_id"]).result() for r in relays
            ]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)
        stats = provider.stats()
        sample = provider.messages(limit=3)
    report = "\n".join(
        [
            f"{stats['delivered']} reminders in the customer's mailbox for {accounts} cleaned accounts; the provider "
            f"received {stats['received']} requests for {stats['unique_keys']} keys (responses {stats['responses']};"
            f" duplicates absorbed by key: {stats['duplicates']})",
            "last messages in the mailbox:",
            *(f"  {m['message_id']}  {m['account_id']}  {m['idempotency_key']}" for m in sample),
            f"inspect: python starter.py --database-url '{mask_url(settings.database_url)}' outbox status",
        ]
    )
    return {
        "provider": stats | {"duplicates_by_key": len(stats["duplicates_by_key"])},
        "relays": [t.model_dump(mode="json") for t in totals],
        "report": report,
    }


async def _no_subcommand(args: argparse.Namespace, settings: Settings) -> None:
    raise InputError("choose an outbox command: status, redeliver, relay, demo")


def register_outbox_commands(sub: Any, command: CommandFactory) -> None:
    """Called once from starter.build_parser: adds `outbox status|redeliver|relay|demo`."""
    outbox = command("outbox", _no_subcommand, "operate the reminder outbox and its relays", json_flag=False)
    nested = outbox.add_subparsers(dest="outbox_command", required=True)

    def sub_command(parent: Any, name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(handler=handler)
        return p

    p = sub_command(nested, "status", cmd_outbox_status, "counts by state, dead letters and their reasons, relays")
    p.add_argument("--dead", type=int, default=10, help="dead letters to list (default 10)")

    p = sub_command(nested, "redeliver", cmd_outbox_redeliver, "give a dead letter (or a waiting event) a new try")
    p.add_argument("event_key", help="e.g. renewal-reminder:acct_123:v1")

    relay = nested.add_parser("relay", help="start or stop the relay workflows")
    relay_sub = relay.add_subparsers(dest="relay_command", required=True)
    p = sub_command(relay_sub, "start", cmd_outbox_relay_start, "start relays outbox-relay-1..N (idempotent)")
    p.add_argument("--relays", type=int, default=2, help="relay workflows to run (default 2)")
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight per batch")
    p.add_argument("--request-timeout", type=float, default=10.0, help="seconds per provider request")
    p.add_argument("--lease", type=float, default=120.0, help="lease seconds per claimed batch")
    p.add_argument("--idle-sleep", type=float, default=5.0, help="seconds between polls of an empty outbox")
    sub_command(relay_sub, "stop", cmd_outbox_relay_stop, "ask every running relay to stop after its batch")

    p = sub_command(nested, "demo", cmd_outbox_demo, "local provider + workers + cleanup: reminders arriving")
    p.add_argument("--accounts", type=int, default=2000)
    p.add_argument("--workers", type=int, default=2)
