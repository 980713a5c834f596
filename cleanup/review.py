"""Review of accounts whose cleanup failed, and the dry run of a cleanup: what the CLI calls.

- `list_failed`: the accounts in `cleanup_failed` with the database's reason.
- `retry_failed`: after the cause is fixed, clean them with the same compiled statement and the
  same idempotency key (account_id, cleanup_version) as the partition did, under their original
  cleanup: an account already cleaned is never cleaned twice; one renewed meanwhile is resolved as
  renewed/stale, not cleaned; one that still fails stays in review with the new reason. The
  settlement written when the cohort settled is not rewritten (it records what happened then).
- `preview_cleanup`: the dry run, one read-only set-based statement.

Failed-account status (migration 006): an isolated account is 'cleanup_failed', still claimed by
its cleanup and renewable like an active one (`account renew` bumps its version, so the failure goes stale).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import asyncpg

from cleanup.batches import DEFAULT_SETTINGS, CompiledCleanup, run_subset, with_reminders
from cleanup.models import PartitionCounts, cohort_cleanup_id
from cleanup.operations import check_account_id
from cleanup.target_check import check_follow_ups, plan_targets, read_catalog
from cleanup.target_report import FollowUpReport, describe_follow_ups
from cleanup.targets import CleanupTargets, compile_preview
from core import metrics
from core.config import CleanupSettings
from core.errors import InputError
from core.model import Model
from core.queries import load

SQL = load(__file__)
RETRY_CHUNK = 1000


class FailedAccount(Model):
    """An account whose cleanup failed: the database's reason, never the game's data."""

    account_id: str
    cleanup_version: int
    cleanup_id: str
    partition_no: int
    target: str | None  # the declared target table, when it can be told
    sqlstate: str
    message: str
    detail: str | None
    failed_at: datetime
    attempts: int
    resolved_at: datetime | None
    resolution: Literal["cleaned", "renewed", "stale", "dismissed"] | None


class StillFailing(Model):
    """An account that failed again when retried, with the database's new reason."""

    account_id: str
    cleanup_id: str
    sqlstate: str
    message: str
    target: str | None


class RetryResult(Model):
    """What `retry_failed` did: the accounts retried and what became of them."""

    retried: int
    cleaned: int
    already_applied: int
    skipped_renewed: int
    skipped_stale: int
    still_failed: int
    failures: list[StillFailing]


class TargetPreview(Model):
    """A declared target and the rows the cleanup would remove (or archive, or anonymize) in it."""

    table: str
    match_column: str
    action: str
    archive_table: str | None
    rows: int


class CleanupPreview(Model):
    """The dry run of a cleanup: what it would do now. Nothing was started or changed."""

    dry_run: Literal[True] = True
    scope: Literal["account", "cohort", "window"]
    deadline: datetime | None  # None: a window of deadlines
    window_from: datetime | None = None  # the window: deadlines from (included) ...
    window_to: datetime | None = None  # ... to (excluded; None: no end)
    account_id: str | None
    workflow_id: str | None  # the cohort's cleanup ID; None for one account or a window
    accounts_in_scope: int
    already_renewed: int
    reminders: int
    targets: list[TargetPreview]
    # Declared follow-up statements, planned, not run (they write): their row counts are in the receipts.
    follow_ups: list[FollowUpReport] = []


async def list_failed(
    pool: asyncpg.Pool, cleanup_id: str | None = None, *, include_resolved: bool = False, limit: int = 100
) -> list[FailedAccount]:
    """Accounts whose cleanup failed (pending review; with `include_resolved`, also the resolved)."""
    if limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}")
    rows = await pool.fetch(
        SQL.list_failed,
        *SQL.bind("list_failed", cleanup_id=cleanup_id, include_resolved=include_resolved, limit=limit),
    )
    return [FailedAccount.from_row(r) for r in rows]


async def retry_failed(
    pool: asyncpg.Pool,
    targets: CleanupTargets,
    cleanup_id: str | None = None,
    *,
    adopt_targets: bool = False,
    settings: CleanupSettings = DEFAULT_SETTINGS,
) -> RetryResult:
    """Retry every pending failed account (of one cleanup, or all), set-based per partition. With
    `adopt_targets` (said explicitly, after fixing the targets file) a cleanup that ran with other
    targets runs with these from now on; the set it ran with is kept beside them. `settings`: the
    caller's `settings.cleanup` (the anonymize key, the reminders), as the workers'."""
    groups = await pool.fetch(SQL.failed_to_retry, cleanup_id)
    if cleanup_id is not None and not groups:
        known = await pool.fetchval(SQL.failed_of_cleanup, cleanup_id)
        if not known:
            raise InputError(f"no failed account recorded for cleanup {cleanup_id!r}")
    compiled = await CompiledCleanup.compile(pool, targets, settings)  # refuses targets that do not compile
    for cleanup in dict.fromkeys(g["cleanup_id"] for g in groups):
        if adopt_targets:
            await pool.execute(
                SQL.adopt_current_target_set,
                *SQL.bind("adopt_current_target_set", cleanup_id=cleanup, fingerprint=targets.fingerprint),
            )
        await same_target_set(pool, targets, cleanup)
    totals = PartitionCounts()
    still_failing: list[StillFailing] = []
    retried = 0
    for group in groups:
        ids: list[str] = list(group["account_ids"])
        retried += len(ids)
        for start in range(0, len(ids), RETRY_CHUNK):
            counts, failures = await run_subset(
                pool, compiled, group["cleanup_id"], group["partition_no"], ids[start : start + RETRY_CHUNK]
            )
            totals = totals + counts
            still_failing += [
                StillFailing(
                    account_id=f.account_id,
                    cleanup_id=group["cleanup_id"],
                    sqlstate=f.sqlstate,
                    message=f.message,
                    target=f.target,
                )
                for f in failures
            ]
    metrics.record_cleanup_batch(cleaned=totals.cleaned, already_applied=totals.already_applied, failed=totals.failed)
    return RetryResult(
        retried=retried,
        cleaned=totals.cleaned,
        already_applied=totals.already_applied,
        skipped_renewed=totals.skipped_renewed,
        skipped_stale=totals.skipped_stale,
        still_failed=totals.failed,
        failures=still_failing,
    )


async def same_target_set(
    conn: asyncpg.Pool | asyncpg.Connection, targets: CleanupTargets, cleanup_id: str | None
) -> None:
    """Refuse, naming both fingerprints, to act with other targets than the cleanup ran with (or,
    before it ran, than the workers last started with): an account cleaned with a smaller set would
    be marked cleaned for good, its idempotency key blocking any later pass."""
    recorded = await conn.fetchval(SQL.cleanup_target_set, cleanup_id) if cleanup_id else None
    source = f"cleanup {cleanup_id} ran with"
    if recorded is None:
        recorded = await conn.fetchval(SQL.latest_worker_target_set)
        source = "the workers last started with"
    if recorded is not None and recorded != targets.fingerprint:
        raise InputError(
            f"target set mismatch: {source} target set {recorded}, CLEANUP_TARGETS_FILE gives "
            f"{targets.fingerprint}; use the workers' targets file"
        )


async def preview_cleanup(
    pool: asyncpg.Pool,
    targets: CleanupTargets,
    *,
    deadline: datetime | None = None,
    account_id: str | None = None,
    window: tuple[datetime, datetime | None] | None = None,
    reminders: bool = True,
) -> CleanupPreview:
    """What `cleanup` would do now: accounts in scope (a cohort's exact deadline, one account, or every
    deadline in `window` = [from, to), `to` None: no end), rows per declared target with its match
    column, reminders to write (none with `reminders` off: the settings' CLEANUP_REMINDERS),
    accounts already renewed. One read-only, repeatable-read transaction; changes nothing."""
    if sum(x is not None for x in (deadline, account_id, window)) != 1:
        raise InputError("give exactly one of --deadline (a cohort), --account (one account) or --from (a window)")
    if account_id is not None:
        check_account_id(account_id)
    for instant in (deadline, *(window or ())):
        if instant is not None and instant.tzinfo is None:
            raise InputError("a deadline without a timezone")
    if window is not None and window[1] is not None and window[1] <= window[0]:
        raise InputError(f"--to ({window[1].isoformat()}) must be after --from ({window[0].isoformat()})")
    async with pool.acquire() as conn, conn.transaction(readonly=True, isolation="repeatable_read"):
        await same_target_set(conn, targets, cohort_cleanup_id(deadline) if deadline else None)
        plans = plan_targets(targets, await read_catalog(conn, targets))
        follow_ups = describe_follow_ups(await check_follow_ups(conn, targets))
        if account_id is not None:
            state = await conn.fetchrow(SQL.account_state, account_id)
            if state is None:
                raise InputError(f"unknown account {account_id!r}")
            deadline = state["renewal_deadline"]
            row = await conn.fetchrow(with_reminders(compile_preview(targets, plans, "account"), reminders), account_id)
        elif window is not None:
            row = await conn.fetchrow(with_reminders(compile_preview(targets, plans, "window"), reminders), *window)
        else:
            row = await conn.fetchrow(with_reminders(compile_preview(targets, plans, "cohort"), reminders), deadline)
    assert row is not None
    return CleanupPreview(
        scope="account" if account_id else "window" if window else "cohort",
        deadline=deadline,
        window_from=window[0] if window else None,
        window_to=window[1] if window else None,
        account_id=account_id,
        workflow_id=cohort_cleanup_id(deadline) if deadline and not account_id else None,
        accounts_in_scope=row["accounts_in_scope"],
        already_renewed=row["already_renewed"],
        reminders=row["reminders"],
        targets=[
            TargetPreview(
                table=t.table,
                match_column=t.match_column,
                action=t.action,
                archive_table=t.archive_table,
                rows=row[f"rows_t{i}"],
            )
            for i, t in enumerate(targets.target)
        ],
        follow_ups=follow_ups,
    )
