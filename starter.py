"""The operator CLI: start cleanups, record renewals, inspect runs, run the demo.

Exit codes: 0 success, 1 an unexpected error (a one-line message; CLEANUP_DEBUG=1 for the
traceback), 2 bad input or configuration (nothing was started), 3 a renewal that came too late.
Secrets (API key, encryption key, database password) never appear in what the CLI prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from temporalio.client import Client, WorkflowQueryFailedError
from temporalio.service import RPCError

from core import db, embedded
from core.cli_common import CliContext, emit, key_values, table
from core.cli_ledger import register_ledger_commands
from core.cli_outbox import register_outbox_commands
from core.config import Settings, mask_url
from core.errors import InputError
from core.models import CleanupResult, CleanupStatus
from core.operations import (
    cleanup_status,
    list_cleanups,
    parse_deadline,
    renew,
    seed_accounts,
    start_cleanup,
)
from core.progress import Progress
from core.temporal import connect
from harness.cli import register_harness_commands
from workflows.renewal_cleanup import RenewalCleanupWorkflow

Handler = Callable[[argparse.Namespace, Settings], Awaitable[Any]]
EXIT_ERROR = 1
EXIT_INPUT = 2
EXIT_TOO_LATE = 3


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> None:
    settings = embedded.resolve(settings)
    assert settings.database_url is not None
    applied = await db.migrate_url(settings.database_url)
    data: dict[str, Any] = {"applied": applied}
    if args.grant_worker_role:
        data["granted_worker_role_to"] = await db.grant_worker_role(settings.database_url, args.grant_worker_role)
    emit(args, data, lambda d: f"applied: {', '.join(d['applied']) or 'nothing (up to date)'}")


async def cmd_cleanup(args: argparse.Namespace, settings: Settings) -> None:
    deadline = parse_deadline(args.deadline) if args.deadline else None
    async with CliContext(settings) as ctx:
        started = await start_cleanup(
            ctx.client,
            ctx.pool,
            ctx.settings.task_queue,
            deadline=deadline,
            account_id=args.account,
            partitions=args.partitions,
            max_parallel_partitions=args.max_parallel,
            batch_size=args.batch_size,
            note=args.note,
            allow_empty=args.allow_empty,
        )
        data = started.model_dump(mode="json") | {"ui": ctx.settings.workflow_url(started.workflow_id)}
        if args.wait:
            data["result"] = await wait_for_cleanup(ctx.client, started.workflow_id)
    emit(
        args,
        data,
        lambda d: (
            f"{'started' if d['started'] else 'already exists (not started again)'}: {d['workflow_id']}\n"
            f"deadline {d['deadline']}, {d['accounts_in_scope']} account(s) in scope\n{d['ui']}"
            + (f"\noutcome: {d['result']['outcome']}, settlement: {d['result']['settlement']}" if args.wait else "")
        ),
    )


async def wait_for_cleanup(client: Client, workflow_id: str) -> dict[str, Any]:
    """Wait for the run with a progress bar: the sleep, then partitions reported k/P."""
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, workflow_id)
    result_task = asyncio.ensure_future(handle.result())
    bar: Progress | None = None
    while not result_task.done():
        await asyncio.wait([result_task], timeout=0.5)
        if result_task.done():
            break
        with contextlib.suppress(RPCError, WorkflowQueryFailedError):
            live: CleanupStatus = await handle.query(RenewalCleanupWorkflow.status)
            if live.phase == "sleeping":
                left = (live.deadline - datetime.now(UTC)).total_seconds()
                print(f"\rsleeping until {live.deadline.isoformat()} ({left:.0f}s)".ljust(60), end="", file=sys.stderr)
            else:
                bar = bar or Progress("partitions", live.partitions_total)
                bar.update(live.partitions_done, live.phase)
    if bar:
        bar.finish("settled")
    result: CleanupResult = result_task.result()
    return result.model_dump(mode="json")


async def cmd_seed(args: argparse.Namespace, settings: Settings) -> None:
    deadline = parse_deadline(args.deadline)
    if not 1 <= args.accounts <= 10_000_000:
        raise InputError(f"--accounts must be between 1 and 10,000,000, got {args.accounts}")
    prefix = args.prefix or f"s{deadline:%m%d%H%M%S}"
    if not re.fullmatch(r"[A-Za-z0-9]{1,20}", prefix):
        raise InputError(f"--prefix must be 1-20 letters or digits, got {prefix!r}")
    async with CliContext(settings) as ctx:
        bar = Progress("seeding accounts", args.accounts)
        totals: dict[str, int] = {}
        chunk = 10_000
        for start in range(0, args.accounts, chunk):
            n = min(chunk, args.accounts - start)
            part = await seed_accounts(ctx.pool, prefix=f"{prefix}{start // chunk:03d}", deadline=deadline, count=n)
            totals = {k: totals.get(k, 0) + v for k, v in part.items()}
            bar.update(start + n)
        bar.finish()
    emit(args, totals | {"deadline": deadline}, key_values)


async def cmd_renew(args: argparse.Namespace, settings: Settings) -> None:
    until = parse_deadline(args.until) if args.until else None
    async with CliContext(settings) as ctx:
        outcome = await renew(ctx.client, ctx.pool, ctx.settings.task_queue, args.account_id, until)

    def human(d: dict[str, Any]) -> str:
        if d["in_time"]:
            text = f"renewed in time: {d['account_id']} is now at cleanup version {d['version_after']}"
            if d["signalled"]:
                text += f"\nsignalled: {', '.join(d['signalled'])}"
            if d["restarted_cleanup"]:
                text += f"\nnew cleanup for the new deadline: {d['restarted_cleanup']}"
            return text
        why = "its deadline had passed" if d["status_seen"] == "active" else f"claimed by {d['claimed_by']}"
        return (
            f"too late: {d['account_id']} was already {d['status_seen']} ({why}); "
            "the renewal is recorded but the cleanup stands"
        )

    emit(args, outcome.model_dump(mode="json"), human)
    if not outcome.in_time:
        sys.exit(EXIT_TOO_LATE)


async def cmd_status(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings) as ctx:
        data = await cleanup_status(ctx.client, ctx.pool, args.workflow_id)
        data["ui"] = ctx.settings.workflow_url(args.workflow_id)
    emit(args, data, key_values)


async def cmd_list(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings) as ctx:
        rows = await list_cleanups(ctx.client, limit=args.limit)
    emit(args, rows, table)


async def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    """Runs in a database and on a task queue of its own, so it never mixes with real work."""
    from core.cli_outbox import fresh_database
    from core.demo import run_demo

    resolved = embedded.resolve(settings)
    assert resolved.database_url is not None
    demo_url = await fresh_database(resolved.database_url, "deadline_cleanup_demo")
    demo = resolved.model_copy(update={"database_url": demo_url, "task_queue": f"demo-{os.getpid()}"})
    pool = await db.create_pool(demo_url, max_size=4)
    try:
        client = await connect(demo)
        result = await run_demo(
            demo,
            pool,
            client,
            accounts=args.accounts,
            renew_share=args.renew_share,
            workers=args.workers,
            lead_seconds=args.lead_seconds,
        )
    finally:
        await pool.close()
    emit(args, result, lambda d: str(d.pop("report")))


async def cmd_dev(args: argparse.Namespace, settings: Settings) -> None:
    server = embedded.DevServer(settings.state_dir)
    if args.action == "down":
        server.stop()
        emit(
            args,
            {"temporal": "stopped", "postgres": "running"},
            lambda d: "embedded Temporal dev server stopped (the embedded Postgres keeps running; it is cheap)",
        )
    else:
        resolved = embedded.resolve(settings)
        emit(
            args,
            {
                "temporal": resolved.temporal_address,
                "ui": resolved.ui_url(),
                "database_url": mask_url(resolved.database_url),
            },
            key_values,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="starter.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--temporal-address", help="default: $TEMPORAL_ADDRESS, else the embedded dev server")
    parser.add_argument("--namespace", help="default: $TEMPORAL_NAMESPACE or 'default'")
    parser.add_argument("--task-queue", help="default: $TEMPORAL_TASK_QUEUE or 'deadline-cleanup'")
    parser.add_argument("--database-url", help="default: $DATABASE_URL, else the embedded Postgres")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, handler: Handler, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(handler=handler)
        return p

    p = command("migrate", cmd_migrate, "apply the database schema (idempotent)")
    p.add_argument(
        "--grant-worker-role",
        metavar="LOGIN",
        help="then make this existing login a member of the least-privileged role cleanup_worker",
    )

    p = command("cleanup", cmd_cleanup, "start the cleanup of a cohort (--deadline) or one account (--account)")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--deadline", help="renewal deadline of the cohort, e.g. 2026-11-01T09:00:00Z")
    scope.add_argument("--account", help="one account ID, e.g. acct_123 (its deadline comes from the database)")
    p.add_argument("--partitions", type=int, default=16, help="parallel partitions (1-256, default 16)")
    p.add_argument("--max-parallel", type=int, default=8, help="partitions running at once (default 8)")
    p.add_argument("--batch-size", type=int, default=1000, help="accounts per statement (default 1000)")
    p.add_argument("--note", default="", help="operator note kept in the workflow memo (e.g. a ticket)")
    p.add_argument("--allow-empty", action="store_true", help="start even if no active account has that deadline")
    p.add_argument("--wait", action="store_true", help="wait for the result, with a progress bar on a terminal")

    p = command("seed", cmd_seed, "seed demo accounts (with cloud saves, inventory, match history) at a deadline")
    p.add_argument("--accounts", type=int, required=True)
    p.add_argument("--deadline", required=True, help="their renewal deadline, e.g. 2026-11-01T09:00:00Z")
    p.add_argument("--prefix", help="account ID prefix (letters/digits); default from the deadline")

    p = command("renew", cmd_renew, "record a renewal (database first), then signal the cleanup")
    p.add_argument("account_id")
    p.add_argument("--until", help="new renewal deadline; without it the account is renewed for good")

    p = command("status", cmd_status, "show one cleanup: phase, sleeping until, partitions k/P, settled, counts")
    p.add_argument("workflow_id")

    p = command("list", cmd_list, "list cleanups with their phase and progress")
    p.add_argument("--limit", type=int, default=50)

    p = command("demo", cmd_demo, "seed accounts, renew some, run a cohort cleanup with workers, print results")
    p.add_argument("--accounts", type=int, default=3000)
    p.add_argument("--renew-share", type=float, default=0.1, help="share of accounts renewed before the deadline")
    p.add_argument("--workers", type=int, default=2, help="worker processes to run")
    p.add_argument("--lead-seconds", type=float, default=15.0, help="how far ahead the deadline is (default 15)")

    p = command("dev", cmd_dev, "start (up) or stop (down) the embedded Temporal dev server")
    p.add_argument("action", choices=["up", "down"])
    register_outbox_commands(sub, command)
    register_ledger_commands(sub, command)
    register_harness_commands(sub, command)
    __import__("core.cli_planner").cli_planner.register_planner_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env(
            temporal_address=args.temporal_address,
            temporal_namespace=args.namespace,
            task_queue=args.task_queue,
            database_url=args.database_url,
        )
    except (ValidationError, ValueError) as err:
        print(mask_url(f"error: bad configuration: {err}"), file=sys.stderr)
        return EXIT_INPUT
    try:
        asyncio.run(args.handler(args, settings))
    except InputError as err:
        print(redact(f"error: {err}", settings), file=sys.stderr)
        return EXIT_INPUT
    except Exception as err:
        if os.environ.get("CLEANUP_DEBUG"):
            print(redact(traceback.format_exc(), settings), file=sys.stderr)
        print(redact(f"error: {type(err).__name__}: {err}", settings), file=sys.stderr)
        return EXIT_ERROR
    return 0


def redact(text: str, settings: Settings) -> str:
    for secret in sorted(settings.secrets(), key=len, reverse=True):
        text = text.replace(secret, "***")
    return mask_url(text) or ""


if __name__ == "__main__":
    sys.exit(main())
