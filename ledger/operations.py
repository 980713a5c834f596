"""What the ledger CLI does, as functions the tests call too: start a date's run, inspect it."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime
from typing import Any

import asyncpg
from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair,
)

from core import db
from core import search_attributes as sa
from core.config import LedgerSettings
from core.errors import DatabaseUnavailable, InputError, validation_message
from core.model import Model
from core.queries import load
from core.temporal import WorkflowStart, describe_or_none, query_or_note, start_idempotently
from ledger.models import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ID_PREFIX,
    LEDGER_WORKFLOW,
    STATUS_QUERY,
    LedgerReconciliationInput,
    LedgerReconciliationResult,
    LedgerReport,
    LedgerSettlement,
    LedgerStatus,
    ReviewRow,
    RunOptions,
    SettlementRevision,
    StartedReconciliation,
    ledger_workflow_id,
)

SQL = load(__file__)
DEFAULT_LEDGER = LedgerSettings()
_RECHECK_SUFFIX = re.compile(r"-recheck-\d{8}T\d{12}Z")


def parse_business_date(text: str, *, today: date | None = None) -> date:
    """A calendar date (YYYY-MM-DD) that is over: today's ledger is still being written."""
    try:
        value = date.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"not a business date: {text!r} (expected YYYY-MM-DD, e.g. 2026-10-25)") from None
    if len(text.strip()) != 10:
        raise InputError(f"not a business date: {text!r} (expected YYYY-MM-DD, e.g. 2026-10-25)")
    today = today or datetime.now(UTC).date()
    if value > today:
        raise InputError(
            f"business date {value.isoformat()} is in the future; a date can be reconciled once it is over"
        )
    if value == today:
        raise InputError(f"business date {value.isoformat()} is not over yet; reconcile it from tomorrow on")
    return value


class ReconcileRequest(Model):
    """One reconciliation to start: the date, and the options of `ledger reconcile`.

    `recheck`: a new run of a date under its own ID (`{date ID}-recheck-{UTC time}`, `now` the time),
    so the original run stays in history; it judges only the shards whose inputs changed and records
    a new settlement revision if anything did. It may run at any time, also next to the night run:
    shard batches and settlements of one date take turns under advisory locks.
    `heartbeat_timeout_seconds` None: the ledger settings' (LEDGER_HEARTBEAT_TIMEOUT_SECONDS)."""

    business_date: date
    shards: int | None = None  # None: the loaded count (given, it must match it)
    max_parallel: int = 8
    batch_size: int = DEFAULT_BATCH_SIZE
    tolerance_cents: int = 50
    heartbeat_timeout_seconds: float | None = None
    id_prefix: str = DEFAULT_ID_PREFIX
    recheck: bool = False
    now: datetime | None = None


async def start_reconciliation(
    client: Client,
    pool: asyncpg.Pool,
    task_queue: str,
    request: ReconcileRequest,
    settings: LedgerSettings = DEFAULT_LEDGER,
) -> StartedReconciliation:
    """Start (or find) the reconciliation of one date; its workflow ID is the date, so a manual run
    and a scheduled run of the same date meet in the same workflow and never double-post.

    Three steps: `loaded_day` (the date's data, judged), `reconciliation_input` (the workflow's input,
    judged) and `start_or_find_reconciliation` (the start, once per ID). `settings`: the caller's
    (`settings.ledger`; CleanupClient passes them)."""
    r = request
    heartbeat = r.heartbeat_timeout_seconds
    heartbeat = settings.heartbeat_timeout_seconds if heartbeat is None else heartbeat
    day = await loaded_day(pool, r.business_date, r.shards)
    input = reconciliation_input(r, day["shards"], heartbeat)
    workflow_id = (
        recheck_workflow_id(r.business_date, r.id_prefix, r.now)
        if r.recheck
        else ledger_workflow_id(r.business_date, r.id_prefix)
    )
    found = StartedReconciliation(
        workflow_id=workflow_id,
        run_id=None,
        started=False,
        business_date=r.business_date,
        shards=input.shards,
        payments=day["payments"],
    )
    return await start_or_find_reconciliation(client, task_queue, input, found)


async def loaded_day(pool: asyncpg.Pool, business_date: date, shards: int | None) -> asyncpg.Record:
    """The date's loaded ledger (its shards and payments); refused when nothing is loaded for it or
    when `shards` is given and differs from the loaded count."""
    day = await pool.fetchrow(SQL.ledger_day, business_date)
    if day is None:
        raise InputError(
            f"no ledger data loaded for business date {business_date.isoformat()} "
            "(load it first, e.g. `starter.py ledger seed --date ...`)"
        )
    if shards is not None and shards != day["shards"]:
        raise InputError(f"business date {business_date.isoformat()} has {day['shards']} shard(s), not {shards}")
    return day


def reconciliation_input(
    request: ReconcileRequest, shards: int, heartbeat_timeout_seconds: float
) -> LedgerReconciliationInput:
    """The workflow's input for the date's `shards` (ledger.models.LedgerReconciliationInput.of);
    bad values refused (exit 2)."""
    try:
        options = RunOptions(
            shards=shards,
            max_parallel=request.max_parallel,
            batch_size=request.batch_size,
            tolerance_cents=request.tolerance_cents,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        )
        return LedgerReconciliationInput.of(options, request.business_date, request.recheck)
    except ValidationError as err:
        raise InputError(validation_message(err)) from None


async def start_or_find_reconciliation(
    client: Client, task_queue: str, input: LedgerReconciliationInput, found: StartedReconciliation
) -> StartedReconciliation:
    """Start the run `found` names unless a run with its ID exists; that run otherwise."""
    existing = await describe_or_none(client, found.workflow_id)
    if existing is not None:
        running = existing.status == WorkflowExecutionStatus.RUNNING
        return found.model_copy(update={"run_id": existing.run_id, "started": False, "joined": running})
    # A closed run of this date is never repeated; if a scheduled run won the race since the
    # describe above, this is its run.
    run_id, started, joined = await start_idempotently(
        client,
        WorkflowStart(
            LEDGER_WORKFLOW,
            input,
            workflow_id=found.workflow_id,
            task_queue=task_queue,
            result_type=LedgerReconciliationResult,
            search_attributes=[SearchAttributePair(sa.BUSINESS_DATE, input.business_date.isoformat())],
            summary=f"ledger {'re-check' if input.recheck else 'reconciliation'} of {input.business_date} (manual)",
        ),
    )
    return found.model_copy(update={"run_id": run_id, "started": started, "joined": joined})


def recheck_workflow_id(business_date: date, id_prefix: str = DEFAULT_ID_PREFIX, now: datetime | None = None) -> str:
    """One ID per re-check: the date's ID, `-recheck-` and the UTC start time to the microsecond."""
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{ledger_workflow_id(business_date, id_prefix)}-recheck-{stamp}"


def ledger_target(text: str) -> tuple[date, str]:
    """`ledger status` takes a date or the workflow ID `ledger-reconciliation-YYYY-MM-DD` (or a
    re-check's, `...-YYYY-MM-DD-recheck-<UTC time>`: the status of its date)."""
    raw = text.strip()
    if raw.startswith(DEFAULT_ID_PREFIX + "-"):
        raw = raw[len(DEFAULT_ID_PREFIX) + 1 :]
        if _RECHECK_SUFFIX.fullmatch(raw[10:]):
            raw = raw[:10]
    try:
        value = date.fromisoformat(raw)
    except ValueError:
        raise InputError(
            f"not a business date or ledger workflow ID: {text!r} (e.g. 2026-10-25 or ledger-reconciliation-2026-10-25)"
        ) from None
    return value, ledger_workflow_id(value)


async def ledger_status(
    client: Client, pool: asyncpg.Pool | None, business_date: date, *, id_prefix: str = DEFAULT_ID_PREFIX
) -> LedgerReport:
    """Shards done k/S, corrections, review rows, settled: from Temporal and from the database.

    Without a database (`pool` None, or the connection lost while reading) it answers what Temporal
    knows, and `database` says that the counts from the database are missing."""
    workflow_id = ledger_workflow_id(business_date, id_prefix)
    desc = await describe_or_none(client, workflow_id)
    missing: str | None = "not connected" if pool is None else None
    day = None
    if pool is not None:
        try:
            day = await pool.fetchrow(SQL.ledger_day, business_date)
        except Exception as err:
            if not db.is_database_error(err):
                raise
            missing = f"{type(err).__name__}: {err}"
    if desc is None and day is None and missing is None:
        raise InputError(f"nothing known about business date {business_date.isoformat()}")
    if desc is None and missing is not None:
        raise DatabaseUnavailable(
            f"Temporal has no run {workflow_id} and the database is unavailable ({missing}): nothing to show"
        )
    out: dict[str, Any] = {
        "business_date": business_date,
        "workflow_id": workflow_id,
        "run_id": desc.run_id if desc else None,
        "temporal_status": desc.status.name if desc and desc.status else None,
        "phase": None,
    }
    if desc is not None:
        handle = client.get_workflow_handle(workflow_id, result_type=LedgerReconciliationResult)
        if desc.status == WorkflowExecutionStatus.RUNNING:
            live, no_answer = await query_or_note(desc, client, STATUS_QUERY, LedgerStatus)
            if live is None:
                out["live_status"] = f"{no_answer}; the phase is not shown"
            else:
                out["phase"] = live.phase
        elif desc.status == WorkflowExecutionStatus.COMPLETED:
            result: LedgerReconciliationResult = await handle.result()
            out["phase"] = "settled" if result.settlement else None
    if pool is not None and missing is None:
        try:
            out.update(await _ledger_status_from_database(pool, business_date, day))
            return LedgerReport(**out)
        except Exception as err:
            if not db.is_database_error(err):
                raise
            missing = f"{type(err).__name__}: {err}"
    out["shards_done"] = "unknown (database unavailable)"
    out["settled"] = None  # not known: the database is missing
    out["database"] = f"unavailable ({missing}); {DB_PART}"
    return LedgerReport(**out)


DB_PART = "shards done, corrections, review rows and the settlement are not shown"


async def _ledger_status_from_database(pool: asyncpg.Pool, business_date: date, day: Any) -> dict[str, Any]:
    shards = day["shards"] if day else None
    out: dict[str, Any] = {}
    totals = await pool.fetchrow(SQL.date_totals, business_date)
    assert totals is not None
    settlement = await pool.fetchrow(SQL.get_settlement, business_date)
    revisions = await pool.fetch(SQL.settlement_revisions, business_date)
    open_reviews = await pool.fetchval(SQL.open_reviews, *SQL.bind("open_reviews", business_date=business_date))
    out.update(
        {
            "shards_done": f"{totals['shards_reported']}/{shards if shards is not None else '?'}",
            "shards_reported": totals["shards_reported"],
            "shards_total": shards,
            "payments": day["payments"] if day else None,
            "discrepancies_found": totals["discrepancies_found"],
            "corrections": totals["corrected"],
            "review_rows": totals["sent_to_review"],
            # Effects written by an attempt that has not reported yet show here before they do above.
            "corrections_recorded": totals["corrections_recorded"],
            "review_rows_recorded": totals["review_rows_recorded"],
            "open_review_rows": open_reviews,
            "duplicate_report_rows": totals["duplicate_report_rows"],
            "settled": settlement is not None,
            "revision": settlement["revision"] if settlement is not None else None,
            "revisions": [SettlementRevision(**r) for r in revisions],
        }
    )
    if settlement is not None:
        out["settlement"] = LedgerSettlement(**settlement)
    return out


async def review_rows(pool: asyncpg.Pool, business_date: date, limit: int = 50) -> list[ReviewRow]:
    """The date's discrepancies left for a person, by kind and key."""
    rows = await pool.fetch(SQL.review_rows, business_date, limit)
    return [ReviewRow(**r) for r in rows]
