"""The operator CLI: start cleanups, record renewals, inspect runs, run the demo.

Exit codes: 0 success, 1 an unexpected error (a one-line message; CLEANUP_DEBUG=1 for the
traceback), 2 bad input or configuration (nothing was started), 3 a renewal that came too late, 75
the database or Temporal temporarily unavailable (retry later). Under --json an error is one JSON
object on stderr: {"error", "message", "hint"}. While the database is down, `status`, `list` and
`planner status` answer what Temporal knows and say which part is missing; while every worker is
down, the status commands answer within seconds from Temporal's describe and the database, and say
that no worker answered.
Secrets (API key, encryption key, database password) never appear in what the CLI prints.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import sys
import traceback
from typing import Any

from pydantic import ValidationError

from budget import cli as budget_cli
from cleanup import cli as cleanup_cli
from cleanup import grants as cleanup_grants
from cleanup.targets import load_targets
from core import db, embedded
from core.cli import (
    EXIT_ERROR,
    EXIT_INPUT,
    EXIT_UNAVAILABLE,
    CliParser,
    Commands,
    add_connection_flags,
    emit,
    key_values,
    reject_non_finite,
    report_error,
    table,
)
from core.config import Settings, dev_env_file, mask_url
from core.errors import InputError, Unavailable
from core.process import exit_now
from demo import cli as demo_cli
from ledger import cli as ledger_cli
from outbox import cli as outbox_cli


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> None:
    """The only command that changes the schema: each pending file in its own transaction (with a
    lock timeout), then the worker role's grants on the declared targets, table by table."""
    url = embedded.database_url(settings)  # the database only: no Temporal needed
    applied = await db.await_db(url, db.migrate_url(url))
    data: dict[str, Any] = {"applied": applied}
    if args.demo_game:
        from demo.fixture import create_game_schema

        await create_game_schema(url)
    data |= await cleanup_grants.grant_targets_url(url, load_targets())
    if args.grant_worker_role:
        data["granted_worker_role_to"] = await db.grant_worker_role(url, args.grant_worker_role)
    emit(args, data, _migrated_text)


async def cmd_migrate_status(args: argparse.Namespace, settings: Settings) -> None:
    url = embedded.database_url(settings)  # the database only: no Temporal needed
    rows = await db.await_db(url, db.migration_status_url(url))
    emit(args, rows, lambda d: table(d, ["name", "state", "checksum"]))
    changed = [r["name"] for r in rows if r["state"] == "changed"]
    if changed:
        raise InputError(f"applied migration files changed since they were applied: {', '.join(changed)}")


def _migrated_text(d: dict[str, Any]) -> str:
    text = f"applied: {', '.join(d['applied']) or 'nothing (up to date)'}"
    text += "\ngranted to the worker role: " + ("; ".join(d["granted"]) or "nothing")
    if d["missing"]:
        text += f"\ndeclared target tables that do not exist (not granted): {', '.join(d['missing'])}"
    return text


async def cmd_dev_up(args: argparse.Namespace, settings: Settings) -> None:
    """`dev up` starts the embedded stack (the one command that does, with ./dev and the tests) and
    records its addresses in <state dir>/dev/env, where this checkout's later commands find them."""
    started = embedded.missing_addresses(settings)
    resolved = embedded.resolve(settings, start=True)
    env_file = embedded.write_dev_env(resolved, started) if started else None
    emit(
        args,
        {
            "temporal": resolved.temporal_address,
            "ui": resolved.ui_url(),
            "database_url": mask_url(resolved.database_url),
            "env_file": str(env_file) if env_file else None,
        },
        key_values,
    )


async def cmd_dev_down(args: argparse.Namespace, settings: Settings) -> None:
    stopped = embedded.DevServer(settings.state_dir).stop()
    was_running = embedded.stop_embedded_postgres(settings.state_dir)
    dev_env_file(settings.state_dir).unlink(missing_ok=True)
    emit(
        args,
        {"temporal": stopped, "postgres": "stopped" if was_running else "not running"},
        lambda d: f"embedded Temporal dev server: {stopped}; embedded Postgres: {d['postgres']}",
    )


async def cmd_harness(args: argparse.Namespace, settings: Settings) -> None:
    """The fault harness loads only when invoked: the operator CLI does not import it otherwise."""
    try:
        from harness.cli import run_harness_cli
    except ModuleNotFoundError as err:  # an installed package: the harness stays in the checkout
        raise InputError("the fault harness runs from a checkout only: `python starter.py harness`") from err

    await run_harness_cli(args.harness_args, settings)


def build_parser() -> argparse.ArgumentParser:
    """The operator CLI: the global options, then each job's commands in the order `--help` lists them."""
    parser = CliParser(
        prog="deadline-cleanup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    add_connection_flags(parser)
    commands = Commands(parser.add_subparsers(dest="command", required=True, title="commands"))
    _add_migrate(commands)
    cleanup_cli.register(commands)
    ledger_cli.register(commands)
    outbox_cli.register(commands)
    budget_cli.register(commands)
    demo_cli.register(commands)
    p = commands.add("status", commands.status, "show one run by workflow ID (a cleanup or a ledger date)")
    p.add_argument("workflow_id", help="a cleanup's or a ledger reconciliation's workflow ID")
    demo_cli.register_demo(commands)
    _add_processes(commands)
    return parser


def _add_migrate(commands: Commands) -> None:
    """`migrate apply|status`: the database schema."""
    migrate = commands.group(
        "migrate",
        "the database schema: apply it (the default verb: `migrate` is `migrate apply`) or show it",
        default="apply",
    )
    p = migrate.add("apply", cmd_migrate, "apply the pending migrations (idempotent), then grant the worker role")
    p.add_argument("--demo-game", action="store_true", help="also create the demo game's tables (the default targets)")
    p.add_argument(
        "--grant-worker-role",
        metavar="LOGIN",
        help="then make this existing login a member of the least-privileged role cleanup_worker",
    )
    migrate.add("status", cmd_migrate_status, "each migration file: applied, pending or changed since applied")


def _add_processes(commands: Commands) -> None:
    """`dev up|down`, `worker` and `harness`: processes, whose own parsers read `worker`'s and
    `harness`'s arguments (see main)."""
    dev = commands.group("dev", "the embedded Temporal dev server and Postgres of this checkout")
    dev.add("up", cmd_dev_up, "start them (if not running) and record their addresses for later commands")
    dev.add("down", cmd_dev_down, "stop them and forget their addresses")

    help = "run a worker (`worker --help` for its options; the global options above apply too)"
    p = commands.sub.add_parser("worker", help=help, description=help, add_help=False)
    p.set_defaults(handler=None)  # its arguments are parsed by worker.main (see main)

    help = "run the fault-injection harness (`harness --help` for its options)"
    p = commands.sub.add_parser("harness", help=help, description=help, add_help=False)
    p.set_defaults(handler=cmd_harness)  # its arguments are parsed by harness.cli (see main)


def main(argv: list[str] | None = None) -> int:
    CliParser.json_errors = "--json" in (sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "worker":
        return run_worker_command(args, rest)
    if args.command == "harness":
        args.harness_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    reject_non_finite(parser, args)
    as_json = bool(getattr(args, "json", False))
    try:
        settings = Settings.from_env(
            temporal_address=args.temporal_address,
            temporal_namespace=args.namespace,
            task_queue=args.task_queue,
            database_url=args.database_url,
        )
    except (ValidationError, ValueError) as err:
        return report_error(EXIT_INPUT, mask_url(f"bad configuration: {err}") or "", as_json=as_json)
    try:
        asyncio.run(args.handler(args, settings))
    except Unavailable as err:
        return report_error(EXIT_UNAVAILABLE, redact(str(err), settings), as_json=as_json)
    except InputError as err:
        return report_error(EXIT_INPUT, redact(str(err), settings), as_json=as_json)
    except Exception as err:
        if db.is_database_error(err):  # a command that opened the database without CliContext
            message = str(db.unavailable(settings.database_url, err))
            return report_error(EXIT_UNAVAILABLE, redact(message, settings), as_json=as_json)
        if os.environ.get("CLEANUP_DEBUG"):
            print(redact(traceback.format_exc(), settings), file=sys.stderr)
        return report_error(EXIT_ERROR, redact(f"{type(err).__name__}: {err}", settings), as_json=as_json)
    return 0


def package_version() -> str:
    try:
        return importlib.metadata.version("deadline-cleanup")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def run_worker_command(args: argparse.Namespace, rest: list[str]) -> int:
    """`deadline-cleanup worker ...`: worker.main, with the global options passed on."""
    from worker import main as worker_main  # lazy: the other commands never load the worker

    passed = {
        "--temporal-address": args.temporal_address,
        "--task-queue": args.task_queue,
        "--database-url": args.database_url,
        "--namespace": args.namespace,
    }
    forwarded = [item for flag, value in passed.items() if value is not None for item in (flag, value)]
    return worker_main([*forwarded, *rest])


def console() -> None:
    """The `deadline-cleanup` console command (pyproject.toml's [project.scripts])."""
    exit_now(main())


def redact(text: str, settings: Settings) -> str:
    for secret in sorted(settings.secrets(), key=len, reverse=True):
        text = text.replace(secret, "***")
    return mask_url(text) or ""


if __name__ == "__main__":
    exit_now(main())
