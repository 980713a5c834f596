"""A failed account's record keeps why it failed, never the data that was to be deleted, and keeps
nothing of it but its reason once the account is cleaned after all."""

from __future__ import annotations

import asyncpg

from cleanup.batches import CompiledCleanup, run_keyset_batch
from cleanup.review import list_failed, retry_failed
from cleanup.targets import load_targets
from tests.helpers import claim_one_partition, deadline_in, seed
from tests.test_cleanup_poison import poison_by_archive_check

CLEANUP_ID = "privacy"


async def _values_of(pool: asyncpg.Pool, account: str) -> list[str]:
    """What of this account's match history a quoted row would show."""
    rows = await pool.fetch(
        "SELECT mode, played_at::text AS played FROM demo_game.match_history WHERE account_id = $1", account
    )
    return [v for r in rows for v in (r["mode"], r["played"])]


async def test_a_failure_keeps_the_reason_not_the_row_and_is_purged_once_cleaned(pool):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 5)
    bad = accounts[2]
    await claim_one_partition(pool, CLEANUP_ID, deadline)
    await poison_by_archive_check(pool, bad)
    values = await _values_of(pool, bad)

    compiled = await CompiledCleanup.compile(pool, load_targets())
    result = await run_keyset_batch(pool, compiled, CLEANUP_ID, 0, "", 100)
    assert result.counts.failed == 1

    [row] = await list_failed(pool, CLEANUP_ID)
    assert row.sqlstate == "23514"
    assert 'constraint "archive_score_sane"' in (row.detail or "") and row.message == "check violation"
    stored = f"{row.message} {row.detail}"
    assert "Failing row contains" not in stored
    assert not [v for v in values if v in stored], "no value of the row that was to be deleted"

    await pool.execute("ALTER TABLE demo_game.match_history_archive DROP CONSTRAINT archive_score_sane")
    assert (await retry_failed(pool, load_targets(), CLEANUP_ID)).cleaned == 1
    [resolved] = await list_failed(pool, CLEANUP_ID, include_resolved=True)
    assert resolved.resolution == "cleaned"
    assert resolved.detail is None and resolved.sqlstate == "23514", "the reason stays, the rest goes"
