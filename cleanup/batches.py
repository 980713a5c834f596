"""Running the compiled cleanup statement: keyset batches, and isolating the accounts that fail.

A batch is one transaction over up to `batch_size` accounts: the set-based batch statement over
at most `STATEMENT_ACCOUNTS` of them at a time, then one COMMIT. When it fails:

- transiently (connection lost, serialization failure, deadlock, lock or statement timeout,
  shutdown: not core.errors.is_deterministic), the error propagates and Temporal retries the activity as
  before; every committed batch is absorbed by the idempotency record on the retry;
- deterministically (a constraint, a trigger that raises, a value the archive table refuses:
  core.errors.is_deterministic), the batch is bisected: each half runs as the same set-based
  statement in its own transaction, halves that fail are split again, down to single accounts.
  Each account that still fails alone is recorded in `cleanup_failed` (with the database's message
  and SQLSTATE, and the target table when it can be told) and marked 'cleanup_failed'; its own
  statement rolled back, so nothing of its cleanup is applied. Every other account is cleaned.

With k bad accounts in a batch of n this costs O(k log n) statements, one per account only for the
isolated ones. Shared by the cleanup activity and by `cleanup retry` (cleanup.review).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import asyncpg

from cleanup.anonymize_key import store_key
from cleanup.errors import AccountCleanupFailed
from cleanup.follow_ups import CompiledFollowUp, failed_follow_up, run_phase
from cleanup.models import PartitionCounts
from cleanup.target_check import TargetsRefused, check_follow_ups, plan_targets, read_catalog
from cleanup.target_report import MissingIndex, missing_indexes
from cleanup.targets import (
    CleanupTargets,
    anonymize_key_pads,
    compile_partition_batch,
    compile_preview,
    compile_target_probes,
    judge_statement,
    subset_statement,
)
from core import db, failpoints
from core.config import CleanupSettings
from core.errors import is_deterministic, is_schema_error, sqlstate_of
from core.heartbeat import run_heartbeating
from core.queries import load

log = logging.getLogger(__name__)

# Attempts of the targets' start-up check when its connection is lost under it (a restarting
# database, a transaction ended by idle_in_transaction_session_timeout on a starved machine).
COMPILE_ATTEMPTS = 3

SQL = load(__file__)
IN_BATCH = "cleanup_partition.in_batch"  # failpoint inside each keyset batch's transaction
# The most accounts one batch statement takes. The statement materializes every data-modifying CTE
# (the archived rows, the deleted rows' counts, the keys' arrays), so its working set grows with its
# accounts: a batch larger than this is one transaction of statements of this size, so the batch size
# changes the number of COMMITs only (docs/decisions/0015-statement-size.md).
STATEMENT_ACCOUNTS = 1000
DEFAULT_SETTINGS = CleanupSettings()
_QUOTED_TABLE = re.compile(r'table "([^"]+)"')


# The reminders' switch in the batch and dry-run statements (cleanup/queries.sql): on as written.
REMINDERS_ON = "/*reminders*/true"


def with_reminders(sql: str, on: bool) -> str:
    """`sql` with the reminders switched `on` or off (CLEANUP_REMINDERS). Off, the reminders' rows
    are filtered out by a constant `false`: one statement text for every worker with the same
    settings, whose `reminders` count is 0 (the settlement counts the outbox rows: 0 as well)."""
    if REMINDERS_ON not in sql:
        raise ValueError("the statement has no reminders switch")
    return sql if on else sql.replace(REMINDERS_ON, "false")


@dataclass(frozen=True)
class CompiledCleanup:
    """The declared targets compiled against the live schema, once per process.

    `fingerprint`: the target set's (None: compiled without targets)."""

    batch_sql: str
    subset_sql: str
    probes: tuple[tuple[str, str], ...] = ()
    tables: frozenset[str] = field(default_factory=frozenset)
    fingerprint: str | None = None
    missing_indexes: tuple[MissingIndex, ...] = ()  # reported, not refused (cleanup.target_report)
    follow_ups: tuple[CompiledFollowUp, ...] = ()  # run in each batch's transaction (cleanup.follow_ups)
    follow_up_tables: tuple[tuple[str, ...], ...] = ()  # per follow-up, the tables its plan names
    # What it was compiled with (the anonymize key, the reminders): another target set a cleanup
    # recorded is compiled with the same.
    settings: CleanupSettings = field(default_factory=CleanupSettings)

    @classmethod
    def from_batch_sql(cls, batch_sql: str) -> CompiledCleanup:
        """Without the targets (e.g. the benchmark): failures are isolated, targets not probed."""
        return cls(batch_sql=batch_sql, subset_sql=subset_statement(batch_sql))

    @classmethod
    async def compile(
        cls, pool: asyncpg.Pool, targets: CleanupTargets, settings: CleanupSettings = DEFAULT_SETTINGS
    ) -> CompiledCleanup:
        """Check the declared targets against the live schema, compile them, and run every compiled
        statement once in a rolled-back transaction under this pool's role: what passes here cannot
        fail alike for every account at the deadline. Raises TargetsRefused naming target and fix.
        A lost connection refuses nothing: the check runs again on a new one (a few times, then the
        loss is raised as it is). `settings`: the anonymize key (for targets that hash) and the
        reminders' switch (the worker's `settings.cleanup`)."""
        secret = settings.anonymize_key
        key = (secret.get_secret_value() if secret else "") if targets.hashes else None
        try:
            if key is not None:
                anonymize_key_pads(key)
        except ValueError as err:
            raise TargetsRefused([str(err)]) from None
        for attempt in range(1, COMPILE_ATTEMPTS + 1):
            try:
                return await cls._compile_on(pool, targets, key, settings)
            except Exception as err:
                if attempt == COMPILE_ATTEMPTS or not db.connection_lost(err):
                    raise
                log.warning("the targets' start-up check lost its database connection (%s); checking again", err)
                await asyncio.sleep(attempt)
        raise AssertionError("unreachable")

    @classmethod
    async def _compile_on(
        cls, pool: asyncpg.Pool, targets: CleanupTargets, key: str | None, settings: CleanupSettings
    ) -> CompiledCleanup:
        reminders = settings.reminders
        async with pool.acquire() as conn:
            if key is not None:
                await store_key(conn, key)  # before the trial: the statements read it from the table
            catalog = await read_catalog(conn, targets)
            plans = plan_targets(targets, catalog)
            follow_ups = await check_follow_ups(conn, targets)
            batch_sql = with_reminders(compile_partition_batch(targets, plans), reminders)
            compiled = cls(
                batch_sql=batch_sql,
                subset_sql=subset_statement(batch_sql),
                probes=tuple(compile_target_probes(targets, plans)),
                tables=frozenset(t.table for t in targets.target)
                | frozenset(t.archive_table for t in targets.target if t.archive_table),
                fingerprint=targets.fingerprint,
                missing_indexes=tuple(missing_indexes(targets, catalog)),
                follow_ups=tuple(f.follow_up for f in follow_ups),
                follow_up_tables=tuple(f.tables for f in follow_ups),
                settings=settings,
            )
            preview = with_reminders(compile_preview(targets, plans, "account"), reminders)
            await compiled._trial(conn, targets, preview)
        return compiled

    async def _trial(self, conn: asyncpg.Connection, targets: CleanupTargets, preview_sql: str) -> None:
        """Run each statement on no account (an unknown cleanup), then roll back: its types, columns
        and this role's privileges are checked as at the deadline."""
        on_no_account = self.batch_args(cleanup_id="", partition_no=0, after_account_id="", batch_size=1)
        on_none = self.subset_args(cleanup_id="", partition_no=0, account_ids=[])
        runs: list[tuple[str, str, tuple[object, ...]]] = [
            ("the batch statement", self.batch_sql, on_no_account),
            ("the subset statement", self.subset_sql, on_none),
            ("the dry-run statement", preview_sql, ("",)),
        ]
        if self.follow_ups:
            runs += [
                ("the batch's judgement", judge_statement(self.batch_sql), on_no_account),
                ("the subset's judgement", judge_statement(self.subset_sql), on_none),
            ]
        # A probe's key is cast to its column's type, which no placeholder account fits: EXPLAIN
        # parses, plans and checks privileges without running it.
        runs += [(f"target {table}", "EXPLAIN " + sql, ("",)) for table, sql in self.probes]
        for what, sql, args in runs:
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.fetch(sql, *args)
            except asyncpg.PostgresError as err:
                if db.connection_lost(err):
                    raise  # the connection's fault, not the target's (compile checks again)
                raise TargetsRefused([_trial_problem(what, targets, err)]) from None
            finally:
                if not conn.is_closed():
                    await tx.rollback()

    def args(self, *params: object) -> tuple[object, ...]:
        """A target probe's arguments (its one account)."""
        return params

    def batch_args(
        self, *, cleanup_id: str, partition_no: int, after_account_id: str, batch_size: int
    ) -> tuple[object, ...]:
        """The keyset batch statement's arguments: the `batch_size` claimed accounts after
        `after_account_id`."""
        return SQL.bind(
            "cleanup_partition_batch",
            cleanup_id=cleanup_id,
            partition_no=partition_no,
            after_account_id=after_account_id,
            batch_size=batch_size,
        )

    def subset_args(self, *, cleanup_id: str, partition_no: int, account_ids: Sequence[str]) -> tuple[object, ...]:
        """The subset statement's arguments: these accounts in the place of the keyset's cursor."""
        return SQL.bind(
            "cleanup_partition_batch",
            cleanup_id=cleanup_id,
            partition_no=partition_no,
            after_account_id=list(account_ids),
            batch_size=len(account_ids),
        )

    async def run(
        self, conn: asyncpg.Connection, sql: str, args: tuple[object, ...], waited: list[float] | None = None
    ) -> asyncpg.Record:
        """Run the batch statement `sql` (either form) with `args` in the caller's transaction, with
        the follow-ups around it: "before" on the accounts it is about to clean (judged and locked by
        the same verdicts), "after" on those it cleaned; then its receipts, with their counts. Batches
        with follow-ups run one at a time (an advisory lock to COMMIT: docs/decisions/0016); the
        seconds spent waiting for it are appended to `waited`."""
        if not self.follow_ups:
            row = await conn.fetchrow(sql, *args)
            assert row is not None
            return row
        started = time.perf_counter()
        await conn.execute(SQL.follow_up_batches_one_at_a_time)  # held to COMMIT; again: a no-op
        if waited is not None:
            waited.append(time.perf_counter() - started)
        judged: list[str] = []
        counts: list[dict[str, object]] = []
        before = any(f.phase == "before" for f in self.follow_ups)
        if before:
            judged = list(await conn.fetchval(judge_statement(sql), *args))
            counts += await run_phase(conn, self.follow_ups, "before", judged)
        row = await conn.fetchrow(sql, *args)
        assert row is not None
        applied = list(row["applied_keys"])
        if before and applied != judged:
            # The accounts are locked from the judgement on, so their verdicts stay; a claim committed
            # in between could change the batch: retried as a whole (transient), never half-followed.
            raise FollowUpsOutOfStep("the batch changed between its before follow-ups and its targets")
        counts += await run_phase(conn, self.follow_ups, "after", applied)
        if applied:
            await conn.execute(
                SQL.insert_deferred_receipts,
                *SQL.bind(
                    "insert_deferred_receipts",
                    receipts=row["receipts"],
                    cleanup_id=args[0],
                    fingerprint=self.fingerprint,
                    follow_ups=json.dumps(counts),
                ),
            )
        return row


def _trial_problem(what: str, targets: CleanupTargets, err: asyncpg.PostgresError) -> str:
    """A trial failure as a problem naming the target (by the table the error names) and its fix."""
    table = getattr(err, "table_name", None)
    named = [t.label for t in targets.target if t.schema_table[1] == table or t.archive_table == table]
    where = f"target {named[0]}" if named else what
    fix = (
        "GRANT the privilege named to the worker's role" if err.sqlstate == "42501" else "fix the schema or the target"
    )
    column = getattr(err, "column_name", None)
    return f"{where}{f' column {column!r}' if column else ''}: [{err.sqlstate}] {err} ({what}; fix: {fix})"


class FollowUpsOutOfStep(Exception):
    """A batch whose accounts changed between its before follow-ups and its targets (not an account's
    fault: no SQLSTATE, so the batch is retried, not isolated)."""


@dataclass(frozen=True)
class Pulse:
    """How a slow batch shows it is alive: `beat` is called every `interval` seconds while one of its
    statements runs (blocked on a row lock, say) and after each statement of a bisection, so it is
    not taken for a dead worker. The default beats nowhere."""

    beat: Callable[[], None] | None = None
    interval: float = 5.0


@dataclass
class BatchResult:
    """One keyset batch: `batch_rows` accounts of the `batch_size` it asked for (fewer: the
    partition's last accounts so far)."""

    counts: PartitionCounts
    batch_rows: int
    batch_size: int
    last_account_id: str
    failures: list[AccountCleanupFailed] = field(default_factory=list)
    # Waiting for another batch's follow-ups (their lock): not the database's work, so not the
    # batch's latency the load budget reads as stress (budget.controller.Grant.idle_seconds).
    follow_up_lock_seconds: float = 0.0


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
    *,
    pulse: Pulse = Pulse(),
    schema_errors_final: bool = False,
) -> BatchResult:
    """One keyset batch: statements of at most `STATEMENT_ACCOUNTS` accounts, walking on from the
    last account of the one before, and one COMMIT for all of them; bisected (as a whole: nothing of
    it committed) only if it fails deterministically.

    `pulse` keeps a slow batch heartbeating (Pulse). With `schema_errors_final` (the attempts
    allowed for a schema or privilege error, SQLSTATE class 42, are spent), such an error records
    every account of the batch in cleanup_failed with it, instead of being retried again: the
    cleanup then shows them as failed, never 'cleaning' unseen.
    """
    counts, rows, last = PartitionCounts(), 0, after_account_id
    waited: list[float] = []
    try:
        async with pool.acquire() as conn, db.transaction(conn):
            failpoints.hit(IN_BATCH)  # the batch is open: its transaction begun, its statement not yet sent
            while rows < batch_size:
                step = min(STATEMENT_ACCOUNTS, batch_size - rows)
                args = compiled.batch_args(
                    cleanup_id=cleanup_id, partition_no=partition_no, after_account_id=last, batch_size=step
                )
                row = await run_heartbeating(
                    compiled.run(conn, compiled.batch_sql, args, waited), pulse.beat, pulse.interval
                )
                counts, rows = counts + counts_of(row), rows + row["batch_rows"]
                last = row["last_account_id"] or last
                if row["batch_rows"] < step:
                    break  # the partition's last accounts
    except Exception as err:
        surfaced = schema_errors_final and is_schema_error(err)
        if not (is_deterministic(err) or surfaced):
            raise  # transient: Temporal retries the activity, committed batches are absorbed
        batch = SQL.bind(
            "batch_accounts",
            cleanup_id=cleanup_id,
            partition_no=partition_no,
            after_account_id=after_account_id,
            batch_size=batch_size,
        )
        ids = [r["account_id"] for r in await pool.fetch(SQL.batch_accounts, *batch)]
        if not ids:
            raise
        failures: list[AccountCleanupFailed] = []
        if surfaced:  # the schema or a privilege, alike for every account: recorded, not bisected
            failed = await _record_failures(pool, cleanup_id, partition_no, ids, err, _follow_up_target(err))
            failures += failed
            counts = PartitionCounts(failed=len(failed))
            return BatchResult(counts, len(ids), batch_size, ids[-1], failures)
        counts = await _isolate(pool, compiled, cleanup_id, partition_no, ids, err, failures, pulse.beat)
        return BatchResult(counts, len(ids), batch_size, ids[-1], failures)
    return BatchResult(counts, rows, batch_size, last, follow_up_lock_seconds=sum(waited))


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
        subset = compiled.subset_args(cleanup_id=cleanup_id, partition_no=partition_no, account_ids=account_ids)
        row = await compiled.run(conn, compiled.subset_sql, subset)
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
    target = (
        _follow_up_target(error)
        or _target_from_error(error, compiled)
        or await _probe_target(pool, compiled, account_id)
    )
    failed = await _record_failures(pool, cleanup_id, partition_no, [account_id], error, target)
    return failed[0] if failed else None


def _follow_up_target(error: BaseException) -> str | None:
    """How a failure record names the follow-up statement an error came from (`follow_up <name>`)."""
    name = failed_follow_up(error)
    return f"follow_up {name}" if name else None


async def _record_failures(
    pool: asyncpg.Pool,
    cleanup_id: str,
    partition_no: int,
    account_ids: list[str],
    error: BaseException,
    target: str | None,
) -> list[AccountCleanupFailed]:
    """Record these claimed accounts as failed with `error` (one statement); those no longer ours
    to clean (renewed meanwhile, ...) are left out."""
    sqlstate = sqlstate_of(error) or "?????"
    message, detail = failure_reason(error)
    rows = await pool.fetch(
        SQL.record_failed,
        *SQL.bind(
            "record_failed",
            cleanup_id=cleanup_id,
            partition_no=partition_no,
            account_ids=account_ids,
            target=target,
            sqlstate=sqlstate,
            message=message,
            detail=detail,
        ),
    )
    return [AccountCleanupFailed(r["account_id"], sqlstate, message, target) for r in rows]


def failure_reason(error: BaseException) -> tuple[str, str | None]:
    """What an isolated account's failure keeps: the error's condition (from its SQLSTATE, e.g.
    "foreign key violation") and the constraint, table and column it names. Never its message or
    DETAIL: a game's trigger can raise any text (an e-mail), and "Failing row contains (...)" or
    "Key (...)=(...)" hold the data the cleanup was to delete."""
    names = [
        f'{kind} "{value}"'
        for kind, value in (
            ("constraint", getattr(error, "constraint_name", None)),
            ("table", getattr(error, "table_name", None)),
            ("column", getattr(error, "column_name", None)),
        )
        if value
    ]
    return condition_name(error), "; ".join(names) or None


def condition_name(error: BaseException) -> str:
    """The error's condition in words, from its class (asyncpg names one per SQLSTATE), never its text."""
    if not isinstance(error, asyncpg.PostgresError):
        return "error"
    if error.sqlstate == "P0001":
        return "raised by a trigger or function"
    name = type(error).__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def _target_from_error(error: BaseException, compiled: CompiledCleanup) -> str | None:
    """The declared table the error names: its table field, else the first declared table quoted in
    its message (a foreign key from another table names the target first)."""
    table = getattr(error, "table_name", None)
    if table:
        found = _declared(str(table), getattr(error, "schema_name", None), compiled.tables)
        if found:
            return found
    for name in _QUOTED_TABLE.findall(str(getattr(error, "message", None) or error)):
        found = _declared(name, None, compiled.tables)
        if found:
            return found
    return None


def _declared(table: str, schema: str | None, tables: frozenset[str]) -> str | None:
    """The declared name (schema-qualified or not) of a table an error names without its schema."""
    for candidate in ([f"{schema}.{table}"] if schema else []) + [table]:
        if candidate in tables:
            return candidate
    same_name = [t for t in tables if t.rsplit(".", 1)[-1] == table]
    return same_name[0] if len(same_name) == 1 else None


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
                        await conn.execute(statement, *compiled.args(account_id))
                except Exception as err:
                    if is_deterministic(err):
                        return table
                    return None
        finally:
            await tx.rollback()
    return None
