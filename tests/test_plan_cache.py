"""Statements are planned for their own parameters, never from a generic plan cached per connection.

asyncpg prepares each statement once per connection; after five executions Postgres may switch to
one generic plan for the rest of the connection's life, planned on the statistics of that moment.
A generic plan made while `cleanup_applied` is small probes it with a sequential scan per account,
and keeps doing so as the table grows (docs/decisions/0012-custom-plans.md). Proved here on real Postgres with the
project's own pool, counted by Postgres itself (`pg_prepared_statements`).
"""

from __future__ import annotations

from cleanup.batches import CompiledCleanup, run_keyset_batch
from cleanup.targets import load_targets
from core import db
from tests.helpers import claim_one_partition, deadline_in, seed

BATCHES = 12  # more than the five custom plans after which Postgres may choose a generic one


async def test_batch_statements_are_never_run_from_a_cached_generic_plan(pool, db_url):
    deadline = deadline_in(-60)
    await seed(pool, deadline, BATCHES * 5)
    await pool.execute("ANALYZE")  # cleanup_applied analyzed while empty, as on a fresh deployment
    await claim_one_partition(pool, "plans", deadline)
    one = await db.create_pool(db_url, min_size=1, max_size=1)  # one connection: its prepared statements
    try:
        compiled = await CompiledCleanup.compile(one, load_targets())
        last, cleaned = "", 0
        for _ in range(BATCHES):
            result = await run_keyset_batch(one, compiled, "plans", 0, last, 5)
            last, cleaned = result.last_account_id, cleaned + result.counts.cleaned
        plans = await one.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            compiled.batch_sql,
        )
        mode = await one.fetchval("SHOW plan_cache_mode")
    finally:
        await one.close()
    assert cleaned == BATCHES * 5
    assert mode == "force_custom_plan"
    assert plans is not None, "the batch statement is a prepared statement of this connection"
    assert (plans["generic_plans"], plans["custom_plans"]) == (0, BATCHES + 1)  # + the start-up check's trial
