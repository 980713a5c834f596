"""Running the compiled cleanup statement: keyset batches, and isolating the accounts that fail.

A batch is one transaction over up to `batch_size` accounts: the set-based batch statement over
at most `STATEMENT_ACCOUNTS` of them at a time, then one COMMIT. When it fails:

- transiently (connection lost, serialization failure, deadlock, lock or statement timeout,
  shutdown: core.errors.is_transient), the error propagates and Temporal retries the activity as
  before; every committed batch is absorbed by the idempotency record on the retry;
- deterministically (a constraint, a trigger that raises, a value the archive table refuses:
  core.errors.is_deterministic), the batch is bisected: each half runs as the same set-based
  statement in its own transaction, halves that fail are split again, down to single accounts.
  Each account that still fails alone is recorded in `cleanup_failed` (with the database's message
  and SQLSTATE, and the target table when it can be told) and marked 'cleanup_failed'; its own
  statement rolled back, so nothing of its cleanup is applied. Every other account is cleaned.

With k bad accounts in a batch of n this costs O(k log n) statements, one per account only for the
isolated ones. Shared by the cleanup activity and by `retry-failed` (cleanup.review).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import asyncpg

from cleanup.errors import AccountCleanupFailed
from cleanup.models import PartitionCounts
from cleanup.targets import (
    SCHEMA_CHECK,
    CleanupTargets,
    check_against_schema,
    compile_partition_batch,
    compile_target_probes,
    subset_statement,
)
from core import db, failpoints
from core.errors import is_deterministic, sqlstate_of
from core.heartbeat import run_heartbeating
from core.queries import load

SQL = load(__file__)
IN_BATCH = "cleanup_partition.in_batch"  # failpoint inside each keyset batch's transaction
# The most accounts one batch statement takes. The statement materializes every data-modifying CTE
# (the archived rows, the deleted rows' counts, the keys' arrays), so its working set grows with
# its accounts; at 5,000 the same buffers and WAL per account cost ~5-10% more time per account
# once every partition ran such statements at once (BENCHMARKS.md, run BI). A larger batch is a
# larger transaction (fewer COMMITs and budget grants), made of statements of this size.
STATEMENT_ACCOUNTS = 1000
_QUOTED_TABLE = re.compile(r'table "([^"]+)"')


@dataclass(frozen=True)
class CompiledCleanup:
    """The declared targets compiled against the live schema, once per process."""

    batch_sql: str
    subset_sql: str
    probes: tuple[tuple[str, str], ...] = ()
    tables: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_batch_sql(cls, batch_sql: str) -> CompiledCleanup:
        """Without the targets (e.g. the benchmark): failures are isolated, targets not probed."""
        return cls(batch_sql=batch_sql, subset_sql=subset_statement(batch_sql))

    @classmethod
    async def compile(cls, pool: asyncpg.Pool, targets: CleanupTargets) -> CompiledCleanup:
        """Check the declared targets against the live schema, then compile them."""
        tables = [t.table for t in targets.target] + [t.archive_table for t in targets.target if t.archive_table]
        rows = await pool.fetch(SCHEMA_CHECK, tables)
        columns = {r["table_name"]: list(r["columns"]) for r in rows}
        check_against_schema(targets, columns)
        batch_sql = compile_partition_batch(targets, columns)
        return cls(
            batch_sql=batch_sql,
            subset_sql=subset_statement(batch_sql),
            probes=tuple(compile_target_probes(targets, columns)),
            tables=frozenset(tables),
        )


@dataclass
class BatchResult:
    counts: PartitionCounts
    batch_rows: int
    last_account_id: str
    failures: list[AccountCleanupFailed] = field(default_factory=list)


def counts_of(row: asyncpg.Record) -> PartitionCounts:
    return PartitionCounts(
        cleaned=row["cleaned"],
        skipped_renewed=row["skipped_renewed"],
        skipped_stale=row["skipped_stale"],
        already_applied=row["already_applied"],
    )


async def run_keyset_batch(
    pool: asyncpg.Pool,
    compiled: CompiledCleanup,
    cleanup_id: str,
    partition_no: int,
    after_account_id: str,
    batch_size: int,
    while_waiting: Callable[[], None] | None = None,
    wait_interval: float = 5.0,
) -> BatchResult:
    """One keyset batch: statements of at most `STATEMENT_ACCOUNTS` accounts, walking on from the
    last account of the one before, and one COMMIT for all of them; bisected (as a whole: nothing of
    it committed) only if it fails deterministically.

    `while_waiting` is called every `wait_interval` seconds while a statement runs (e.g. blocked
    on a row lock) and after each statement of a bisection, so a slow batch keeps heartbeating.
    """
    counts, rows, last = PartitionCounts(), 0, after_account_id
    try:
        async with pool.acquire() as conn, db.transaction(conn):
            failpoints.hit(IN_BATCH)  # the batch is open: its transaction begun, its statement not yet sent
            while rows < batch_size:
                step = min(STATEMENT_ACCOUNTS, batch_size - rows)
                row = await run_heartbeating(
                    conn.fetchrow(compiled.batch_sql, cleanup_id, partition_no, last, step),
                    while_waiting,
                    wait_interval,
                )
                assert row is not None
                counts, rows = counts + counts_of(row), rows + row["batch_rows"]
                last = row["last_account_id"] or last
                if row["batch_rows"] < step:
                    break  # the partition's last accounts
    except Exception as err:
        if not is_deterministic(err):
            raise  # transient: Temporal retries the activity, committed batches are absorbed
        ids = [
            r["account_id"]
            for r in await pool.fetch(SQL.batch_accounts, cleanup_id, partition_no, after_account_id, batch_size)
        ]
        if not ids:
            raise
        failures: list[AccountCleanupFailed] = []
        counts = await _isolate(pool, compiled, cleanup_id, partition_no, ids, err, failures, while_waiting)
        return BatchResult(counts=counts, batch_rows=len(ids), last_account_id=ids[-1], failures=failures)
    return BatchResult(counts=counts, batch_rows=rows, last_account_id=last)


async def run_subset(
    pool: asyncpg.Pool,
    compiled: CompiledCleanup,
    cleanup_id: str,
    partition_no: int,
    account_ids: Sequence[str],
    on_step: Callable[[], None] | None = None,
) -> tuple[PartitionCounts, list[AccountCleanupFailed]]:
    """Clean an explicit set of claimed accounts (one statement), isolating those that fail."""
    failures: list[AccountCleanupFailed] = []
    if not account_ids:
        return PartitionCounts(), failures
    try:
        counts = await _subset(pool, compiled, cleanup_id, partition_no, account_ids)
    except Exception as err:
        if not is_deterministic(err):
            raise
        counts = await _isolate(pool, compiled, cleanup_id, partition_no, list(account_ids), err, failures, on_step)
    return counts, failures


async def _subset(
    pool: asyncpg.Pool, compiled: CompiledCleanup, cleanup_id: str, partition_no: int, account_ids: Sequence[str]
) -> PartitionCounts:
    async with pool.acquire() as conn, db.transaction(conn):
        row = await conn.fetchrow(compiled.subset_sql, cleanup_id, partition_no, list(account_ids), len(account_ids))
    assert row is not None
    return counts_of(row)


async def _isolate(
    pool: asyncpg.Pool,
    compiled: CompiledCleanup,
    cleanup_id: str,
    partition_no: int,
    account_ids: list[str],
    error: BaseException,
    failures: list[AccountCleanupFailed],
    on_step: Callable[[], None] | None,
) -> PartitionCounts:
    """`account_ids` failed together with `error` (deterministic): split in halves, run each, recurse
    into the halves that fail, record the single accounts that still fail."""
    if len(account_ids) == 1:
        failure = await _record_failure(pool, compiled, cleanup_id, partition_no, account_ids[0], error)
        if failure is None:  # no longer ours to clean (renewed meanwhile, ...): judge it normally
            return await _subset(pool, compiled, cleanup_id, partition_no, account_ids)
        failures.append(failure)
        return PartitionCounts(failed=1)
    mid = len(account_ids) // 2
    total = PartitionCounts()
    for half in (account_ids[:mid], account_ids[mid:]):
        try:
            total = total + await _subset(pool, compiled, cleanup_id, partition_no, half)
        except Exception as err:
            if not is_deterministic(err):
                raise
            total = total + await _isolate(pool, compiled, cleanup_id, partition_no, half, err, failures, on_step)
        if on_step is not None:
            on_step()
    return total


async def _record_failure(
    pool: asyncpg.Pool,
    compiled: CompiledCleanup,
    cleanup_id: str,
    partition_no: int,
    account_id: str,
    error: BaseException,
) -> AccountCleanupFailed | None:
    sqlstate = sqlstate_of(error) or "?????"
    message = str(getattr(error, "message", None) or error)
    detail = getattr(error, "detail", None)
    target = _target_from_error(error, compiled) or await _probe_target(pool, compiled, account_id)
    row = await pool.fetchrow(
        SQL.record_failed, cleanup_id, partition_no, account_id, target, sqlstate, message, detail
    )
    if row is None or row["failed"] == 0:
        return None
    return AccountCleanupFailed(account_id, sqlstate, message, target)


def _target_from_error(error: BaseException, compiled: CompiledCleanup) -> str | None:
    """The declared table the error names: its table field, else the first declared table quoted in
    its message (a foreign key from another table names the target first)."""
    table = getattr(error, "table_name", None)
    if table in compiled.tables:
        return str(table)
    for name in _QUOTED_TABLE.findall(str(getattr(error, "message", None) or error)):
        if name in compiled.tables:
            return str(name)
    return None


async def _probe_target(pool: asyncpg.Pool, compiled: CompiledCleanup, account_id: str) -> str | None:
    """Run each target's action for this one account, in a transaction that is rolled back; the
    first that fails deterministically is the target (e.g. a trigger that raises names no table)."""
    if not compiled.probes:
        return None
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            for table, statement in compiled.probes:
                try:
                    async with conn.transaction():  # a savepoint
                        await conn.execute(statement, account_id)
                except Exception as err:
                    if is_deterministic(err):
                        return table
                    return None
        finally:
            await tx.rollback()
    return None
