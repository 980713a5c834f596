"""Review commands of starter.py: `failed`, `retry-failed`, and `cleanup --dry-run|--max-failed`.

Registered by one call in starter.build_parser (`register_review_commands(sub, command)`), which
also teaches the existing `cleanup` command two flags without touching its handler:

  --dry-run          what the cleanup would do now (accounts, rows per target, reminders, renewed),
                     from one read-only transaction; nothing is started or changed
  --max-failed N|P%  tolerance of accounts whose cleanup fails deterministically; beyond it the
                     workflow fails (after settling) with the count and the first reasons

Bad input raises InputError (exit 2). The operations are plain functions in core.cleanup_review.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from core import db, embedded
from core.cli_common import emit, table
from core.config import Settings

Handler = Callable[[argparse.Namespace, Settings], Awaitable[Any]]
Command = Callable[..., argparse.ArgumentParser]
FAILED_COLUMNS = [
    "account_id",
    "cleanup_version",
    "cleanup_id",
    "target",
    "sqlstate",
    "message",
    "attempts",
    "resolution",
]


@asynccontextmanager
async def _database(settings: Settings, *, migrate: bool) -> AsyncIterator[asyncpg.Pool]:
    """These commands need the database only: no Temporal connection (nor embedded dev server)."""
    url = settings.database_url or embedded.embedded_postgres_url(settings.state_dir)
    if migrate:
        await db.migrate_url(url)
    pool = await db.create_pool(url, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


async def cmd_failed(args: argparse.Namespace, settings: Settings) -> None:
    from core.cleanup_review import list_failed

    async with _database(settings, migrate=True) as pool:
        rows = await list_failed(pool, args.cleanup, include_resolved=args.all, limit=args.limit)
    emit(args, rows, lambda r: table(r, FAILED_COLUMNS))


async def cmd_retry_failed(args: argparse.Namespace, settings: Settings) -> None:
    from core.cleanup_review import retry_failed
    from core.cleanup_targets import load_targets

    targets = load_targets()
    async with _database(settings, migrate=True) as pool:
        data = await retry_failed(pool, targets, args.cleanup)

    def human(d: dict[str, Any]) -> str:
        text = (
            f"retried {d['retried']}: cleaned {d['cleaned']}, already applied {d['already_applied']}, "
            f"renewed {d['skipped_renewed']}, stale {d['skipped_stale']}, still failing {d['still_failed']}"
        )
        if d["failures"]:
            text += "\n" + table(d["failures"], ["account_id", "sqlstate", "message", "target"])
        return text

    emit(args, data, human)


async def cmd_cleanup_dry_run(args: argparse.Namespace, settings: Settings) -> None:
    """Reads the database only: no Temporal connection, no migration, one read-only transaction."""
    from core.cleanup_review import preview_cleanup
    from core.cleanup_targets import load_targets
    from core.operations import parse_deadline

    deadline = parse_deadline(args.deadline) if args.deadline else None
    targets = load_targets()
    async with _database(settings, migrate=False) as pool:
        data = await preview_cleanup(pool, targets, deadline=deadline, account_id=args.account)

    def human(d: dict[str, Any]) -> str:
        lines = [
            f"dry run ({d['scope']}, deadline {d['deadline'].isoformat()}): nothing was started or changed",
            f"accounts in scope: {d['accounts_in_scope']}",
            f"already renewed: {d['already_renewed']}",
            f"reminders to write: {d['reminders']}",
            table(d["targets"], ["table", "action", "archive_table", "rows"]),
        ]
        return "\n".join(lines)

    emit(args, data, human)


def _hook_cleanup_command(sub: Any) -> None:
    """Add --dry-run and --max-failed to `cleanup`; without them the original handler runs as is."""
    parser = getattr(sub, "choices", {}).get("cleanup")
    if parser is None:
        return
    original: Handler = parser.get_default("handler")
    parser.add_argument(
        "--dry-run", action="store_true", help="show what the cleanup would do now; start and change nothing"
    )
    parser.add_argument(
        "--max-failed",
        metavar="N|P%",
        help="tolerated accounts whose cleanup fails (a count, or a percent of the claimed such as 5%%); "
        "beyond it the run fails after settling (default: no limit)",
    )

    async def cleanup(args: argparse.Namespace, settings: Settings) -> Any:
        if args.dry_run:
            await cmd_cleanup_dry_run(args, settings)
            return None
        if args.max_failed is None:
            return await original(args, settings)
        from core.operations import DEFAULT_MAX_FAILED, parse_failed_tolerance

        parse_failed_tolerance(args.max_failed)  # bad input: exit 2 before anything starts
        token = DEFAULT_MAX_FAILED.set(args.max_failed)
        try:
            return await original(args, settings)
        finally:
            DEFAULT_MAX_FAILED.reset(token)

    parser.set_defaults(handler=cleanup)


def register_review_commands(sub: Any, command: Command | None = None) -> None:
    """Add the review commands to starter.py's sub-parsers (`command` is starter's helper)."""
    if command is None:

        def command(name: str, handler: Handler, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
            p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
            if json_flag:
                p.add_argument("--json", action="store_true", help="print machine-readable JSON")
            p.set_defaults(handler=handler)
            return p

    _hook_cleanup_command(sub)
    p = command("failed", cmd_failed, "list accounts whose cleanup failed, with the database's reason")
    p.add_argument("--cleanup", metavar="ID", help="only this cleanup (workflow ID); default: every cleanup")
    p.add_argument("--all", action="store_true", help="include failures already resolved by retry-failed")
    p.add_argument("--limit", type=int, default=100, help="rows to show (default 100)")

    p = command(
        "retry-failed",
        cmd_retry_failed,
        "retry the failed accounts after fixing the cause (same idempotency key: never cleaned twice)",
    )
    p.add_argument("--cleanup", metavar="ID", help="only this cleanup (workflow ID); default: every cleanup")
