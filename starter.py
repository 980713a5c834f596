"""The operator CLI: start cleanups, record renewals, inspect runs and the jobs (the demo, the seeding and the
fault harness run from a checkout: `python -m devstack`, `./dev`).

Exit codes: 0 success, 1 an unexpected error (a one-line message; CLEANUP_DEBUG=1 for the
traceback), 2 bad input or configuration (nothing was started), 3 a renewal that came too late, 75
the database or Temporal temporarily unavailable (retry later). Under --json an error is one JSON
object on stderr: {"error", "message", "hint"}. While the database is down, `status`, `cleanup list`
and `planner status` answer what Temporal knows and say which part is missing; while every worker is
down, the status commands answer within seconds from Temporal's describe and the database, and say
that no worker answered.
Secrets (API key, encryption key, database password) never appear in what the CLI prints.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import sys
import traceback
from typing import Any

from pydantic import ValidationError

from budget import cli as budget_cli
from cleanup import cli as cleanup_cli
from cleanup import grants as cleanup_grants
from cleanup.targets import load_targets
from core import addresses, db
from core.cli import (
    EXIT_ERROR,
    EXIT_INPUT,
    EXIT_UNAVAILABLE,
    CliParser,
    Commands,
    add_connection_flags,
    emit,
    reject_non_finite,
    report_error,
    table,
)
from core.config import Settings, mask_url, process_switch
from core.errors import InputError, Unavailable
from core.process import exit_now
from ledger import cli as ledger_cli
from outbox import cli as outbox_cli


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> None:
    """The only command that changes the schema: each pending file in its own transaction (with a
    lock timeout), then the worker role's grants on the declared targets, table by table."""
    url = addresses.database_url(settings)  # the database only: no Temporal needed
    applied = await db.await_db(url, db.migrate_url(url, settings))
    data: dict[str, Any] = {"applied": applied}
    if args.demo_game:
        await cleanup_grants.create_demo_game(url, settings)
    data |= await cleanup_grants.grant_targets_url(url, load_targets(settings.cleanup.targets_file), settings)
    if args.grant_worker_role:
        data["granted_worker_role_to"] = await db.grant_worker_role(url, args.grant_worker_role, settings)
    emit(args, data, _migrated_text)


async def cmd_migrate_status(args: argparse.Namespace, settings: Settings) -> None:
    url = addresses.database_url(settings)  # the database only: no Temporal needed
    rows = await db.await_db(url, db.migration_status_url(url, settings))
    emit(args, rows, lambda d: table(d, ["name", "state", "checksum"]))
    changed = [r["name"] for r in rows if r["state"] == "changed"]
    if changed:
        raise InputError(f"applied migration files changed since they were applied: {', '.join(changed)}")


async def cmd_migrate_sql(args: argparse.Namespace, settings: Settings) -> None:
    """`migrate sql`: what `migrate apply` would run, printed for review, nothing run. Without
    --all the database says which files are pending (read only); with it no connection is made."""
    if args.all:
        files = db.migration_files()
    else:
        url = addresses.database_url(settings)
        files = await db.await_db(url, db.pending_files_url(url, settings))
    script = db.migration_script(files, settings)
    emit(args, {"pending": [p.name for p in files], "sql": script}, lambda d: d["sql"].rstrip("\n"))


def _migrated_text(d: dict[str, Any]) -> str:
    text = f"applied: {', '.join(d['applied']) or 'nothing (up to date)'}"
    text += "\ngranted to the worker role: " + ("; ".join(d["granted"]) or "nothing")
    if d["missing"]:
        text += f"\ndeclared target tables that do not exist (not granted): {', '.join(d['missing'])}"
    for problem in d.get("follow_ups_not_granted", []):
        text += f"\nfollow-up not planned, its tables not granted: {problem}"
    return text


# Old spellings, kept working: a first command word -> the noun and verb it now is. The parser (so
# --help and the docs tests) knows only the nouns; tests/test_cli_shape.py runs every alias.
ALIASES: dict[str, tuple[str, ...]] = {
    "renew": ("account", "renew"),
    "hold": ("account", "hold"),
    "release": ("account", "release"),
    "list": ("cleanup", "list"),
    "failed": ("cleanup", "failed"),
    "retry-failed": ("cleanup", "retry"),
    "prune": ("cleanup", "prune"),
    "reconcile": ("ledger", "reconcile"),
}


# The development commands, which run from a checkout only: named with where they went, since the
# installed command never loads them (tests/test_cli_shape.py).
CHECKOUT_COMMANDS = {"seed": "seed", "demo": "demo", "dev": "up|down", "harness": "harness"}


def command_index(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Where the command word of `argv` is: the first word after the global options (and their values)."""
    takes_value = {flag for a in parser._actions if a.nargs != 0 for flag in a.option_strings}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in takes_value else 1  # `--flag=value` is one word
    return i


def expand_alias(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with its command word spelled as ALIASES says."""
    i = command_index(parser, argv)
    if i < len(argv) and argv[i] in ALIASES:
        return [*argv[:i], *ALIASES[argv[i]], *argv[i + 1 :]]
    return argv


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
    p = commands.add("status", commands.status, "show one run by workflow ID (a cleanup or a ledger date)")
    p.add_argument("workflow_id", help="a cleanup's or a ledger reconciliation's workflow ID")
    _add_worker(commands)
    return parser


def _add_migrate(commands: Commands) -> None:
    """`migrate apply|status|sql`: the database schema."""
    migrate = commands.group(
        "migrate",
        "the database schema: apply it (the default verb: `migrate` is `migrate apply`), show it, or print"
        " the pending DDL for review",
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
    p = migrate.add("sql", cmd_migrate_sql, "print the DDL `migrate apply` would run on this database, for review")
    p.add_argument("--all", action="store_true", help="every migration file, as for an empty database (no connection)")


def _add_worker(commands: Commands) -> None:
    """`worker`: a process, whose own parser (worker.main) reads its arguments (see run)."""
    help = "run a worker (`worker --help` for its options; the global options above apply too)"
    p = commands.sub.add_parser("worker", help=help, description=help, add_help=False)
    p.set_defaults(handler=None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    i = command_index(parser, argv)
    if i < len(argv) and argv[i] in CHECKOUT_COMMANDS:
        moved = CHECKOUT_COMMANDS[argv[i]]
        where = f"`./dev {moved}` or `python -m devstack {moved}`"
        message = f"{argv[i]!r} is not a command of deadline-cleanup: it runs from a checkout, as {where}"
        return report_error(EXIT_INPUT, message, as_json="--json" in argv)
    return run(parser, expand_alias(parser, argv))


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse `argv` with `parser` (this CLI's, or `python -m devstack`'s), then run the command's
    handler with the settings, mapping errors to the exit codes above. A command that sets
    `takes_rest` gets the arguments its parser does not know as `args.rest`."""
    CliParser.json_errors = "--json" in argv
    args, rest = parser.parse_known_args(argv)
    if args.command == "worker":
        return run_worker_command(args, rest)
    if getattr(args, "takes_rest", False):
        args.rest = rest
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
            message = str(db.unavailable(settings.database_url, err, settings))
            return report_error(EXIT_UNAVAILABLE, redact(message, settings), as_json=as_json)
        if process_switch("CLEANUP_DEBUG"):
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
