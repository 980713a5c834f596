"""The operator CLI: start cleanups, record renewals, inspect runs, run the demo.

Exit codes: 0 success, 1 an unexpected error (a one-line message; CLEANUP_DEBUG=1 for the
traceback), 2 bad input or configuration, or the database unavailable (nothing was started), 3 a
renewal that came too late. While the database is down, `status`, `list` and `planner status` answer what
Temporal knows and say which part is missing.
Secrets (API key, encryption key, database password) never appear in what the CLI prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
import uuid
from typing import Any

from pydantic import ValidationError

from cleanup import cli as cleanup_cli
from core import budget_cli, db, embedded
from core.cli import EXIT_ERROR, EXIT_INPUT, EXIT_UNAVAILABLE, Commands, emit, key_values
from core.config import Settings, mask_url
from core.errors import InputError, Unavailable
from core.process import exit_now
from core.temporal import connect
from ledger import cli as ledger_cli
from outbox import cli as outbox_cli


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> None:
    settings = embedded.resolve(settings)
    assert settings.database_url is not None
    applied = await db.await_db(settings.database_url, db.migrate_url(settings.database_url))
    data: dict[str, Any] = {"applied": applied}
    if args.grant_worker_role:
        data["granted_worker_role_to"] = await db.grant_worker_role(settings.database_url, args.grant_worker_role)
    emit(args, data, lambda d: f"applied: {', '.join(d['applied']) or 'nothing (up to date)'}")


async def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    """Runs in a database and on a task queue of its own, so it never mixes with real work."""
    from demo.run import run_demo

    resolved = embedded.resolve(settings)
    assert resolved.database_url is not None
    demo_url = await db.create_database(resolved.database_url, "deadline_cleanup_demo", replace=True)
    # Its own task queue, hence its own planner (`deadline-planner-demo-...`) and bucket cleanups.
    demo = resolved.model_copy(update={"database_url": demo_url, "task_queue": f"demo-{uuid.uuid4().hex[:8]}"})
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
            spread_seconds=args.spread_seconds,
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


async def cmd_harness(args: argparse.Namespace, settings: Settings) -> None:
    """The fault harness loads only when invoked: the operator CLI does not import it otherwise."""
    from harness.cli import run_harness_cli

    await run_harness_cli(args.harness_args, settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="starter.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--temporal-address", help="default: $TEMPORAL_ADDRESS, else the embedded dev server")
    parser.add_argument("--namespace", help="default: $TEMPORAL_NAMESPACE or 'default'")
    parser.add_argument("--task-queue", help="default: $TEMPORAL_TASK_QUEUE or 'deadline-cleanup'")
    parser.add_argument("--database-url", help="default: $DATABASE_URL, else the embedded Postgres")
    commands = Commands(parser.add_subparsers(dest="command", required=True))
    command = commands.add

    p = command("migrate", cmd_migrate, "apply the database schema (idempotent)")
    p.add_argument(
        "--grant-worker-role",
        metavar="LOGIN",
        help="then make this existing login a member of the least-privileged role cleanup_worker",
    )
    cleanup_cli.register(commands)
    ledger_cli.register(commands)
    outbox_cli.register(commands)
    budget_cli.register(commands)

    p = command("status", commands.status, "show one run by workflow ID (a cleanup or a ledger date)")
    p.add_argument("workflow_id")

    p = command("demo", cmd_demo, "seed accounts, renew some, let the workers' planner clean them, print results")
    p.add_argument("--accounts", type=int, default=3000)
    p.add_argument("--renew-share", type=float, default=0.1, help="share of accounts renewed before the deadline")
    p.add_argument("--workers", type=int, default=2, help="worker processes to run")
    p.add_argument("--lead-seconds", type=float, default=10.0, help="how far ahead the first deadline is (default 10)")
    p.add_argument("--spread-seconds", type=float, default=15.0, help="deadlines spread over this window (default 15)")

    p = command("dev", cmd_dev, "start (up) or stop (down) the embedded Temporal dev server")
    p.add_argument("action", choices=["up", "down"])

    help = "run the fault-injection harness (`harness --help` for its options)"
    p = commands.sub.add_parser("harness", help=help, description=help, add_help=False)
    p.set_defaults(handler=cmd_harness)  # its arguments are parsed by harness.cli (see main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "harness":
        args.harness_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
    except Unavailable as err:
        print(redact(f"error: {err}", settings), file=sys.stderr)
        return EXIT_UNAVAILABLE
    except Exception as err:
        if db.is_database_error(err):  # a command that opened the database without CliContext
            print(redact(f"error: {db.unavailable(settings.database_url, err)}", settings), file=sys.stderr)
            return EXIT_UNAVAILABLE
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
    exit_now(main())
