"""The ledger commands of starter.py: `schedule ...`, `reconcile --date D`, `ledger seed|status|review`.

`register(commands)` adds them to starter.py and routes `status ledger-reconciliation-YYYY-MM-DD`
here. Bad input raises InputError (exit 2). The operations are plain functions in
ledger.operations / ledger.schedule / ledger.seed.
"""

from __future__ import annotations

import argparse
import re
from datetime import date
from typing import Any

from pydantic import ValidationError

from core import embedded
from core.cli import CliContext, Commands, bounded_int, emit, finite_float, key_values, table
from core.config import Settings
from core.errors import InputError, validation_message
from core.temporal import connect
from ledger.models import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ID_PREFIX,
    DEFAULT_SHARDS,
    SCHEDULE_ID,
    DeletedSchedule,
    ScheduleDescription,
    ScheduledLedgerInput,
    heartbeat_timeout_from_env,
)
from ledger.operations import (
    DB_PART,
    ledger_status,
    ledger_target,
    parse_business_date,
    review_rows,
    start_reconciliation,
)

LEDGER_ID_PATTERN = re.escape(DEFAULT_ID_PREFIX) + r"-\d{4}-\d{2}-\d{2}(-recheck-\d{8}T\d{12}Z)?"


def _business_date(text: str) -> date:
    return parse_business_date(text)


async def cmd_schedule(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    schedule_id = args.schedule_id
    first = last = None
    if args.action == "backfill":
        if not (args.from_date and args.to_date):
            raise InputError("schedule backfill needs --from D1 --to D2 (business dates, YYYY-MM-DD)")
        first, last = _business_date(args.from_date), _business_date(args.to_date)
        ls.backfill_range(first, last)  # validate before connecting
    at = ls.parse_time_of_day(args.at) if args.at is not None else None
    zone = ls.parse_time_zone(args.time_zone) if args.time_zone is not None else None
    if args.action == "update" and at is None and zone is None and args.note is None:
        raise InputError("schedule update needs --at HH:MM, --time-zone ZONE or --note TEXT")
    options = _run_options(args, ScheduledLedgerInput) if args.action == "create" else None
    settings_resolved = embedded.resolve(settings)
    client = await connect(settings_resolved)
    data: ScheduleDescription | DeletedSchedule
    if args.action == "create":
        data = await ls.create_schedule(
            client,
            settings_resolved.task_queue,
            at=at or ls.DEFAULT_AT,
            options=options,
            paused=args.paused,
            schedule_id=schedule_id,
            time_zone=zone or ls.DEFAULT_TIME_ZONE,
        )
    elif args.action == "update":
        data = await ls.update_schedule(client, schedule_id, at=at, time_zone=zone, note=args.note)
    elif args.action == "list":
        rows = [r.model_dump() for r in await ls.list_schedules(client)]
        emit(args, rows, lambda r: table(r, ["schedule_id", "runs_at", "paused", "note", "next_runs"]))
        return
    elif args.action == "describe":
        data = await ls.describe_schedule(client, schedule_id)
    elif args.action == "pause":
        data = await ls.pause_schedule(client, args.note or "", schedule_id)
    elif args.action == "unpause":
        data = await ls.unpause_schedule(client, args.note or "", schedule_id)
    elif args.action == "trigger":
        data = await ls.trigger_schedule(client, schedule_id)
    elif args.action == "backfill":
        assert first is not None and last is not None
        data = await ls.backfill_schedule(client, first, last, schedule_id)
    else:
        data = await ls.delete_schedule(client, schedule_id)
    emit(args, data.given())


def _run_options(args: argparse.Namespace, model: type[ScheduledLedgerInput]) -> ScheduledLedgerInput:
    try:
        return model(
            shards=args.shards,
            max_parallel=args.max_parallel,
            batch_size=args.batch_size,
            tolerance_cents=args.tolerance_cents,
            heartbeat_timeout_seconds=args.heartbeat_timeout or heartbeat_timeout_from_env(),
        )
    except ValidationError as err:
        raise InputError(validation_message(err)) from None
    except ValueError as err:  # LEDGER_HEARTBEAT_TIMEOUT_SECONDS
        raise InputError(str(err)) from None


async def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> None:
    business_date = _business_date(args.date)
    heartbeat_timeout = args.heartbeat_timeout
    if heartbeat_timeout is None:  # checked before connecting, like every other input
        try:
            heartbeat_timeout = heartbeat_timeout_from_env()
        except ValueError as err:
            raise InputError(str(err)) from None
    async with CliContext(settings) as ctx:
        started = await start_reconciliation(
            ctx.client,
            ctx.pool,
            ctx.settings.task_queue,
            business_date,
            shards=args.shards,
            max_parallel=args.max_parallel,
            batch_size=args.batch_size,
            tolerance_cents=args.tolerance_cents,
            heartbeat_timeout_seconds=heartbeat_timeout,
            recheck=args.recheck,
        )
        data = started.model_dump(mode="json") | {"ui": ctx.settings.workflow_url(started.workflow_id)}
    emit(
        args,
        data,
        lambda d: (
            f"{'started' if d['started'] else 'already exists (not started again)'}"
            f"{' (re-check)' if args.recheck else ''}: {d['workflow_id']}\n"
            f"business date {d['business_date']}, {d['payments']} payment(s) over {d['shards']} shard(s)"
            + (f"\n{d['ui']}" if d["ui"] else "")
        ),
    )


async def cmd_ledger(args: argparse.Namespace, settings: Settings) -> None:
    from ledger.seed import seed_ledger_day, seed_spec  # lazy: keeps `starter.py --help` fast to start

    if args.action == "seed":
        if not args.date or args.payments is None:
            raise InputError("ledger seed needs --date YYYY-MM-DD and --payments N")
        spec = seed_spec(
            business_date=_business_date(args.date),
            payments=args.payments,
            shards=args.shards or DEFAULT_SHARDS,
            refund_rate=args.refund_rate,
            small_mismatch_rate=args.small_mismatch_rate,
            large_mismatch_rate=args.large_mismatch_rate,
            unsettled_rate=args.unsettled_rate,
            unknown_rate=args.unknown_rate,
            duplicate_rate=args.duplicate_rate,
            tolerance_cents=args.tolerance_cents,
        )
        async with CliContext(settings) as ctx:
            result = await seed_ledger_day(ctx.pool, spec)
        data = result.model_dump(mode="json") | {
            "expected_corrections": result.expected_corrections,
            "expected_review_rows": result.expected_review,
        }
        if not result.created:
            data["note"] = "this business date was already loaded; nothing was added"
        emit(args, data)
        return
    if not args.target:
        raise InputError(f"ledger {args.action} needs a business date, e.g. 2026-10-25")
    business_date, _ = ledger_target(args.target)
    if args.action == "status":
        await _show_status(args, settings, business_date)
        return
    async with CliContext(settings) as ctx:
        rows = [r.model_dump() for r in await review_rows(ctx.pool, business_date, args.limit)]
    emit(args, rows, lambda r: table(r, ["review_key", "kind", "reason"]))


async def _show_status(args: argparse.Namespace, settings: Settings, business_date: date) -> None:
    async with CliContext(settings, database="optional") as ctx:
        data = (await ledger_status(ctx.client, ctx.optional_pool, business_date)).given()
        if ctx.database_missing and "database" in data:
            data["database"] = f"{ctx.database_missing}; {DB_PART}"
        url = ctx.settings.workflow_url(data["workflow_id"])
        if url is not None:  # only where a UI is known to be
            data["ui"] = url
    emit(args, data, _status_text)


def _status_text(data: dict[str, Any]) -> str:
    """Key/value lines, then one line per settlement revision (what changed and why)."""
    revisions = data.get("revisions") or []
    text = key_values({k: v for k, v in data.items() if k not in ("revisions", "settlement")})
    if not revisions:
        return text
    columns = ["revision", "discrepancies_found", "corrected", "sent_to_review", "new_corrections"]
    columns += ["new_review_rows", "settled_at", "reason"]
    return f"{text}\n\nsettlement revisions\n{table(revisions, columns)}"


async def cmd_status(args: argparse.Namespace, settings: Settings) -> None:
    """`starter.py status ledger-reconciliation-YYYY-MM-DD`."""
    await _show_status(args, settings, ledger_target(args.workflow_id)[0])


def _run_flags(p: argparse.ArgumentParser, *, shards_default: int | None) -> None:
    p.add_argument(
        "--shards",
        type=int,
        default=shards_default,
        help="shards of the date (default: " + ("16" if shards_default else "as loaded") + ")",
    )
    p.add_argument("--max-parallel", type=int, default=8, help="shards reconciled at once (default 8)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"payments per statement (default {DEFAULT_BATCH_SIZE})",
    )
    p.add_argument(
        "--tolerance-cents",
        type=int,
        default=50,
        help="amount mismatch corrected by rule up to this (default 50)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=finite_float(),
        metavar="SECONDS",
        help="a shard whose worker died resumes elsewhere after this long without a heartbeat "
        "(default: $LEDGER_HEARTBEAT_TIMEOUT_SECONDS or 7)",
    )


def register(commands: Commands) -> None:
    """Add `schedule`, `reconcile` and `ledger` to starter.py; route the ledger's workflow IDs of `status`."""
    command = commands.add
    commands.route_status(LEDGER_ID_PATTERN, cmd_status)
    p = command("schedule", cmd_schedule, "the nightly ledger-reconciliation schedule (Temporal Schedule)")
    p.add_argument(
        "action",
        choices=["create", "list", "describe", "update", "pause", "unpause", "trigger", "backfill", "delete"],
    )
    p.add_argument("--schedule-id", default=SCHEDULE_ID, help=f"default {SCHEDULE_ID}")
    p.add_argument("--at", help="create/update: time of day in the schedule's zone (default 02:00)")
    p.add_argument("--time-zone", help="create/update: the game's IANA time zone, e.g. Europe/Berlin (default UTC)")
    p.add_argument("--paused", action="store_true", help="create: start paused")
    p.add_argument("--note", help="pause/unpause/update: why (shown by describe)")
    p.add_argument("--from", dest="from_date", help="backfill: first business date (YYYY-MM-DD)")
    p.add_argument("--to", dest="to_date", help="backfill: last business date (YYYY-MM-DD)")
    _run_flags(p, shards_default=DEFAULT_SHARDS)

    p = command("reconcile", cmd_reconcile, "reconcile one business date now (manual run)")
    p.add_argument("--date", required=True, help="business date, e.g. 2026-10-25")
    p.add_argument(
        "--recheck",
        action="store_true",
        help="re-check a reconciled date under its own workflow ID: judge what changed since (late "
        "provider rows, ledger updates) and record a new settlement revision if anything did",
    )
    _run_flags(p, shards_default=None)

    p = command("ledger", cmd_ledger, "ledger data and runs: seed a day, status of a date, review rows")
    p.add_argument("action", choices=["seed", "status", "review"])
    p.add_argument("target", nargs="?", help="status/review: business date or ledger workflow ID")
    p.add_argument("--date", help="seed: business date")
    p.add_argument("--payments", type=bounded_int(1, 100_000_000), help="seed: number of payments")
    p.add_argument("--shards", type=int, default=None, help=f"seed: shards (default {DEFAULT_SHARDS})")
    p.add_argument("--refund-rate", type=finite_float(), default=0.01, help="seed: refunds the ledger missed")
    p.add_argument(
        "--small-mismatch-rate", type=finite_float(), default=0.01, help="seed: amounts off within tolerance"
    )
    p.add_argument("--large-mismatch-rate", type=finite_float(), default=0.002, help="seed: amounts off beyond it")
    p.add_argument("--unsettled-rate", type=finite_float(), default=0.005, help="seed: payments never settled")
    p.add_argument("--unknown-rate", type=finite_float(), default=0.002, help="seed: report rows for unknown payments")
    p.add_argument("--duplicate-rate", type=finite_float(), default=0.005, help="seed: duplicate report rows")
    p.add_argument(
        "--tolerance-cents",
        type=int,
        default=50,
        help="seed: the tolerance the mismatches respect",
    )
    p.add_argument("--limit", type=bounded_int(1, 100_000), default=50, help="review: rows to show")
