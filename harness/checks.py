"""What the harness counts in the database after a fault: duplicate side effects and lost work.

Every check is scoped (an account-ID prefix, a business date, a lane's outbox) and reads only the
database (and the mail provider's mailbox, the customer's side of the outbox). Nothing here trusts
what an activity or a workflow reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Any

import asyncpg

from core.queries import load
from demo.mail_provider import MailProvider

SQL = load(__file__)


@dataclass
class Effects:
    duplicates: int = 0
    lost: int = 0
    dead_letters: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def __add__(self, other: Effects) -> Effects:
        return Effects(
            self.duplicates + other.duplicates,
            self.lost + other.lost,
            self.dead_letters + other.dead_letters,
            {**self.details, **other.details},
        )

    def problems(self) -> list[str]:
        return [
            f"{k}={v}" for k, v in self.details.items() if isinstance(v, int) and v and k.startswith(("dup_", "lost_"))
        ]


CLEANUP_EFFECTS = """
WITH a AS (SELECT account_id, status FROM accounts WHERE account_id LIKE $1)
SELECT
  (SELECT count(*) FROM a)::int AS accounts,
  (SELECT count(*) FROM a WHERE status = 'cleaned')::int AS cleaned,
  (SELECT count(*) FROM a WHERE status = 'renewed')::int AS renewed,
  (SELECT count(*) - count(DISTINCT account_id) FROM cleanup_applied WHERE account_id LIKE $1)::int
      AS dup_applied,
  (SELECT count(*) - count(DISTINCT account_id) FROM outbox
     WHERE kind = 'renewal_reminder' AND account_id LIKE $1)::int AS dup_reminders,
  (SELECT count(*) FROM (SELECT 1 FROM demo_game.match_history_archive WHERE account_id LIKE $1
     GROUP BY account_id HAVING count(*) > $2) x)::int AS dup_archived,
  (SELECT count(*) FROM a WHERE status = 'renewed' AND (
      EXISTS (SELECT 1 FROM cleanup_applied c WHERE c.account_id = a.account_id)
      OR EXISTS (SELECT 1 FROM outbox o WHERE o.account_id = a.account_id)))::int AS dup_effect_on_renewed,
  (SELECT count(*) FROM a WHERE status NOT IN ('cleaned', 'renewed'))::int AS lost_not_terminal,
  (SELECT count(*) FROM a WHERE status = 'cleaned' AND NOT EXISTS (
      SELECT 1 FROM cleanup_applied c WHERE c.account_id = a.account_id))::int AS lost_applied_record,
  (SELECT count(*) FROM a WHERE status = 'cleaned' AND NOT EXISTS (
      SELECT 1 FROM outbox o WHERE o.account_id = a.account_id AND o.kind = 'renewal_reminder'))::int
      AS lost_reminder,
  (SELECT count(*) FROM a WHERE status = 'cleaned' AND (
      EXISTS (SELECT 1 FROM demo_game.cloud_saves s WHERE s.account_id = a.account_id)
      OR EXISTS (SELECT 1 FROM demo_game.inventory_items i WHERE i.account_id = a.account_id)
      OR EXISTS (SELECT 1 FROM demo_game.match_history m WHERE m.account_id = a.account_id)))::int AS lost_data_left,
  -- the archive has no index by account: counted in one grouped pass, not read whole per account
  (SELECT count(*) FROM a LEFT JOIN (
      SELECT account_id, count(*) AS n FROM demo_game.match_history_archive WHERE account_id LIKE $1
      GROUP BY account_id) h USING (account_id)
     WHERE a.status = 'cleaned' AND coalesce(h.n, 0) < $2)::int AS lost_archive,
  (SELECT count(*) FROM a WHERE status = 'renewed' AND NOT EXISTS (
      SELECT 1 FROM demo_game.cloud_saves s WHERE s.account_id = a.account_id))::int AS lost_renewed_data
"""


async def cleanup_effects(
    pool: asyncpg.Pool,
    prefix: str,
    *,
    matches_per_account: int,
    expect_cleaned: int | None = None,
    cleanup_ids: list[str] = (),  # type: ignore[assignment]
) -> Effects:
    """Accounts `acct_{prefix}_*`: each in one terminal state, each cleaned one exactly once."""
    row = await pool.fetchrow(CLEANUP_EFFECTS, f"acct_{prefix}_%", matches_per_account)
    assert row is not None
    d = dict(row)
    if expect_cleaned is not None:
        d["lost_expected_cleaned"] = max(0, expect_cleaned - d["cleaned"])
    if cleanup_ids:
        settled = await pool.fetchval(
            "SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = ANY($1::text[])", list(cleanup_ids)
        )
        d["lost_settlement"] = len(cleanup_ids) - int(settled)
    dup = sum(v for k, v in d.items() if k.startswith("dup_"))
    lost = sum(v for k, v in d.items() if k.startswith("lost_"))
    return Effects(dup, lost, 0, d)


LEDGER_EFFECTS = """
SELECT
  (SELECT count(*) - count(DISTINCT idempotency_key) FROM ledger_corrections WHERE business_date = $1)::int
      AS dup_correction_keys,
  (SELECT count(*) - count(DISTINCT (game, payment_id)) FROM ledger_corrections WHERE business_date = $1)::int
      AS dup_corrections_per_payment,
  (SELECT count(*) - count(DISTINCT review_key) FROM ledger_review WHERE business_date = $1)::int AS dup_review,
  -- corrections of every date counted in one grouped pass (no index leads with the payment)
  (SELECT count(*) FROM ledger_payments p LEFT JOIN (
      SELECT game, payment_id, count(*) AS n FROM ledger_corrections GROUP BY game, payment_id) c
      USING (game, payment_id)
     WHERE p.business_date = $1 AND p.version <> 1 + coalesce(c.n, 0))::int AS dup_ledger_version,
  (SELECT count(*) FROM ledger_corrections WHERE business_date = $1)::int AS corrections,
  (SELECT count(*) FROM ledger_review WHERE business_date = $1)::int AS review_rows,
  (SELECT count(*) FROM ledger_settlements WHERE business_date = $1)::int AS settlements,
  (SELECT count(*) FROM ledger_shard_reports WHERE business_date = $1)::int AS shard_reports
"""


async def ledger_effects(
    pool: asyncpg.Pool, business_date: date, *, shards: int, expected_corrections: int, expected_review: int
) -> Effects:
    """One correction (or review row) per payment and date, the ledger version matching, one settlement."""
    row = await pool.fetchrow(LEDGER_EFFECTS, business_date)
    assert row is not None
    d = dict(row)
    d["lost_corrections"] = max(0, expected_corrections - d["corrections"])
    d["dup_corrections_beyond_expected"] = max(0, d["corrections"] - expected_corrections)
    d["lost_review_rows"] = max(0, expected_review - d["review_rows"])
    d["lost_settlement"] = 1 - min(1, d["settlements"])
    d["lost_shard_reports"] = max(0, shards - d["shard_reports"])
    dup = sum(v for k, v in d.items() if k.startswith("dup_"))
    lost = sum(v for k, v in d.items() if k.startswith("lost_"))
    return Effects(dup, lost, 0, d)


async def outbox_effects(pool: asyncpg.Pool, provider: MailProvider, *, expect_dead: int = 0) -> Effects:
    """Every outbox row of the lane delivered once to the customer; none pending, lost or doubled."""
    rows = await pool.fetch("SELECT event_key, status FROM outbox")
    keys = {r["event_key"] for r in rows}
    messages = [m for m in provider.messages() if m["idempotency_key"] in keys]
    mailbox = [m["idempotency_key"] for m in messages]
    recipients = [(m["account_id"], m["kind"]) for m in messages]
    absorbed = provider.stats()["duplicates_by_key"]
    delivered = {r["event_key"] for r in rows if r["status"] == "delivered"}
    d: dict[str, Any] = {
        "events": len(rows),
        "delivered": len(delivered),
        "resends_absorbed_by_key": sum(n for k, n in absorbed.items() if k in keys),
        "dup_mailbox": len(mailbox) - len(set(mailbox)),
        "dup_customer_messages": len(recipients) - len(set(recipients)),
        "lost_pending": sum(1 for r in rows if r["status"] == "pending"),
        "lost_not_in_mailbox": len(delivered - set(mailbox)),
        "dead": sum(1 for r in rows if r["status"] == "dead"),
    }
    dup = d["dup_mailbox"] + d["dup_customer_messages"]
    lost = d["lost_pending"] + d["lost_not_in_mailbox"] + max(0, d["dead"] - expect_dead)
    return Effects(dup, lost, d["dead"], d)


async def dead_letters(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'dead'"))


async def inject_duplicate(pool: asyncpg.Pool, prefix: str) -> str:
    """The deliberately broken invariant (`--inject-violation`): a second reminder for a cleaned account.

    Written straight into the database, as a buggy activity would; the checks must catch it.
    """
    account = await pool.fetchval(
        "SELECT account_id FROM accounts WHERE account_id LIKE $1 AND status = 'cleaned' ORDER BY 1 LIMIT 1",
        f"acct_{prefix}_%",
    )
    assert account is not None, "nothing cleaned to duplicate"
    await pool.execute(
        "INSERT INTO outbox (event_key, kind, account_id, source_id, payload, status, delivered_at) "
        "VALUES ($1, 'renewal_reminder', $2, 'injected-violation', '{}'::jsonb, 'delivered', now())",
        f"renewal-reminder:{account}:injected",
        account,
    )
    return str(account)


LEDGER_TABLES = {
    "ledger_payments": "game, payment_id",
    "ledger_corrections": "idempotency_key",
    "ledger_review": "review_key",
    "ledger_shard_reports": "business_date, shard",
    "ledger_settlements": "business_date",
    "ledger_settlement_revisions": "business_date, revision",
}


# What a cleanup writes (the accounts' state, its effects, the reminders it queues, its reports).
CLEANUP_TABLES = {
    "accounts": "account_id",
    "cleanup_claims": "cleanup_id, account_id",
    "cleanup_applied": "account_id, cleanup_version",
    "cleanup_failed": "account_id, cleanup_version",
    "cleanup_partition_reports": "cleanup_id, partition_no",
    "cleanup_settlements": "cleanup_id",
    "demo_game.cloud_saves": "account_id, slot",
    "demo_game.inventory_items": "account_id, item_id",
    "demo_game.match_history_archive": "match_id",
    "outbox": "event_key",
}
# What a relay writes: each event's state, attempts, lease and outcome.
OUTBOX_TABLES = {"outbox": "event_key"}


async def ledger_digest(pool: asyncpg.Pool, tables: dict[str, str] | None = None) -> dict[str, Any]:
    """Row counts and an md5 of every row of each table the reconciliation (or, with `tables`,
    another job) writes: equal digests mean nothing was written in between."""
    out: dict[str, Any] = {}
    for table, order in (tables or LEDGER_TABLES).items():
        row = await pool.fetchrow(
            f"SELECT count(*) AS n, md5(coalesce(string_agg(t::text, '|' ORDER BY {order}), '')) AS h FROM {table} t"
        )
        assert row is not None
        out[table] = (row["n"], row["h"])
    return out


@dataclass
class Ordering:
    """Ordering violations of one lane: each rule's count (`ord_*`), 0 when the order held."""

    violations: int = 0
    details: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: Ordering) -> Ordering:
        merged = dict(self.details)
        for k, v in other.details.items():
            merged[k] = merged.get(k, 0) + v
        return Ordering(self.violations + other.violations, merged)

    def problems(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.details.items() if v]


def mailbox_order(messages: list[dict[str, Any]], reminders: list[asyncpg.Record]) -> dict[str, int]:
    """The customer's side: per account, reminders received in version order, the last one the latest.

    `messages` is the provider's mailbox in the order it received them (it only appends, so an
    earlier message never replaces a later one); `reminders` are the lane's outbox reminders with
    the version each was written for and the account's own version and state.
    """
    by_key = {r["event_key"]: r for r in reminders if r["version"] is not None}
    highest: dict[str, int] = {}
    last: dict[str, int] = {}
    out_of_order: set[str] = set()
    for m in messages:
        r = by_key.get(m["idempotency_key"])
        if r is None:
            continue
        account, version = str(r["account_id"]), int(r["version"])
        if version < highest.get(account, version):
            out_of_order.add(account)
        highest[account] = max(highest.get(account, version), version)
        last[account] = version
    accounts = {str(r["account_id"]): r for r in reminders}
    stale_last = [
        a for a, v in last.items() if accounts[a]["account_status"] == "cleaned" and v != accounts[a]["account_version"]
    ]
    return {"ord_provider_out_of_order": len(out_of_order), "ord_provider_last_not_latest": len(stale_last)}


async def ordering_effects(pool: asyncpg.Pool, provider: MailProvider) -> Ordering:
    """Every ordering rule over a lane's whole database, and its reminders at the provider."""
    row = await pool.fetchrow(SQL.ordering_violations)
    assert row is not None
    details = {k: int(v) for k, v in dict(row).items()}
    details |= mailbox_order(provider.messages(), await pool.fetch(SQL.reminder_versions))
    return Ordering(sum(details.values()), details)


async def inject_ordering_violation(pool: asyncpg.Pool, business_date: date) -> int:
    """The deliberately broken order (`--inject-ordering-violation`): a settlement revision of the
    date stamped before the revision it follows. Written straight into the database; the ordering
    checks must catch it."""
    revision = await pool.fetchval(SQL.inject_revision_out_of_order, business_date)
    assert revision is not None, f"{business_date} has no settlement revision to follow"
    return int(revision)
