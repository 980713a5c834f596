"""An account's history, its erasure receipt: `starter.py account history ACCOUNT_ID --json`.

What the service did with the account's deadline and data: registrations, moves and holds, every
renewal attempt, the claim, each version cleaned with the rows removed per declared target, and
the reminder's delivery. It is read from the service's own tables, so it survives the data; it
holds keys, times, versions, counts and outcomes, never the game's data.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

import asyncpg

from cleanup.operations import check_account_id
from core.errors import InputError
from core.model import Model
from core.queries import load

SQL = load(__file__, "history.sql")


class AccountEvent(Model):
    """A change of the account's deadline or hold, as the game asked it (or the refusal)."""

    kind: Literal["registered", "moved", "refused", "held", "released"]
    deadline: datetime | None
    reason: str | None  # a hold's reason, as the game gave it
    recorded_at: datetime


class Renewal(Model):
    """A renewal attempt and how the database judged it."""

    outcome: Literal["in_time", "too_late"]
    new_deadline: datetime | None
    deadline_seen: datetime | None
    status_seen: str
    version_after: int
    judged_at: datetime


class TargetCount(Model):
    """Rows a declared target lost to one cleanup of the account."""

    target: str
    match_column: str | None = None  # None: a receipt written before receipts named it
    action: str
    rows: int


class FollowUpCount(Model):
    """A declared follow-up statement run with the batch the account was cleaned in: the rows it
    changed for that whole batch (of `batch_accounts` accounts), before or after its targets."""

    name: str
    phase: str
    rows: int
    batch_accounts: int


class Reminder(Model):
    """The renewal reminder the cleanup queued in the outbox, and its delivery."""

    status: str
    queued_at: datetime
    delivered_at: datetime | None
    attempts: int


class Cleaned(Model):
    """One version of the account cleaned: when, by which cleanup, rows per target, the reminder."""

    cleanup_version: int
    cleanup_id: str
    applied_at: datetime
    targets: list[TargetCount] | None  # None: cleaned before receipts were kept
    target_set: str | None = None  # the target set's fingerprint (None: a receipt written before it was named)
    replaced_target_sets: list[str] = []  # sets the cleanup ran with before `retry-failed --with-current-targets`
    follow_ups: list[FollowUpCount] | None = None  # None: no follow-up declared (or before they were kept)
    reminder: Reminder | None


class Failure(Model):
    """A cleanup of the account that failed: where, and with which SQLSTATE (the receipt keeps no error text)."""

    cleanup_version: int
    cleanup_id: str
    target: str | None
    sqlstate: str
    failed_at: datetime
    attempts: int
    resolved_at: datetime | None
    resolution: str | None


class Claim(Model):
    """The cleanup that claimed the account."""

    cleanup_id: str
    claimed_at: datetime | None


class AccountHistory(Model):
    """The erasure receipt of one account: what the service did with its deadline and data."""

    account_id: str
    status: str
    renewal_deadline: datetime
    cleanup_version: int
    held: bool
    claim: Claim | None
    cleaned_at: datetime | None
    events: list[AccountEvent]
    renewals: list[Renewal]
    cleaned: list[Cleaned]
    failures: list[Failure]


async def account_history(pool: asyncpg.Pool, account_id: str) -> AccountHistory:
    check_account_id(account_id)
    async with pool.acquire() as conn, conn.transaction(readonly=True, isolation="repeatable_read"):
        now = await conn.fetchrow(SQL.account_now, account_id)
        if now is None:
            raise InputError(f"unknown account {account_id!r}")
        events = await conn.fetch(SQL.account_events, account_id)
        renewals = await conn.fetch(SQL.account_renewals, account_id)
        cleanups = await conn.fetch(SQL.account_cleanups, account_id)
        failures = await conn.fetch(SQL.account_failures, account_id)
    return AccountHistory(
        account_id=account_id,
        status=now["status"],
        renewal_deadline=now["renewal_deadline"],
        cleanup_version=now["cleanup_version"],
        held=now["held_since"] is not None,
        claim=Claim(cleanup_id=now["claimed_by"], claimed_at=now["claimed_at"]) if now["claimed_by"] else None,
        cleaned_at=now["cleaned_at"],
        events=[AccountEvent.from_row(r) for r in events],
        renewals=[Renewal.from_row(r) for r in renewals],
        cleaned=[_cleaned(r) for r in cleanups],
        failures=[Failure.from_row(r) for r in failures],
    )


def _cleaned(row: asyncpg.Record) -> Cleaned:
    targets: Any = row["targets"]
    if isinstance(targets, str):  # jsonb arrives as text without a codec
        targets = json.loads(targets)
    follow_ups: Any = row["follow_ups"]
    if isinstance(follow_ups, str):
        follow_ups = json.loads(follow_ups)
    reminder = None
    if row["reminder_status"] is not None:
        reminder = Reminder(
            status=row["reminder_status"],
            queued_at=row["reminder_queued_at"],
            delivered_at=row["reminder_delivered_at"],
            attempts=row["reminder_attempts"],
        )
    return Cleaned(
        cleanup_version=row["cleanup_version"],
        cleanup_id=row["cleanup_id"],
        applied_at=row["applied_at"],
        targets=[TargetCount(**t) for t in targets] if targets is not None else None,
        target_set=row["target_set"],
        replaced_target_sets=list(row["replaced_target_sets"] or []),
        follow_ups=[FollowUpCount(**f) for f in follow_ups] if follow_ups is not None else None,
        reminder=reminder,
    )
