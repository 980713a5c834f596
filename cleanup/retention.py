"""Retention: the service's own bookkeeping pruned after CLEANUP_RETENTION_DAYS (docs/deployment.md).

What goes, per account cleaned and cleanup settled before the cutoff (the database's clock less the
retention): its claim, its idempotency record (cleanup_applied), its erasure receipt, its
registration events, renewal attempts and resolved failures, its delivered or dead reminder; then
what is left of each such cleanup (settlement, partition reports, claim progress, target set run);
and the planner's old sweep records. The accounts row stays (status 'cleaned', its version): it is
what answers a late renewal `too_late` and what judges a redelivered batch 'already applied'.

Each batch is one set-based statement in its own transaction of at most `batch` rows per walk,
under the load budget, taken by one worker at a time (an advisory lock held by the transaction).
Run by every worker once a day (`keep_pruning`) and by `deadline-cleanup cleanup prune [--dry-run]`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import datetime
from typing import Any

import asyncpg

from budget.controller import LoadBudget, under_budget
from core import db
from core.model import Model
from core.queries import load

log = logging.getLogger(__name__)
SQL = load(__file__, "retention.sql")

# Rows per statement of each walk: small enough that a batch holds its row locks for well under a
# second, large enough that a day's backlog is a few hundred statements.
PRUNE_BATCH = 10_000
PRUNE_EVERY_SECONDS = 86_400.0
# The statements in the order they run: a cleanup's claims (with its accounts' records) and its
# reminders go before what is left of it, which waits until none of them remains. Each is a query
# (by its name) of :cutoff, :rows and :dry_run.
_STATEMENTS = {
    "claims": ("prune_claims_batch", SQL.prune_claims_batch),
    "outbox": ("prune_outbox_batch", SQL.prune_outbox_batch),
    "cleanups": ("prune_cleanups_batch", SQL.prune_cleanups_batch),
    "sweeps": ("prune_planner_sweeps_batch", SQL.prune_planner_sweeps_batch),
}


class PruneCounts(Model):
    """Rows pruned (or, in a dry run, that would be pruned now) per table, and the cutoff used.
    In a dry run `cleanups` counts the cleanups already emptied; the others follow their claims."""

    cutoff: datetime
    dry_run: bool
    batches: int = 0
    claims: int = 0
    applied: int = 0
    receipts: int = 0
    events: int = 0
    renewals: int = 0
    failures: int = 0
    outbox: int = 0
    cleanups: int = 0
    sweeps: int = 0
    busy: bool = False  # another worker was pruning: this run stopped at once

    def add(self, row: asyncpg.Record) -> PruneCounts:
        found = {key: getattr(self, key) + int(row[key]) for key in row.keys() if key in PruneCounts.model_fields}
        return self.model_copy(update=found | {"batches": self.batches + 1})


async def retention_cutoff(pool: asyncpg.Pool, retention_days: int) -> datetime:
    """The database's clock less the retention: what is older was settled and cleaned before it."""
    return await pool.fetchval(SQL.retention_cutoff, retention_days)  # type: ignore[no-any-return]


async def prune(
    pool: asyncpg.Pool,
    retention_days: int,
    *,
    dry_run: bool = False,
    batch: int = PRUNE_BATCH,
    budget: LoadBudget | None = None,
) -> PruneCounts:
    """Prune what is older than `retention_days` (at least 7: the database refuses a younger cutoff),
    batch by batch until each walk comes back short; `dry_run` counts every row, deleting none."""
    counts = PruneCounts(cutoff=await retention_cutoff(pool, retention_days), dry_run=dry_run)
    if dry_run:
        # One snapshot for every count. Not a read-only transaction: the statements are the pruning
        # ones, whose DELETEs the dry run turns off (`NOT :dry_run`), so they change and lock nothing.
        async with pool.acquire() as conn, db.transaction(conn, isolation="repeatable_read"):
            for query, sql in _STATEMENTS.values():
                walk = SQL.bind(query, cutoff=counts.cutoff, rows=None, dry_run=True)
                counts = counts.add(await conn.fetchrow(sql, *walk))
        return counts
    for name, (query, sql) in _STATEMENTS.items():
        while True:
            walk = SQL.bind(query, cutoff=counts.cutoff, rows=batch, dry_run=False)
            row = await _batch(pool, sql, walk, batch, budget)
            if row is None:
                return counts.model_copy(update={"busy": True})
            counts = counts.add(row)
            if not _more(name, row, batch):
                break
    return counts


def _more(name: str, row: asyncpg.Record, batch: int) -> bool:
    """Whether the walk may have more: a full batch (the outbox's walk: one that deleted anything,
    since rows it may not delete stay in its walk)."""
    if name == "outbox":
        return int(row["deleted"]) > 0
    return int(row[0]) >= batch


async def _batch(
    pool: asyncpg.Pool, sql: str, args: tuple[Any, ...], batch: int, budget: LoadBudget | None
) -> asyncpg.Record | None:
    """One batch of at most `batch` rows (`sql` with its bound `args`) in its own transaction, under
    the load budget; None: another worker prunes."""
    async with under_budget(budget, "retention", batch), pool.acquire() as conn, db.transaction(conn):
        if not await conn.fetchval(SQL.prune_lock):
            return None
        return await conn.fetchrow(sql, *args)


async def keep_pruning(
    pool: asyncpg.Pool, retention_days: int, budget: LoadBudget | None = None, every: float = PRUNE_EVERY_SECONDS
) -> None:
    """A worker's daily retention run, at a random moment of the day (workers apart); a failure is
    logged and the run tried again the next time."""
    while True:
        await asyncio.sleep(every * random.uniform(0.5, 1.0))
        try:
            counts = await prune(pool, retention_days, budget=budget)
        except Exception as err:  # whatever failed (the database away, a bug), the next run tries again
            log.warning("retention run failed, tried again later: %s", err)
            continue
        if counts.batches:
            log.info("retention: pruned %s", counts.model_dump(exclude={"dry_run", "busy"}, mode="json"))
