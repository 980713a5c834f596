"""What the CLI does, as functions the tests call too: start, renew, inspect cleanups."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair
from temporalio.service import RPCError, RPCStatusCode

from cleanup.inputs import CleanupScope, StartCleanup, cleanup_input
from cleanup.models import (
    CLEANUP_WORKFLOW,
    DEFAULTS,
    PLANNER_NUDGE_SIGNAL,
    RENEWED_SIGNAL,
    STATUS_QUERY,
    CleanupOutcome,
    CleanupResult,
    CleanupStatus,
    PartitionCounts,
    RenewalCleanupInput,
    RenewalSignal,
    account_cleanup_id,
    cohort_cleanup_id,
    is_account_id,
    planner_workflow_id,
)
from cleanup.target_report import TargetsCheck
from core import db
from core import search_attributes as sa
from core.config import MAX_PARTITIONS, CleanupDefaults, CleanupSettings
from core.envelope import ensure_within_envelope
from core.errors import InputError
from core.model import Model, Report
from core.queries import load
from core.temporal import WorkflowStart, describe_or_none, query_or_note, start_idempotently

SQL = load(__file__)
DEFAULT_CLEANUP_SETTINGS = CleanupSettings()
log = logging.getLogger("cleanup")


def public_account_id(client: Client, account_id: str) -> str:
    """The account ID as it may appear in workflow IDs, search attributes and summaries.

    With payload encryption on (core.codec), a keyed pseudonym: those fields are never encrypted.
    """
    from core.codec import pseudonymize  # lazy: cryptography is slow to import; renew must start fast

    return pseudonymize(client.data_converter.payload_codec, account_id)


def check_account_id(value: str) -> str:
    if not is_account_id(value):
        raise InputError(f"malformed account ID {value!r}: expected 1-200 characters without control characters")
    return value


class StartedCleanup(Model):
    """The cleanup `start_cleanup` started, or the run with its ID that already existed."""

    workflow_id: str
    run_id: str | None
    started: bool  # True only when this call started the run
    deadline: datetime
    account_id: str | None
    accounts_in_scope: int
    # For a run that already existed: its Temporal status and, once it completed, its outcome.
    temporal_status: str | None = None
    outcome: str | None = None
    # True: the run with this ID was running and this call joined it (another caller, or one racing
    # this one, started it): nothing new started. `started` and `joined` both False: a closed run.
    joined: bool = False
    # A cohort the deadline planner's cleanup covers: the end of its range [deadline, deadline_until)
    # (None: the one instant), and what this cleanup shares with the planner, in a sentence.
    deadline_until: datetime | None = None
    planner: str | None = None


async def _existing_run(client: Client, workflow_id: str) -> tuple[str | None, str | None, str | None] | None:
    """(run ID, Temporal status, outcome if completed) of the latest run with this ID, or None."""
    desc = await describe_or_none(client, workflow_id)
    if desc is None:
        return None
    outcome: str | None = None
    if desc.status == WorkflowExecutionStatus.COMPLETED:
        handle = client.get_workflow_handle(workflow_id, run_id=desc.run_id, result_type=CleanupResult)
        outcome = (await handle.result()).outcome
    return desc.run_id, desc.status.name if desc.status else None, outcome


def started_cleanup(
    scope: CleanupScope, run_id: str | None, started: bool, status: str | None = None, outcome: str | None = None
) -> StartedCleanup:
    """The start's result; a run found (not started) that is RUNNING was joined."""
    return StartedCleanup(
        workflow_id=scope.workflow_id,
        run_id=run_id,
        started=started,
        deadline=scope.deadline_from,
        account_id=scope.account_id,
        accounts_in_scope=scope.accounts_in_scope,
        temporal_status=status,
        outcome=outcome,
        joined=not started and status == WorkflowExecutionStatus.RUNNING.name,
        deadline_until=scope.deadline_until,
        planner=scope.planner,
    )


async def start_cleanup(
    client: Client, pool: asyncpg.Pool, task_queue: str, request: StartCleanup, defaults: CleanupDefaults = DEFAULTS
) -> StartedCleanup:
    """Start (or find) the cleanup of a cohort or of one account; the ID comes from the business key.

    Three steps: `resolve_scope` (what the cleanup covers), `cleanup.inputs.cleanup_input` (the
    workflow's input from the request and `defaults`, judged; the planner builds its cohorts' inputs
    there too) and `start_or_find` (the start, once per business key). `defaults`: the settings'
    (`settings.cleanup.defaults`; CleanupClient passes them).
    A cohort of a deadline the running deadline planner owns is the planner's cleanup of its cohort
    (`beside_planner`), and a cohort the planner already cleaned is its run (`planner_ran`).

    An account whose cleanup already ran (it is `cleaning` or `cleaned`) gets that run back, with
    its outcome, as a cohort started twice does; an account renewed for good is refused (exit 2),
    as there is nothing to clean.
    """
    try:
        scope = await resolve_scope(client, pool, request, defaults)
    except NoActiveAccounts:
        assert request.deadline is not None
        ran = await planner_ran(client, task_queue, request.deadline)
        if ran is None:
            raise
        return ran
    if isinstance(scope, StartedCleanup):
        return scope
    if scope.account_id is None:
        scope = await beside_planner(client, pool, task_queue, scope)
        if isinstance(scope, StartedCleanup):
            return scope
    input = cleanup_input(scope, request, defaults)
    ensure_within_envelope(client, input)
    return await start_or_find(client, task_queue, scope, input)


class NoActiveAccounts(InputError):
    """A cohort with no active account at its deadline and no cleanup run of its own."""


async def planner_ran(client: Client, task_queue: str, deadline: datetime) -> StartedCleanup | None:
    """The deadline planner's cleanup that covered `deadline`, if one exists: a cohort whose accounts
    a planner's cleanup took has that run, not nothing to clean."""
    from cleanup.planner import planner_cleanup_ids  # lazy: the planner's imports are heavy

    for workflow_id in await planner_cleanup_ids(client, task_queue, deadline):
        found = await _existing_run(client, workflow_id)
        if found is not None:
            ran = CleanupScope(
                workflow_id,
                deadline,
                None,
                None,
                1,
                0,
                planner="the deadline planner's cleanup that covered this deadline",
            )
            return started_cleanup(ran, found[0], False, found[1], found[2])
    return None


async def resolve_scope(
    client: Client, pool: asyncpg.Pool, request: StartCleanup, defaults: CleanupDefaults = DEFAULTS
) -> CleanupScope | StartedCleanup:
    """The cohort of `request.deadline` or the one account `request.account_id` (exactly one of them
    is given); an account's run if its cleanup already ran."""
    if (request.deadline is None) == (request.account_id is None):
        raise InputError("give exactly one of --deadline (a cohort) or --account (one account)")
    partitions = defaults.partitions if request.partitions is None else request.partitions
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise InputError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {partitions}")
    if request.account_id is not None:
        return await account_scope(client, pool, request.account_id)
    assert request.deadline is not None
    return await cohort_scope(client, pool, request.deadline, partitions, request.allow_empty)


async def account_scope(client: Client, pool: asyncpg.Pool, account_id: str) -> CleanupScope | StartedCleanup:
    """One account, at its current deadline and version; its run if its cleanup already ran."""
    check_account_id(account_id)
    state = await pool.fetchrow(SQL.account_state, account_id)
    if state is None:
        raise InputError(f"unknown account {account_id!r}")
    if state["status"] == "renewed":
        raise InputError(
            f"account {account_id} is renewed (it has no renewal deadline any more): nothing to clean, "
            "nothing was started"
        )
    deadline = state["renewal_deadline"]
    if state["status"] in ("cleaning", "cleaned") and state["claimed_by"]:  # 'cleanup_failed' may start again
        found = await _existing_run(client, state["claimed_by"])
        if found is not None:
            ran = CleanupScope(state["claimed_by"], deadline, account_id, None, 1, 0)
            return started_cleanup(ran, found[0], False, found[1], found[2])
    if state["status"] in ("cleaning", "cleaned"):
        raise InputError(f"account {account_id} is already {state['status']}")
    workflow_id = account_cleanup_id(public_account_id(client, account_id), deadline)
    return CleanupScope(workflow_id, deadline, account_id, state["cleanup_version"], 1, 1)


async def cohort_scope(
    client: Client, pool: asyncpg.Pool, deadline: datetime, partitions: int, allow_empty: bool
) -> CleanupScope:
    """The active accounts whose deadline is exactly `deadline`; none is refused unless allowed
    (or the cohort's run exists)."""
    if deadline.tzinfo is None:
        raise InputError("deadline has no timezone")
    in_scope = await pool.fetchval(SQL.active_accounts_at_deadline, deadline)
    workflow_id = cohort_cleanup_id(deadline)
    if in_scope == 0 and not allow_empty and await describe_or_none(client, workflow_id) is None:
        raise NoActiveAccounts(
            f"no active account has renewal deadline {deadline.isoformat()}; "
            "check the instant (it must match exactly) or pass --allow-empty"
        )
    return CleanupScope(workflow_id, deadline, None, None, partitions, in_scope)


async def beside_planner(
    client: Client, pool: asyncpg.Pool, task_queue: str, scope: CleanupScope
) -> CleanupScope | StartedCleanup:
    """A cohort of a deadline the running deadline planner owns is the planner's cleanup of its
    cohort, started or joined under the ID the planner ensures: one run claims each account, and
    what it reports is all of them. With the planner paused, or its cleanup of the cohort closed,
    this cleanup runs on its own and says what it shares with the planner. A cohort cleanup of this
    deadline that already exists is found as before (`start_or_find`)."""
    from cleanup.planner import join_planner_cohort, planner_cohort_of  # lazy: the planner's imports are heavy

    if await describe_or_none(client, scope.workflow_id) is not None:
        return scope
    found = await planner_cohort_of(client, pool, task_queue, scope.deadline_from)
    if found is None:
        return scope
    cohort = found.cohort
    covers = f"deadline {cohort.start.isoformat()}"
    if cohort.until is not None:
        covers = f"deadlines from {cohort.start.isoformat()} to before {cohort.until.isoformat()}"
    if found.paused:
        return scope._replace(planner=await _paused_planner_note(client, cohort.workflow_id, covers))
    outcome = await join_planner_cohort(client, task_queue, found)
    if outcome.started or outcome.joined:
        joined = CleanupScope(
            cohort.workflow_id,
            cohort.start,
            None,
            None,
            found.cohort.partitions or found.cleanups.partitions,
            found.accounts,
            deadline_until=cohort.until,
            planner=f"the deadline planner's cleanup of {covers} ({found.accounts} active account(s), "
            f"{scope.accounts_in_scope} at {scope.deadline_from.isoformat()}): one run for the cohort, with "
            "the planner's options, so each account is claimed once",
        )
        return started_cleanup(joined, outcome.run_id, outcome.started, WorkflowExecutionStatus.RUNNING.name)
    theirs = await describe_or_none(client, cohort.workflow_id)
    status = theirs.status.name if theirs is not None and theirs.status else "closed"
    return scope._replace(
        planner=f"the deadline planner's cleanup {cohort.workflow_id} of {covers} is {status}: this "
        "cleanup takes the accounts of this deadline still active"
    )


async def _paused_planner_note(client: Client, workflow_id: str, covers: str) -> str:
    """What a cleanup beside a paused planner shares with it: the planner's cleanup of the cohort,
    if it started one before the pause (its timer still fires)."""
    theirs = await describe_or_none(client, workflow_id)
    if theirs is None:
        return "the deadline planner is paused: this cleanup runs on its own"
    return (
        f"the deadline planner is paused; its cleanup {workflow_id} of {covers} "
        f"({theirs.status.name if theirs.status else 'status unknown'}) covers this deadline too: each account "
        "goes to the cleanup that claims it first, and each cleanup reports only the accounts it claimed"
    )


async def start_or_find(
    client: Client, task_queue: str, scope: CleanupScope, input: RenewalCleanupInput
) -> StartedCleanup:
    """Start the cleanup unless a run with its ID exists; that run (status, outcome) otherwise."""
    existing = await _existing_run(client, scope.workflow_id)
    if existing is not None:
        return started_cleanup(scope, existing[0], False, existing[1], existing[2])
    attrs: list[SearchAttributePair[Any]] = [
        SearchAttributePair(sa.CLEANUP_DEADLINE, input.deadline_from),
        SearchAttributePair(sa.CLEANUP_PHASE, "sleeping"),
    ]
    public_account = public_account_id(client, scope.account_id) if scope.account_id is not None else None
    if public_account is not None:
        attrs.append(SearchAttributePair(sa.CLEANUP_ACCOUNT_ID, public_account))
    run_id, started, _ = await start_idempotently(
        client,
        WorkflowStart(
            CLEANUP_WORKFLOW,
            input,
            workflow_id=scope.workflow_id,
            task_queue=task_queue,
            result_type=CleanupResult,
            search_attributes=attrs,
            memo={"partitions_done": 0, "note": input.note},
            summary=f"cleanup of {public_account}"
            if public_account
            else f"cleanup of cohort {input.deadline_from.isoformat()}",
        ),
    )
    if started:
        return started_cleanup(scope, run_id, True)
    # A run with this ID that a racing caller started (joined), or a closed one (never a second).
    found = await _existing_run(client, scope.workflow_id)
    if found is None:
        return started_cleanup(scope, run_id, False)
    return started_cleanup(scope, found[0], False, found[1], found[2])


class RenewalOutcome(Model):
    """A renewal as the database judged it (in time or too late), and the cleanups it told."""

    account_id: str
    in_time: bool
    status_seen: str
    version_after: int
    old_deadline: datetime
    new_deadline: datetime | None
    claimed_by: str | None
    signalled: list[str]
    restarted_cleanup: str | None = None
    # Signals the server refused ("workflow_id: reason"): the renewal stands (the database decided
    # it), but the cleanup learns of it only at its claim. Logged too; never swallowed silently.
    signal_errors: list[str] = []


async def renew(
    client: Client,
    pool: asyncpg.Pool,
    task_queue: str,
    account_id: str,
    until: datetime | None = None,
    *,
    allow_earlier: bool = False,
) -> RenewalOutcome:
    """Commit the renewal in the database first (the source of truth: the service's renew_account
    function, judged by the database clock), then signal the cleanups. A new deadline in the past,
    or earlier than the current one without `allow_earlier`, is refused (InputError)."""
    check_account_id(account_id)
    if until is not None and until.tzinfo is None:
        raise InputError("--until has no timezone")
    renewal = SQL.bind("renew_account", account_id=account_id, until=until, allow_earlier=allow_earlier)
    async with refused_as_input():
        row = await pool.fetchrow(SQL.renew_account, *renewal)
    if row is None:
        raise InputError(f"unknown account {account_id!r}")
    in_time = row["outcome"] == "in_time"
    outcome = RenewalOutcome(
        account_id=account_id,
        in_time=in_time,
        status_seen=row["status_seen"],
        version_after=row["version_after"],
        old_deadline=row["old_deadline"],
        new_deadline=until,
        claimed_by=row["claimed_by"],
        signalled=[],
    )
    if not in_time:
        return outcome
    signalled: list[str] = []
    signal_errors: list[str] = []
    # Only a single-account cleanup waits on the signal; a cohort's claim skips renewed accounts by
    # itself, so signalling it would only grow its history (and meet the server's signal cap).
    signal = RenewalSignal(account_id=account_id, version_after=row["version_after"], new_deadline=until)
    own_cleanup = account_cleanup_id(public_account_id(client, account_id), row["old_deadline"])
    handle = client.get_workflow_handle(own_cleanup)
    try:
        running = (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    except RPCError as err:
        running = False
        if err.status != RPCStatusCode.NOT_FOUND:
            signal_errors.append(_signal_refused(account_id, own_cleanup, err))
    if running:
        try:
            await handle.signal(RENEWED_SIGNAL, signal)
            signalled.append(own_cleanup)
        except RPCError as err:
            signal_errors.append(_signal_refused(account_id, own_cleanup, err))
    restarted: str | None = None
    if until is not None and own_cleanup in signalled:
        restarted = (await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account_id))).workflow_id
    if until is not None:  # the planner picks the new deadline up; a nudge makes it look now
        await nudge_planner(client, task_queue)
    return outcome.model_copy(
        update={"signalled": signalled, "signal_errors": signal_errors, "restarted_cleanup": restarted}
    )


@asynccontextmanager
async def refused_as_input() -> AsyncIterator[None]:
    """The service's SQL functions refuse bad arguments with 22023, a deadline against the renewal's
    rules or a key the key type cannot hold with DC001-DC004 (docs/security.md), and an unknown
    account with P0002: the caller's input, reported as such (exit 2), with the database's message."""
    try:
        yield
    except (asyncpg.exceptions.InvalidParameterValueError, asyncpg.exceptions.NoDataFoundError) as err:
        raise InputError(err.args[0] if err.args else str(err)) from err
    except asyncpg.PostgresError as err:
        if not str(err.sqlstate).startswith("DC"):
            raise
        hint = err.as_dict().get("hint")
        raise InputError(f"{err.args[0] if err.args else err}" + (f" ({hint})" if hint else "")) from err


class AccountChange(Model):
    """What `set_deadline`, `hold_account` and `release_account` did to one account, as the
    database decided it: registered | moved | too_late (set_deadline), held | already_held |
    too_late (hold), released | not_held (release), dismissed | not_dismissable (dismiss)."""

    account_id: str
    result: Literal[
        "registered",
        "moved",
        "too_late",
        "held",
        "already_held",
        "released",
        "not_held",
        "dismissed",
        "not_dismissable",
    ]


async def set_deadline(pool: asyncpg.Pool, account_id: str, deadline: datetime) -> AccountChange:
    """Register `account_id` at `deadline` or move its deadline (the game's set_deadline()):
    'registered', 'moved' or 'too_late' (claimed or cleaned already)."""
    check_account_id(account_id)
    async with refused_as_input():
        result = await pool.fetchval(SQL.set_deadline, account_id, deadline)
    return AccountChange(account_id=account_id, result=result)


async def hold_account(pool: asyncpg.Pool, account_id: str, reason: str) -> AccountChange:
    """A legal hold (the game's hold()): 'held', 'already_held' or 'too_late' (claimed or cleaned)."""
    check_account_id(account_id)
    async with refused_as_input():
        result = await pool.fetchval(SQL.hold_account, account_id, reason)
    return AccountChange(account_id=account_id, result=result)


async def release_account(pool: asyncpg.Pool, account_id: str) -> AccountChange:
    """End a legal hold (the game's release()): 'released' or 'not_held'."""
    check_account_id(account_id)
    async with refused_as_input():
        result = await pool.fetchval(SQL.release_account, account_id)
    return AccountChange(account_id=account_id, result=result)


async def dismiss_account(pool: asyncpg.Pool, account_id: str, reason: str) -> AccountChange:
    """Dismiss a registration that can never be cleaned (dismiss()): never claimed again, its pending
    failure resolved as dismissed, the reason recorded. 'dismissed' or 'not_dismissable' (claimed by
    a cleanup in progress, or cleaned)."""
    check_account_id(account_id)
    async with refused_as_input():
        result = await pool.fetchval(SQL.dismiss_account, account_id, reason)
    return AccountChange(account_id=account_id, result=result)


def _signal_refused(account_id: str, workflow_id: str, err: RPCError) -> str:
    """Log a signal the server refused; returns it as RenewalOutcome.signal_errors shows it."""
    log.warning("renewal of %s committed, but signalling %s failed: %s", account_id, workflow_id, err.message)
    return f"{workflow_id}: {err.message}"


async def nudge_planner(client: Client, task_queue: str) -> None:
    """Plan now (e.g. after a renewal to a near deadline) instead of at the end of the tick."""
    try:
        await client.get_workflow_handle(planner_workflow_id(task_queue)).signal(PLANNER_NUDGE_SIGNAL)
    except RPCError:  # no planner (e.g. turned off): the renewal stands, the sweep still catches it
        pass


class RecordedSettlement(Model):
    """A cleanup's settlement as the database keeps it (CleanupSettlement less its failure texts)."""

    cleanup_id: str
    claimed: int
    cleaned: int
    reminders: int
    skipped_renewed: int
    skipped_stale: int
    already_applied: int
    settled_at: datetime
    failed: int


class CleanupReport(Report):
    """`cleanup_status`: what Temporal knows of the run, the live status of a running one, and the
    database's partitions reported, settlement and failed accounts. Without a database, `database`
    says what is missing and `settled` is None (not known)."""

    workflow_id: str
    run_id: str | None = None
    temporal_status: str | None = None
    deadline: datetime | None = None
    account_id: str | None = None
    phase: str | None = None
    # While it runs, from its status query:
    cleanup_id: str | None = None
    partitions_total: int | None = None
    partitions_done: int | None = None
    renewal_signals: int | None = None
    counts: PartitionCounts | None = None
    claimed: int | None = None
    applied: int | None = None
    sleeping_until: datetime | None = None
    outcome: CleanupOutcome | None = None  # once completed
    partitions_reported: str | None = None  # "k/P" of the partitions with work
    settled: bool | None = None
    settlement: RecordedSettlement | None = None
    failed_accounts: str | None = None  # set only when some account failed
    database: str | None = None  # set only when the database is unavailable: what is not shown
    live_status: str | None = None  # set only when no worker answered the status query: what is not shown


LIVE_PART = "partitions done, counts and renewal signals are not shown; the phase is the run's last recorded one"


async def cleanup_status(client: Client, pool: asyncpg.Pool | None, workflow_id: str) -> CleanupReport:
    """What an operator asks: sleeping until when, partitions k/P, settled, counts.

    Without a database (`pool` None, or the connection lost while reading) it answers what Temporal
    knows, and `database` says that the counts from the database are missing. Without a worker (no
    answer to the status query within core.temporal.STATUS_QUERY_TIMEOUT) it answers from the
    describe and the database, and `live_status` says so."""
    desc = await describe_or_none(client, workflow_id)
    if desc is None:
        raise InputError(f"no cleanup with workflow ID {workflow_id!r}")
    out: dict[str, Any] = {
        "workflow_id": workflow_id,
        "run_id": desc.run_id,
        "temporal_status": desc.status.name if desc.status else None,
        "deadline": desc.typed_search_attributes.get(sa.CLEANUP_DEADLINE),
        "account_id": desc.typed_search_attributes.get(sa.CLEANUP_ACCOUNT_ID),
        "phase": desc.typed_search_attributes.get(sa.CLEANUP_PHASE),
    }
    handle = client.get_workflow_handle(workflow_id, result_type=CleanupResult)
    if desc.status == WorkflowExecutionStatus.RUNNING:
        live, no_answer = await query_or_note(desc, client, STATUS_QUERY, CleanupStatus)
        if live is None:
            out["live_status"] = f"{no_answer}; {LIVE_PART}"
        else:
            out.update(dict(live))
            if live.phase == "sleeping":
                out["sleeping_until"] = live.deadline
    elif desc.status == WorkflowExecutionStatus.COMPLETED:
        result: CleanupResult = await handle.result()
        out["outcome"] = result.outcome
        out["phase"] = out["phase"] or ("renewed" if result.outcome == "renewed" else "settled")
    if pool is None:
        return CleanupReport(**out | _database_missing("not connected"))
    try:
        out.update(await _cleanup_status_from_database(pool, workflow_id))
    except Exception as err:
        if not db.is_database_error(err):
            raise
        return CleanupReport(**out | _database_missing(f"{type(err).__name__}: {err}"))
    return CleanupReport(**out)


def _database_missing(why: str) -> dict[str, Any]:
    return {
        "partitions_reported": "unknown (database unavailable)",
        "settled": None,  # not known: the database is missing
        "database": f"unavailable ({why}); partitions reported, settlement and failed accounts are not shown",
    }


async def _cleanup_status_from_database(pool: asyncpg.Pool, workflow_id: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reports = await pool.fetch(SQL.partition_reports_of_cleanup, workflow_id)
    partitions_with_work = await pool.fetchval(SQL.partitions_with_work, workflow_id)
    settlement = await pool.fetchrow(SQL.get_settlement, workflow_id)
    out["partitions_reported"] = f"{len(reports)}/{partitions_with_work}"
    out["settled"] = settlement is not None
    if settlement is not None:
        out["settlement"] = RecordedSettlement.from_row(settlement)
    failed = await pool.fetchrow(SQL.failed_counts_of_cleanup, workflow_id)
    if failed is not None and failed["total"]:
        pending = f"{failed['pending']} pending review ({failed['total']} recorded)"
        out["failed_accounts"] = f"{pending}; see `cleanup failed`"
    return out


UNREADABLE = "(unreadable with this client's payload key)"


class CleanupListing(Model):
    """One cleanup of `list_cleanups`. A run this client cannot decode (encrypted with another key)
    shows UNREADABLE as its outcome and progress."""

    workflow_id: str
    status: str | None
    phase: str | None
    outcome: str | None  # the result of a completed run; else None
    deadline: datetime | None
    account_id: str | None
    partitions_done: int | str | None


async def list_cleanups(client: Client, limit: int = 50) -> list[CleanupListing]:
    """Cleanups with phase, progress and outcome (the result of a completed run; else empty)."""
    rows: list[CleanupListing] = []
    async for wf in client.list_workflows(f"WorkflowType = '{CLEANUP_WORKFLOW}'", limit=limit):
        # A run whose payloads this client cannot decode (encrypted with another key) is still
        # listed from its search attributes; its memo and outcome show as unreadable.
        try:
            memo = await wf.memo()
        except (KeyError, ValueError):
            memo = {"partitions_done": UNREADABLE}
        outcome: str | None = None
        if wf.status == WorkflowExecutionStatus.COMPLETED:
            handle = client.get_workflow_handle(wf.id, run_id=wf.run_id, result_type=CleanupResult)
            try:
                outcome = (await handle.result()).outcome
            except RPCError:
                pass
            except (KeyError, ValueError):
                outcome = UNREADABLE
        rows.append(
            CleanupListing(
                workflow_id=wf.id,
                status=wf.status.name if wf.status else None,
                phase=wf.typed_search_attributes.get(sa.CLEANUP_PHASE),
                outcome=outcome,
                deadline=wf.typed_search_attributes.get(sa.CLEANUP_DEADLINE),
                account_id=wf.typed_search_attributes.get(sa.CLEANUP_ACCOUNT_ID),
                partitions_done=memo.get("partitions_done"),
            )
        )
    return rows


async def check_targets(
    pool: asyncpg.Pool, path: str | Path | None = None, settings: CleanupSettings = DEFAULT_CLEANUP_SETTINGS
) -> TargetsCheck:
    """`targets check`: the worker's start-up check of the targets file (`path`, else the built-in
    one) on this database, with `settings` (the anonymize key, the reminders), then what a cleanup
    does per account (cleanup.target_report.TargetsCheck). A mistake in the file raises
    TargetsFileError, the schema's TargetsRefused: both InputError (exit 2), with the fix."""
    from cleanup.batches import CompiledCleanup  # lazy: the targets' modules load only for this command
    from cleanup.target_check import check_follow_ups, read_catalog
    from cleanup.target_report import describe_follow_ups, describe_targets
    from cleanup.targets import load_targets, targets_path

    file = targets_path(Path(path) if path else None)
    targets = load_targets(file)
    compiled = await CompiledCleanup.compile(pool, targets, settings)
    catalog = await read_catalog(pool, targets)
    async with pool.acquire() as conn:
        follow_ups = await check_follow_ups(conn, targets)
    return TargetsCheck(
        file=str(file),
        fingerprint=targets.fingerprint,
        targets=describe_targets(targets, catalog),
        missing_indexes=list(compiled.missing_indexes),
        follow_ups=describe_follow_ups(follow_ups),
    )
