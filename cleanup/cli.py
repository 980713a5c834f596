"""The cleanup commands of starter.py: `cleanup start|status|list|failed|retry|prune`, `account
renew|hold|release|history|dismiss`, `planner status|pause|resume|start`, `targets check|rotate-key`,
and `status` of a cleanup.

Bad input raises InputError (exit 2); a renewal that came too late exits 3. The operations are
plain functions in cleanup.operations, which game backends may call directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from temporalio.client import Client, WorkflowQueryFailedError
from temporalio.service import RPCError

from cleanup.inputs import StartCleanup, parse_failed_tolerance
from cleanup.models import CLEANUP_ID_PATTERN, STATUS_QUERY, CleanupResult, CleanupStatus, planner_workflow_id
from cleanup.operations import (
    cleanup_status,
    dismiss_account,
    hold_account,
    list_cleanups,
    release_account,
    renew,
    start_cleanup,
)
from core.cli import (
    EXIT_TOO_LATE,
    CliContext,
    Commands,
    Progress,
    count_argument,
    database_pool,
    emit,
    finite_float,
    key_values,
    table,
)
from core.config import Settings
from core.errors import InputError, parse_instant
from core.temporal import STATUS_QUERY_TIMEOUT


async def cmd_cleanup(args: argparse.Namespace, settings: Settings) -> None:
    if (args.window_from or args.window_to) and not args.dry_run:
        raise InputError("--from and --to choose the deadlines of a dry run: add --dry-run")
    if args.window_to and not args.window_from:
        raise InputError("--to ends a window that --from starts: add --from")
    if args.dry_run:
        await cmd_cleanup_dry_run(args, settings)
        return
    parse_failed_tolerance(args.max_failed)  # bad input: exit 2 before anything starts
    deadline = parse_instant(args.deadline) if args.deadline else None
    async with CliContext(settings) as ctx:
        request = StartCleanup(
            deadline=deadline,
            account_id=args.account,
            partitions=args.partitions,
            max_parallel_partitions=args.max_parallel,
            batch_size=args.batch_size,
            note=args.note,
            allow_empty=args.allow_empty,
            max_failed=args.max_failed,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
            heartbeat_interval_seconds=args.heartbeat_interval,
        )
        defaults = ctx.settings.cleanup.defaults
        started = await start_cleanup(ctx.client, ctx.pool, ctx.settings.task_queue, request, defaults)
        data = started.model_dump(mode="json") | {"ui": ctx.settings.workflow_url(started.workflow_id)}
        if args.wait:
            data["result"] = await wait_for_cleanup(ctx.client, started.workflow_id)
    emit(args, data, lambda d: _started_text(d, wait=args.wait))


def _started_text(d: dict[str, Any], *, wait: bool) -> str:
    deadline = f"deadline {d['deadline']}"
    if d.get("deadline_until"):  # the planner's cohort of a range of deadlines
        deadline = f"deadlines from {d['deadline']} to before {d['deadline_until']}"
    if d["started"]:
        lines = [f"started: {d['workflow_id']}", f"{deadline}, {d['accounts_in_scope']} account(s) in scope"]
    elif d.get("joined"):  # running already: this start joined it (even when it raced the one that started it)
        lines = [f"already running: {d['workflow_id']} (run {d['run_id']})", deadline]
    else:
        lines = [f"already exists (not started again): {d['workflow_id']}", deadline]
        if d.get("outcome"):
            lines.append(f"finished: outcome {d['outcome']}")
        elif d.get("temporal_status"):
            lines.append(f"run {d['temporal_status'].lower()}")
    if d.get("planner"):
        lines.append(f"planner: {d['planner']}")
    if d.get("ui"):
        lines.append(d["ui"])
    if wait:
        lines.append(_result_text(d["result"]))
    return "\n".join(lines)


def _result_text(result: dict[str, Any]) -> str:
    """What this cleanup did, from its settlement (its own claims, counted in the database): not the
    size of the cohort at its start, which renewals and other cleanups may have taken from."""
    s = result.get("settlement")
    if not s:
        return f"outcome: {result['outcome']}"
    return (
        f"outcome: {result['outcome']}; this cleanup claimed {s['claimed']} account(s): cleaned {s['cleaned']}, "
        f"skipped renewed {s['skipped_renewed']}, skipped stale {s['skipped_stale']}, "
        f"already applied {s['already_applied']}, failed {s['failed']}"
    )


async def wait_for_cleanup(client: Client, workflow_id: str) -> dict[str, Any]:
    """Wait for the run with a progress bar: the sleep, then partitions reported k/P."""
    handle = client.get_workflow_handle(workflow_id, result_type=CleanupResult)
    result_task = asyncio.ensure_future(handle.result())
    bar: Progress | None = None
    while not result_task.done():
        await asyncio.wait([result_task], timeout=0.5)
        if result_task.done():
            break
        with contextlib.suppress(RPCError, WorkflowQueryFailedError):
            # Bounded: with no worker up, the wait goes on to its result, not 30 s per look.
            bound = timedelta(seconds=STATUS_QUERY_TIMEOUT)
            live = await handle.query(STATUS_QUERY, result_type=CleanupStatus, rpc_timeout=bound)
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


async def cmd_renew(args: argparse.Namespace, settings: Settings) -> None:
    until = parse_instant(args.until) if args.until else None
    async with CliContext(settings) as ctx:
        outcome = await renew(
            ctx.client, ctx.pool, ctx.settings.task_queue, args.account_id, until, allow_earlier=args.allow_earlier
        )

    def human(d: dict[str, Any]) -> str:
        if d["in_time"]:
            text = f"renewed in time: {d['account_id']} is now at cleanup version {d['version_after']}"
            text += f"\ndeadline: {d['old_deadline']} -> {d['new_deadline'] or 'none (renewed for good)'}"
            if d["signalled"]:
                text += f"\nsignalled: {', '.join(d['signalled'])}"
            if d["restarted_cleanup"]:
                text += f"\nnew cleanup for the new deadline: {d['restarted_cleanup']}"
            for error in d["signal_errors"]:
                text += f"\nsignal refused (the renewal stands; the cleanup's claim skips it): {error}"
            return text
        why = "its deadline had passed" if d["status_seen"] == "active" else f"claimed by {d['claimed_by']}"
        return (
            f"too late: {d['account_id']} was already {d['status_seen']} ({why}); "
            "the renewal is recorded but the cleanup stands"
        )

    emit(args, outcome.model_dump(mode="json"), human)
    if not outcome.in_time:
        sys.exit(EXIT_TOO_LATE)


async def cmd_hold(args: argparse.Namespace, settings: Settings) -> None:
    async with database_pool(settings, migrate=True) as pool:
        held = await hold_account(pool, args.account_id, args.reason)
    emit(args, held.model_dump(), lambda d: f"{d['account_id']}: {d['result']}")
    if held.result == "too_late":
        sys.exit(EXIT_TOO_LATE)


async def cmd_account(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.history import account_history

    async with database_pool(settings, migrate=True) as pool:
        history = await account_history(pool, args.account_id)
    emit(args, history.model_dump(mode="json"), _history_text)


def _history_text(d: dict[str, Any]) -> str:
    lines = [f"{d['account_id']}: {d['status']}, deadline {d['renewal_deadline']}, version {d['cleanup_version']}"]
    lines += [f"  {e['recorded_at']} {e['kind']} (deadline {e['deadline']})" for e in d["events"]]
    lines += [f"  {r['judged_at']} renewal {r['outcome']} -> {r['new_deadline'] or 'for good'}" for r in d["renewals"]]
    for c in d["cleaned"]:
        rows = ", ".join(f"{_target_name(t)} {t['action']} {t['rows']}" for t in c["targets"] or [])
        reminder = c["reminder"]["status"] if c["reminder"] else "none"
        lines.append(
            f"  {c['applied_at']} cleaned v{c['cleanup_version']} by {c['cleanup_id']}: {rows}; reminder {reminder}"
        )
        lines += _receipt_extras(c)
    return "\n".join(lines)


def _receipt_extras(c: dict[str, Any]) -> list[str]:
    """A cleaned version's target set (and those it replaced) and its batch's follow-up counts."""
    lines = []
    if c.get("target_set"):
        replaced = c.get("replaced_target_sets") or []
        instead = f" (replacing {', '.join(replaced)}: retry-failed --with-current-targets)" if replaced else ""
        lines.append(f"    target set {c['target_set']}{instead}")
    for f in c.get("follow_ups") or []:
        lines.append(
            f"    follow-up {f['name']} ({f['phase']}): {f['rows']} row(s) for its batch of {f['batch_accounts']}"
        )
    return lines


async def cmd_dismiss(args: argparse.Namespace, settings: Settings) -> None:
    async with database_pool(settings, migrate=True) as pool:
        dismissed = await dismiss_account(pool, args.account_id, args.reason)
    emit(args, dismissed.model_dump(), lambda d: f"{d['account_id']}: {d['result']}")
    if dismissed.result == "not_dismissable":
        sys.exit(EXIT_TOO_LATE)


def _target_name(t: dict[str, Any]) -> str:
    """A receipt's target: its table and, when recorded, its match column (two targets of one table)."""
    return f"{t['target']} ({t['match_column']})" if t.get("match_column") else t["target"]


async def cmd_release(args: argparse.Namespace, settings: Settings) -> None:
    async with database_pool(settings, migrate=True) as pool:
        released = await release_account(pool, args.account_id)
    emit(args, released.model_dump(), lambda d: f"{d['account_id']}: {d['result']}")


async def cmd_status(args: argparse.Namespace, settings: Settings) -> None:
    """Answers from Temporal alone while the database is down, and says what is missing."""
    async with CliContext(settings, database="optional") as ctx:
        data = (await cleanup_status(ctx.client, ctx.optional_pool, args.workflow_id)).given()
        if ctx.database_missing and "database" in data:
            data["database"] = f"{ctx.database_missing}; {DB_PART}"
        _add_ui(data, ctx.settings, args.workflow_id)
    emit(args, data, key_values)


DB_PART = "partitions reported, settlement and failed accounts are not shown"


def _add_ui(data: dict[str, Any], settings: Settings, workflow_id: str) -> None:
    """A UI link only where a UI is known to be (see Settings.ui_url)."""
    url = settings.workflow_url(workflow_id)
    if url is not None:
        data["ui"] = url


async def cmd_list(args: argparse.Namespace, settings: Settings) -> None:
    """Temporal only (visibility): works whether or not the database is up."""
    async with CliContext(settings, database="unused") as ctx:
        rows = [r.model_dump() for r in await list_cleanups(ctx.client, limit=args.limit)]
    emit(args, rows, lambda r: table(r, LIST_COLUMNS))


LIST_COLUMNS = ["workflow_id", "status", "phase", "outcome", "deadline", "account_id", "partitions_done"]


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


async def cmd_failed(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.review import list_failed  # lazy: keeps `starter.py --help` and `account renew` fast to start

    async with database_pool(settings, migrate=True) as pool:
        rows = [
            r.model_dump() for r in await list_failed(pool, args.cleanup, include_resolved=args.all, limit=args.limit)
        ]
    emit(args, rows, lambda r: table(r, FAILED_COLUMNS))


async def cmd_prune(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.retention import prune  # lazy: keeps `starter.py --help` and `account renew` fast to start

    days = args.retention_days or settings.cleanup.retention_days
    async with database_pool(settings, migrate=True) as pool:
        data = (await prune(pool, days, dry_run=args.dry_run)).model_dump(mode="json")
    data["retention_days"] = days
    emit(args, data, _pruned_text)


def _pruned_text(d: dict[str, Any]) -> str:
    verb = "would prune" if d["dry_run"] else "pruned"
    if d["busy"]:
        return "another worker is pruning now: nothing done (run it again later)"
    rows = ("claims", "applied", "receipts", "events", "renewals", "failures", "outbox", "cleanups", "sweeps")
    lines = {"cutoff": f"{d['cutoff']} ({d['retention_days']} days before the database's clock)"}
    lines |= {f"{verb} {name}": str(d[name]) for name in rows}
    return key_values(lines)


async def cmd_retry_failed(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.review import retry_failed  # lazy: keeps `starter.py --help` and `account renew` fast to start
    from cleanup.targets import load_targets

    targets = load_targets(settings.cleanup.targets_file)
    async with database_pool(settings, migrate=True) as pool:
        retried = await retry_failed(
            pool, targets, args.cleanup, adopt_targets=args.with_current_targets, settings=settings.cleanup
        )
        data = retried.model_dump()

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
    from cleanup.review import preview_cleanup  # lazy: keeps `starter.py --help` and `account renew` fast to start
    from cleanup.targets import load_targets

    deadline = parse_instant(args.deadline) if args.deadline else None
    window = None
    if args.window_from:
        window = (parse_instant(args.window_from), parse_instant(args.window_to) if args.window_to else None)
    targets = load_targets(settings.cleanup.targets_file)
    async with database_pool(settings, migrate=False) as pool:
        reminders = settings.cleanup.reminders
        preview = await preview_cleanup(
            pool, targets, deadline=deadline, account_id=args.account, window=window, reminders=reminders
        )
    emit(args, preview.model_dump(), _dry_run_text)


def _dry_run_text(d: dict[str, Any]) -> str:
    if d["scope"] == "window":
        to = d["window_to"].isoformat() if d["window_to"] else "no end"
        scope = f"window, deadlines from {d['window_from'].isoformat()} to {to}"
    else:
        scope = f"{d['scope']}, deadline {d['deadline'].isoformat()}"
    lines = [
        f"dry run ({scope}): nothing was started or changed",
        f"accounts in scope: {d['accounts_in_scope']}",
        f"already renewed: {d['already_renewed']}",
        f"reminders to write: {d['reminders']}",
        table(d["targets"], ["table", "match_column", "action", "archive_table", "rows"]),
    ]
    lines += _follow_ups_text(d["follow_ups"], "planned, not run by a dry run; rows counted in each receipt")
    return "\n".join(lines)


def _follow_ups_text(follow_ups: list[dict[str, Any]], note: str) -> list[str]:
    """The declared follow-up statements, each with its phase and the tables it touches."""
    if not follow_ups:
        return []
    lines = [f"follow-up statements, in each batch's transaction ({note}):"]
    for f in follow_ups:
        lines.append(f"  {f['name']} ({f['phase']} the targets; tables {', '.join(f['tables']) or '-'})")
        lines.append(f"    {' '.join(f['statement'].split())}")
    return lines


async def cmd_targets_check(args: argparse.Namespace, settings: Settings) -> None:
    """The file is read (and a mistake in it reported) before any connection is made."""
    from cleanup.operations import check_targets
    from cleanup.targets import load_targets, targets_path

    file = targets_path(args.file or settings.cleanup.targets_file)
    load_targets(file)  # a TOML or schema mistake: exit 2 at once, naming file and line
    async with database_pool(settings, migrate=True) as pool:
        report = await check_targets(pool, file, settings.cleanup)
    emit(args, report, _targets_text)


async def cmd_targets_rotate_key(args: argparse.Namespace, settings: Settings) -> None:
    """The key goes to the database over COPY, never as a statement parameter (docs/targets.md)."""
    from cleanup.anonymize_key import fingerprint, store_key
    from cleanup.targets import anonymize_key_pads

    secret = settings.cleanup.anonymize_key
    key = secret.get_secret_value() if secret else ""
    try:
        anonymize_key_pads(key)
    except ValueError as err:
        raise InputError(str(err)) from None
    async with database_pool(settings, migrate=True) as pool, pool.acquire() as conn:
        outcome = await store_key(conn, key, rotate=True)
    emit(
        args,
        {"fingerprint": fingerprint(key), "result": outcome},
        lambda d: f"anonymize key {d['fingerprint']}: {d['result']}",
    )


def _targets_text(d: dict[str, Any]) -> str:
    lines = [f"{d['file']}: {len(d['targets'])} target(s), fingerprint {d['fingerprint']}, checked on this database"]
    lines.append("what a cleanup does per account, in this order (one transaction per batch):")
    rows = [
        r | {"index": r["index"] or "NONE (reads the table)", "covers_cascades": ", ".join(r["covers_cascades"])}
        for r in d["targets"]
    ]
    lines.append(table(rows, ["table", "action", "match_column", "index", "archive_table", "covers_cascades"]))
    for r in d["targets"]:
        if r["action"] == "anonymize":
            changed = ", ".join(f"{c} {what}" for c, what in r["changed_columns"].items())
            lines.append(f"{r['table']} (by {r['match_column']}): changes {changed}")
            lines.append(f"  leaves unchanged: {', '.join(r['unchanged_columns']) or '(none)'}")
    lines += _follow_ups_text(d.get("follow_ups", []), "$1: the batch's account keys")
    for m in d["missing_indexes"]:
        lines.append(
            f"WARNING: target {m['target']}: no index on {m['table']}.{m['match_column']} "
            f"(~{m['row_estimate']} rows): every batch reads the table whole; fix: {m['fix']}"
        )
    return "\n".join(lines)


def _planner_human_status(d: dict[str, Any]) -> str:
    head = {
        "planner": f"{d['workflow_id']} ({d['temporal_status'] or 'not started'}, phase {d['phase']})",
        "paused": f"{d['paused']}" + (f" ({d['pause_reason']})" if d.get("pause_reason") else ""),
    }
    if d.get("pause_effect") and d.get("paused"):
        head["pause effect"] = d["pause_effect"]
    if d.get("database_clock_behind"):
        head["database clock"] = d["database_clock_behind"]
    if "database" in d:  # the database is down: what Temporal knows, and what is missing
        return key_values(head | {"database": d["database"]})
    lateness = d["lateness_seconds"]

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    lines = head | {
        "next deadlines": ", ".join(f"{r['deadline'].isoformat()} x{r['accounts']}" for r in d["next_deadlines"])
        or "(none)",
        "due in the next hour": d["due_next_hour"],
        "overdue now": d["overdue"],
        "held past their deadline": f"{d['held_overdue']} (legal hold; cleaned once released)",
        "failed, pending review": f"{d['failed_pending_review']} ({d['failed_by_schema_error']} by a schema or "
        "privilege error: fix it, then `cleanup retry`)",
        "overdue swept": f"{d['overdue_swept']} account(s) in {d['overdue_sweeps']} sweep(s)",
        "stranded claims recovered": f"{d['stranded_claims_recovered']} in {d['stranded_recoveries']} recovery(ies)",
        "lateness (last hour)": f"{lateness['cleanups']} cleanups, p50 {secs(lateness['p50'])}, "
        f"p99 {secs(lateness['p99'])}, max {secs(lateness['max'])}",
    }
    if d.get("targets_missing_index"):
        lines["targets missing an index"] = "; ".join(d["targets_missing_index"])
    if budget := d.get("budget"):
        lines["load budget"] = f"{budget['in_flight']} batches in flight; {budget['doing']} ({budget['limited_by']})"
        if (deadline := budget.get("deadline")) and deadline.get("binding"):
            lines["load budget objective"] = _binding(deadline)
    return key_values(lines)


async def cmd_planner_status(args: argparse.Namespace, settings: Settings) -> None:
    """Answers from Temporal while the database is down; the other planner verbs need it."""
    from cleanup.planner import PLANNER_DB_PART, planner_status  # lazy: keeps `starter.py --help` fast

    async with CliContext(settings, database="optional") as ctx:
        data = (
            await planner_status(ctx.client, ctx.optional_pool, ctx.settings.task_queue, ctx.settings.planner)
        ).given()
        if ctx.database_missing and "database" in data:
            data["database"] = f"{ctx.database_missing}; {PLANNER_DB_PART}"
        _add_ui(data, ctx.settings, data["workflow_id"])
    emit(args, data, _planner_human_status)


async def cmd_planner_start(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.planner import ensure_planner  # lazy: keeps `starter.py --help` and `account renew` fast to start

    async with CliContext(settings) as ctx:
        s = ctx.settings
        workflow_id, started = await ensure_planner(ctx.client, s.task_queue, s.planner, ctx.pool, s.cleanup.defaults)
        data = {"workflow_id": workflow_id, "started": started}
        _add_ui(data, ctx.settings, workflow_id)
    emit(args, data)


async def cmd_planner_pause(args: argparse.Namespace, settings: Settings) -> None:
    await _signal_planner(args, settings, "pause", args.reason, args.hold_scheduled)


async def cmd_planner_resume(args: argparse.Namespace, settings: Settings) -> None:
    await _signal_planner(args, settings, "resume", "", False)


async def _signal_planner(
    args: argparse.Namespace, settings: Settings, action: Literal["pause", "resume"], reason: str, hold: bool
) -> None:
    from cleanup.planner import signal_planner  # lazy: keeps `starter.py --help` and `account renew` fast to start

    async with CliContext(settings) as ctx:
        queue = ctx.settings.task_queue
        await signal_planner(ctx.client, queue, action, reason, pool=ctx.pool, hold_scheduled=hold)
        data = {"workflow_id": planner_workflow_id(queue), "signalled": action}
        _add_ui(data, ctx.settings, data["workflow_id"])
    emit(args, data)


ACCOUNT_HELP = "the account's ID, e.g. acct_123"
CLEANUP_FILTER_HELP = "only this cleanup (workflow ID); default: every cleanup"


def register(commands: Commands) -> None:
    """Add the cleanup commands to starter.py; route the cleanup workflow IDs of `status`."""
    commands.route_status(CLEANUP_ID_PATTERN, cmd_status)
    cleanup = commands.group(
        "cleanup",
        "cleanups: start one (the default verb: `cleanup --deadline ...` is `cleanup start ...`), show one,"
        " list them, review and retry the accounts that failed, prune the bookkeeping",
        default="start",
    )
    _add_start(cleanup)
    p = cleanup.add("status", cmd_status, "show one cleanup by workflow ID: phase, progress, outcome")
    p.add_argument("workflow_id", help="the cleanup's workflow ID (as `cleanup list` shows it)")
    _add_review_verbs(cleanup)
    _add_account_verbs(commands.group("account", "one account: renew, hold, release, its history, dismiss"))
    _add_planner(commands)
    _add_targets(commands)


def _add_targets(commands: Commands) -> None:
    """`targets check`: the declared cleanup targets, checked as a worker checks them at start-up."""
    targets = commands.group(
        "targets", "the cleanup's targets file (CLEANUP_TARGETS_FILE): check it; rotate the anonymize key"
    )
    p = targets.add(
        "check",
        cmd_targets_check,
        "check the targets file on this database as a worker does at start-up (exit 2 with the fix), "
        "and show what a cleanup does per account",
    )
    p.add_argument(
        "--file",
        type=Path,
        metavar="PATH",
        help="the targets file (env: CLEANUP_TARGETS_FILE; default the built-in cleanup/targets.toml)",
    )
    targets.add(
        "rotate-key",
        cmd_targets_rotate_key,
        "store CLEANUP_ANONYMIZE_KEY as the database's anonymize key, replacing the one stored (workers stopped)",
    )


def _add_start(cleanup: Commands) -> None:
    """`cleanup start`: the cleanup of a cohort or of one account (one flag per start_cleanup option)."""
    p = cleanup.add("start", cmd_cleanup, "start the cleanup of a cohort (--deadline) or one account (--account)")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--deadline", help="renewal deadline of the cohort, e.g. 2026-11-01T09:00:00Z")
    scope.add_argument("--account", help="one account ID, e.g. acct_123 (its deadline comes from the database)")
    scope.add_argument(
        "--from",
        dest="window_from",
        metavar="INSTANT",
        help="a dry run (--dry-run) of every deadline from this instant (included), e.g. 2026-11-01T09:00:00Z",
    )
    p.add_argument(
        "--to",
        dest="window_to",
        metavar="INSTANT",
        help="the end of the --from window: deadlines before this instant (excluded; default: no end)",
    )
    p.add_argument("--partitions", type=int, help="parallel partitions (1-256; default CLEANUP_PARTITIONS, 8)")
    p.add_argument(
        "--max-parallel", type=int, help="partitions running at once (default CLEANUP_MAX_PARALLEL_PARTITIONS, 4)"
    )
    p.add_argument("--batch-size", type=int, help="accounts per batch transaction (default CLEANUP_BATCH_SIZE, 1000)")
    p.add_argument("--note", default="", help="operator note kept in the workflow memo (e.g. a ticket)")
    p.add_argument("--allow-empty", action="store_true", help="start even if no active account has that deadline")
    p.add_argument("--wait", action="store_true", help="wait for the result, with a progress bar on a terminal")
    p.add_argument(
        "--dry-run", action="store_true", help="show what the cleanup would do now; start and change nothing"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=finite_float(),
        metavar="SECONDS",
        help="a partition whose worker died resumes elsewhere after this long without a heartbeat "
        "(env: CLEANUP_HEARTBEAT_TIMEOUT_SECONDS; default 7)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=finite_float(),
        metavar="SECONDS",
        help="heartbeat at least this often while a batch runs "
        "(env: CLEANUP_HEARTBEAT_INTERVAL_SECONDS; default a third of the timeout)",
    )
    p.add_argument(
        "--max-failed",
        metavar="N|P%",
        help="tolerated accounts whose cleanup fails (a count, or a percent of the claimed such as 5%%); "
        "beyond it the run fails after settling (default: no limit)",
    )


def _add_account_verbs(account: Commands) -> None:
    """`account renew|hold|release|history|dismiss`: one account each."""
    command = account.add
    p = command("renew", cmd_renew, "record a renewal (database first), then signal the cleanup")
    p.add_argument("account_id", help=ACCOUNT_HELP)
    p.add_argument("--until", help="new renewal deadline; without it the account is renewed for good")
    p.add_argument("--allow-earlier", action="store_true", help="accept a new deadline earlier than the current one")

    p = command("hold", cmd_hold, "put an account under a legal hold: never claimed until released (exit 3: too late)")
    p.add_argument("account_id", help=ACCOUNT_HELP)
    p.add_argument("--reason", required=True, help="why (kept in the account's history; no personal data)")

    p = command("release", cmd_release, "end an account's legal hold: cleaned at its deadline, or now if passed")
    p.add_argument("account_id", help=ACCOUNT_HELP)

    p = account.add("history", cmd_account, "an account's history: its erasure receipt (no personal data)")
    p.add_argument("account_id", help=ACCOUNT_HELP)
    p = account.add("dismiss", cmd_dismiss, "dismiss a registration that can never be cleaned (never claimed again)")
    p.add_argument("account_id", help="the account's ID exactly as registered (as `cleanup failed` lists it)")
    p.add_argument("--reason", required=True, help="why (kept in the account's history; no personal data)")


def _add_review_verbs(cleanup: Commands) -> None:
    """`cleanup list|failed|retry|prune`: the cleanups, the accounts whose cleanup failed, the bookkeeping."""
    command = cleanup.add
    p = command("list", cmd_list, "list cleanups with their phase and progress")
    p.add_argument("--limit", type=count_argument(1), default=50, help="cleanups to show (default 50)")

    p = command("failed", cmd_failed, "list accounts whose cleanup failed, with the database's reason")
    p.add_argument("--cleanup", metavar="ID", help=CLEANUP_FILTER_HELP)
    p.add_argument("--all", action="store_true", help="include failures already resolved by `cleanup retry`")
    p.add_argument("--limit", type=count_argument(1), default=100, help="rows to show (default 100)")

    p = command(
        "retry",
        cmd_retry_failed,
        "retry the failed accounts after fixing the cause (same idempotency key: never cleaned twice)",
    )
    p.add_argument("--cleanup", metavar="ID", help=CLEANUP_FILTER_HELP)
    p.add_argument(
        "--with-current-targets",
        action="store_true",
        help="retry with CLEANUP_TARGETS_FILE's targets though the cleanup ran with others (after fixing the file;"
        " the set it ran with is kept beside the new one)",
    )

    p = command(
        "prune",
        cmd_prune,
        "prune the service's bookkeeping of cleanups settled and accounts cleaned before the retention"
        " (the workers do it daily)",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would be pruned now; delete nothing")
    p.add_argument(
        "--retention-days",
        type=count_argument(7, 36_500),
        help="keep this many days (at least 7; env: CLEANUP_RETENTION_DAYS; default 30)",
    )


def _add_planner(commands: Commands) -> None:
    """`planner status|pause|resume|start`: the deadline planner of this task queue."""
    planner = commands.group("planner", "the deadline planner of this task queue: status, pause, resume, start")
    help = "next deadlines, overdue, held, failed, recovered, lateness, load budget (answers without the database)"
    planner.add("status", cmd_planner_status, help)
    p = planner.add("pause", cmd_planner_pause, "stop starting cleanups until resume (recorded in the database)")
    p.add_argument("--reason", default="", help="why (shown by status and in the Temporal UI)")
    p.add_argument(
        "--hold-scheduled",
        action="store_true",
        help="also hold the bucket cleanups already scheduled (they wait at their claim until resume)",
    )
    planner.add(
        "resume", cmd_planner_resume, "end a pause: the planner starts cleanups again (recorded in the database)"
    )
    planner.add("start", cmd_planner_start, "start the planner if it is not running (the workers also start it)")


def _binding(deadline: dict[str, Any]) -> str:
    """Which of the budget's objectives binds, and when the cohorts it knows would finish."""
    text = f"binds: {deadline['binding']}"
    if deadline.get("accounts_left"):
        text += (
            f"; {deadline['accounts_left']} accounts left need {deadline['rows_per_second']} accounts/s,"
            f" projected finish {deadline['projected_finish']} ({'on time' if deadline['on_time'] else 'late'}"
            f" against {deadline['target']})"
        )
    return text
