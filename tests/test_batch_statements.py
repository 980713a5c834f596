"""A batch larger than one statement's accounts is still one transaction, all or nothing.

`cleanup.batches.STATEMENT_ACCOUNTS` bounds what one batch statement takes (its materialized
working set grows with its accounts); a batch of more accounts runs several statements and one
COMMIT. Real Postgres: the statement's executions are counted by Postgres (`pg_prepared_statements`
of the connection), the transaction by the rows' `xmin`.
"""

from __future__ import annotations

import asyncpg

from cleanup.batches import STATEMENT_ACCOUNTS, CompiledCleanup, run_keyset_batch
from cleanup.targets import load_targets
from core import db
from tests.helpers import claim_one_partition, deadline_in, effect_counts, seed
from tests.test_cleanup_poison import poison_by_trigger

BATCH = 2 * STATEMENT_ACCOUNTS + STATEMENT_ACCOUNTS // 2  # three statements: full, full, half
TAIL = 100


async def claimed_cohort(pool: asyncpg.Pool, cleanup_id: str, accounts: int) -> list[str]:
    deadline = deadline_in(-60)
    ids = await seed(pool, deadline, accounts)
    await claim_one_partition(pool, cleanup_id, deadline)
    return ids


async def executions(one: asyncpg.Pool, sql: str) -> int:
    return int(
        await one.fetchval("SELECT custom_plans + generic_plans FROM pg_prepared_statements WHERE statement = $1", sql)
        or 0
    )


async def test_a_large_batch_runs_several_statements_and_commits_once(pool, db_url):
    ids = await claimed_cohort(pool, "large", BATCH + TAIL)
    one = await db.create_pool(db_url, min_size=1, max_size=1)  # one connection: its statement counted
    try:
        compiled = await CompiledCleanup.compile(one, load_targets())
        trial = await executions(one, compiled.batch_sql)  # the start-up check ran it once, on no account
        first = await run_keyset_batch(one, compiled, "large", 0, "", BATCH)
        after_first = await executions(one, compiled.batch_sql) - trial
        tail = await run_keyset_batch(one, compiled, "large", 0, first.last_account_id, BATCH)
        after_tail = await executions(one, compiled.batch_sql) - trial
    finally:
        await one.close()
    assert (first.batch_rows, first.counts.cleaned, first.last_account_id) == (BATCH, BATCH, ids[BATCH - 1])
    assert after_first == 3, "2.5 statements' worth of accounts: three statements"
    assert (tail.batch_rows, tail.counts.cleaned, tail.last_account_id) == (TAIL, TAIL, ids[-1])
    assert after_tail == 4, "the short tail: one statement"
    # One transaction per batch: every account of a batch carries the same xmin.
    xmins = await pool.fetch(
        "SELECT xmin::text AS x, count(*) AS n FROM accounts WHERE status = 'cleaned' GROUP BY 1 ORDER BY 2"
    )
    assert [r["n"] for r in xmins] == [TAIL, BATCH]
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == BATCH + TAIL
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0


async def test_a_failure_in_a_later_statement_rolls_back_the_whole_batch_before_it_is_isolated(pool, db_url):
    ids = await claimed_cohort(pool, "poisoned", BATCH)
    bad = ids[2 * STATEMENT_ACCOUNTS + 7]  # in the third statement
    await poison_by_trigger(pool, [bad])
    compiled = await CompiledCleanup.compile(pool, load_targets())
    result = await run_keyset_batch(pool, compiled, "poisoned", 0, "", BATCH)
    assert result.batch_rows == BATCH and result.counts.cleaned == BATCH - 1 and result.counts.failed == 1
    assert [f.account_id for f in result.failures] == [bad] and result.failures[
        0
    ].message == "raised by a trigger or function"
    counts = await effect_counts(pool)
    # The first two statements' work was rolled back with the third and done again once, by the halves.
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == BATCH - 1
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", bad) == "cleanup_failed"
