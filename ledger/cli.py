"""The ledger commands of starter.py: `schedule ...`, `ledger reconcile|seed|status|review`.

`register(commands)` adds them to starter.py and routes `status ledger-reconciliation-YYYY-MM-DD`
here. Bad input raises InputError (exit 2). The operations are plain functions in
ledger.operations / ledger.schedule / ledger.seed.
"""

from __future__ import annotations

import argparse
import re
from datetime import date
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from core import addresses
from core.cli import CliContext, Commands, Handler, bounded_int, emit, finite_float, key_values, table
from core.config import Settings
from core.errors import InputError, validation_message
from core.temporal import connect
from ledger.models import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ID_PREFIX,
    DEFAULT_SHARDS,
    SCHEDULE_ID,
    ScheduledLedgerInput,
)
from ledger.operations import (
    DB_PART,
    ReconcileRequest,
    ledger_status,
    ledger_target,
    parse_business_date,
    review_rows,
    start_reconciliation,
)

if TYPE_CHECKING:
    from temporalio.client import Client

LEDGER_ID_PATTERN = re.escape(DEFAULT_ID_PREFIX) + r"-\d{4}-\d{2}-\d{2}(-recheck-\d{8}T\d{12}Z)?"


async def _schedule_client(settings: Settings) -> tuple[Client, str]:
    """The schedule's commands talk to Temporal only: DATABASE_URL is not asked for."""
    resolved = addresses.require(settings, database=False)
    return await connect(resolved), resolved.task_queue


async def cmd_schedule_create(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    at = ls.parse_time_of_day(args.at) if args.at is not None else ls.DEFAULT_AT
    zone = ls.parse_time_zone(args.time_zone) if args.time_zone is not None else ls.DEFAULT_TIME_ZONE
    options = _run_options(args, ScheduledLedgerInput, settings)  # bad input: exit 2 before connecting
    client, task_queue = await _schedule_client(settings)
    data = await ls.create_schedule(
        client, task_queue, at=at, options=options, paused=args.paused, schedule_id=args.schedule_id, time_zone=zone
    )
    emit(args, data)


async def cmd_schedule_update(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    at = ls.parse_time_of_day(args.at) if args.at is not None else None
    zone = ls.parse_time_zone(args.time_zone) if args.time_zone is not None else None
    if at is None and zone is None and args.reason is None:
        raise InputError("schedule update needs --at HH:MM, --time-zone ZONE or --reason TEXT")
    client, _ = await _schedule_client(settings)
    emit(args, await ls.update_schedule(client, args.schedule_id, at=at, time_zone=zone, note=args.reason))


async def cmd_schedule_list(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    rows = await ls.list_schedules(client)
    emit(args, rows, lambda r: table(r, ["schedule_id", "runs_at", "paused", "note", "next_runs"]))


async def cmd_schedule_describe(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    emit(args, await ls.describe_schedule(client, args.schedule_id))


async def cmd_schedule_pause(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    emit(args, await ls.pause_schedule(client, args.reason or "", args.schedule_id))


async def cmd_schedule_unpause(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    emit(args, await ls.unpause_schedule(client, args.reason or "", args.schedule_id))


async def cmd_schedule_trigger(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    emit(args, await ls.trigger_schedule(client, args.schedule_id))


async def cmd_schedule_backfill(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    first, last = parse_business_date(args.from_date), parse_business_date(args.to_date)
    ls.backfill_range(first, last)  # validate before connecting
    client, _ = await _schedule_client(settings)
    emit(args, await ls.backfill_schedule(client, first, last, args.schedule_id))


async def cmd_schedule_delete(args: argparse.Namespace, settings: Settings) -> None:
    from ledger import schedule as ls  # lazy: keeps `starter.py --help` fast to start

    client, _ = await _schedule_client(settings)
    emit(args, await ls.delete_schedule(client, args.schedule_id))


def _run_options(
    args: argparse.Namespace, model: type[ScheduledLedgerInput], settings: Settings
) -> ScheduledLedgerInput:
    try:
        return model(
            shards=args.shards,
            max_parallel=args.max_parallel,
            batch_size=args.batch_size,
            tolerance_cents=args.tolerance_cents,
            heartbeat_timeout_seconds=(
                settings.ledger.heartbeat_timeout_seconds if args.heartbeat_timeout is None else args.heartbeat_timeout
            ),
        )
    except ValidationError as err:
        raise InputError(validation_message(err)) from None


async def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> None:
    business_date = parse_business_date(args.date)
    request = ReconcileRequest(
        business_date=business_date,
        shards=args.shards,
        max_parallel=args.max_parallel,
        batch_size=args.batch_size,
        tolerance_cents=args.tolerance_cents,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        recheck=args.recheck,
    )
    async with CliContext(settings) as ctx:
        started = await start_reconciliation(ctx.client, ctx.pool, ctx.settings.task_queue, request, settings.ledger)
        data = started.model_dump(mode="json") | {"ui": ctx.settings.workflow_url(started.workflow_id)}
    emit(args, data, lambda d: _started_text(d, recheck=args.recheck))


def _started_text(d: dict[str, Any], *, recheck: bool) -> str:
    """`started`, `already running` (a run with this ID was running: this start joined it, even when
    it raced the one that started it) or `already exists` (a closed run, never repeated)."""
    how = "started" if d["started"] else "already running" if d.get("joined") else "already exists (not started again)"
    head = f"{how}{' (re-check)' if recheck else ''}: {d['workflow_id']}"
    if d.get("joined"):
        head += f" (run {d['run_id']})"
    lines = [head, f"business date {d['business_date']}, {d['payments']} payment(s) over {d['shards']} shard(s)"]
    return "\n".join(lines + ([d["ui"]] if d["ui"] else []))


async def cmd_ledger_seed(args: argparse.Namespace, settings: Settings) -> None:
    from ledger.seed import seed_ledger_day, seed_spec  # lazy: keeps `starter.py --help` fast to start

    spec = seed_spec(
        business_date=parse_business_date(args.date),
        payments=args.payments,
        shards=args.shards,
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


async def cmd_ledger_status(args: argparse.Namespace, settings: Settings) -> None:
    await _show_status(args, settings, ledger_target(args.target)[0])


async def cmd_ledger_review(args: argparse.Namespace, settings: Settings) -> None:
    business_date, _ = ledger_target(args.target)
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
        "(env: LEDGER_HEARTBEAT_TIMEOUT_SECONDS; default 7)",
    )


DATE_HELP = "the business date, YYYY-MM-DD (e.g. 2026-10-25)"
TARGET_HELP = "the business date (YYYY-MM-DD) or a ledger reconciliation's workflow ID"


def register(commands: Commands) -> None:
    """Add `schedule` and `ledger` to starter.py; route the ledger's workflow IDs of `status`."""
    commands.route_status(LEDGER_ID_PATTERN, cmd_status)
    _add_schedule(commands)
    ledger = commands.group(
        "ledger", "ledger reconciliation: reconcile a date now, seed a day, status of a date, review rows"
    )
    _add_reconcile(ledger)
    _add_ledger(ledger)


def _add_schedule(commands: Commands) -> None:
    """`schedule create|list|describe|update|pause|unpause|trigger|backfill|delete`."""
    schedule = commands.group("schedule", "the nightly ledger-reconciliation schedule (a Temporal Schedule)")

    def verb(name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
        p = schedule.add(name, handler, help)
        p.add_argument("--schedule-id", default=SCHEDULE_ID, help=f"the schedule (default {SCHEDULE_ID})")
        return p

    p = verb("create", cmd_schedule_create, "create the schedule (exit 2 if it exists already)")
    p.add_argument("--at", metavar="HH:MM", help="time of day in the schedule's zone (default 02:00)")
    p.add_argument("--time-zone", metavar="ZONE", help="the game's IANA time zone, e.g. Europe/Berlin (default UTC)")
    p.add_argument("--paused", action="store_true", help="create it paused")
    _run_flags(p, shards_default=DEFAULT_SHARDS)
    schedule.add("list", cmd_schedule_list, "every ledger schedule: when it runs, paused, note, next runs")
    verb("describe", cmd_schedule_describe, "the schedule: when it runs, paused or not and why, recent and next runs")
    p = verb("update", cmd_schedule_update, "change the time of day, the zone or the note in place")
    p.add_argument("--at", metavar="HH:MM", help="new time of day in the schedule's zone")
    p.add_argument("--time-zone", metavar="ZONE", help="new IANA time zone, e.g. Europe/Berlin")
    p.add_argument("--reason", help="why (the schedule's note, shown by describe)")
    p = verb("pause", cmd_schedule_pause, "stop starting runs until unpause")
    p.add_argument("--reason", help="why (the schedule's note, shown by describe)")
    p = verb("unpause", cmd_schedule_unpause, "start the nightly runs again")
    p.add_argument("--reason", help="why (the schedule's note, shown by describe)")
    verb("trigger", cmd_schedule_trigger, "run now: reconcile yesterday (in the schedule's zone) once, even if it ran")
    p = verb("backfill", cmd_schedule_backfill, "run the schedule for a range of past business dates")
    p.add_argument("--from", dest="from_date", required=True, metavar="DATE", help="first " + DATE_HELP)
    p.add_argument("--to", dest="to_date", required=True, metavar="DATE", help="last " + DATE_HELP)
    verb("delete", cmd_schedule_delete, "remove the schedule (its past runs stay in Temporal)")


def _add_reconcile(ledger: Commands) -> None:
    """`ledger reconcile`: one business date now (a manual run)."""
    p = ledger.add("reconcile", cmd_reconcile, "reconcile one business date now (manual run)")
    p.add_argument("--date", required=True, help=DATE_HELP)
    p.add_argument(
        "--recheck",
        action="store_true",
        help="re-check a reconciled date under its own workflow ID: judge what changed since (late "
        "provider rows, ledger updates) and record a new settlement revision if anything did",
    )
    _run_flags(p, shards_default=None)


def _add_ledger(ledger: Commands) -> None:
    """`ledger seed|status|review`: a day's data, a date's run and its rows sent to review."""
    p = ledger.add("seed", cmd_ledger_seed, "load a synthetic business day: payments, provider report, discrepancies")
    p.add_argument("--date", required=True, help=DATE_HELP)
    p.add_argument("--payments", type=bounded_int(1, 100_000_000), required=True, help="number of payments")
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS, help=f"shards (default {DEFAULT_SHARDS})")
    p.add_argument(
        "--refund-rate", type=finite_float(), default=0.01, help="share of refunds the ledger missed (default 0.01)"
    )
    p.add_argument(
        "--small-mismatch-rate",
        type=finite_float(),
        default=0.01,
        help="share of amounts off within tolerance (default 0.01)",
    )
    p.add_argument(
        "--large-mismatch-rate",
        type=finite_float(),
        default=0.002,
        help="share of amounts off beyond it (default 0.002)",
    )
    p.add_argument(
        "--unsettled-rate", type=finite_float(), default=0.005, help="share of payments never settled (default 0.005)"
    )
    p.add_argument(
        "--unknown-rate",
        type=finite_float(),
        default=0.002,
        help="share of report rows for unknown payments (default 0.002)",
    )
    p.add_argument(
        "--duplicate-rate", type=finite_float(), default=0.005, help="share of duplicate report rows (default 0.005)"
    )
    p.add_argument("--tolerance-cents", type=int, default=50, help="the tolerance the mismatches respect (default 50)")
    p = ledger.add("status", cmd_ledger_status, "a date's run: phase, shards, settlement and its revisions")
    p.add_argument("target", help=TARGET_HELP)
    p = ledger.add("review", cmd_ledger_review, "a date's rows sent to review (not corrected by rule)")
    p.add_argument("target", help=TARGET_HELP)
    p.add_argument("--limit", type=bounded_int(1, 100_000), default=50, help="rows to show (default 50)")
