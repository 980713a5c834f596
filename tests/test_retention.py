"""Retention on real Postgres: what is older than CLEANUP_RETENTION_DAYS goes in bounded batches,
what is younger stays, and nothing of a cleanup not settled or an account not cleaned goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import asyncpg
import pytest

from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from cleanup.retention import prune
from core import db
from core.config import PROJECT_ROOT
from core.roles import service_roles
from tests.helpers import deadline_in, seed
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# Rows per account the service keeps for a cleaned account, besides the accounts row itself.
KINDS = {
    "claims": "SELECT count(*) FROM cleanup_claims WHERE account_id = ANY($1::text[])",
    "applied": "SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])",
    "receipts": "SELECT count(*) FROM erasure_receipts WHERE account_id = ANY($1::text[])",
    "events": "SELECT count(*) FROM account_events WHERE account_id = ANY($1::text[])",
    "renewals": "SELECT count(*) FROM renewals WHERE account_id = ANY($1::text[])",
    "outbox": "SELECT count(*) FROM outbox WHERE account_id = ANY($1::text[])",
}


async def counts(pool: asyncpg.Pool, accounts: list[str]) -> dict[str, int]:
    return {kind: await pool.fetchval(sql, accounts) for kind, sql in KINDS.items()}


async def cleaned_cohort(client, pool, task_queue, n: int) -> tuple[str, list[str]]:
    """A cohort cleaned by a real workflow, its reminders delivered, with history rows to prune."""
    deadline = deadline_in(3)
    accounts = await seed(pool, deadline, n)
    await pool.execute(
        "INSERT INTO account_events (account_id, kind, deadline) SELECT a, 'registered', $2 FROM unnest($1::text[]) a",
        accounts,
        deadline,
    )
    await pool.execute(
        "INSERT INTO renewals (account_id, outcome, version_after, status_seen)"
        " SELECT a, 'too_late', 1, 'cleaned' FROM unnest($1::text[]) a",
        accounts,
    )
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
    result: CleanupResult = await client.get_workflow_handle_for(
        RenewalCleanupWorkflow.run, started.workflow_id
    ).result()
    assert result.settlement is not None and result.settlement.cleaned == n
    await pool.execute(
        "UPDATE outbox SET status = 'delivered', delivered_at = now() WHERE account_id = ANY($1::text[])", accounts
    )
    return result.cleanup_id, accounts


async def age(pool: asyncpg.Pool, cleanup_id: str, accounts: list[str], days: int) -> None:
    """What the database records of a cleanup's settlement and its accounts' cleaning, `days` ago."""
    shift = timedelta(days=days)
    await pool.execute(
        "UPDATE cleanup_settlements SET settled_at = settled_at - $2::interval WHERE cleanup_id = $1", cleanup_id, shift
    )
    await pool.execute(
        "UPDATE accounts SET cleaned_at = cleaned_at - $2::interval WHERE account_id = ANY($1::text[])", accounts, shift
    )
    await pool.execute(
        "UPDATE outbox SET delivered_at = delivered_at - $2::interval WHERE source_id = $1", cleanup_id, shift
    )


def prune_command(db_url: str, *args: str) -> dict[str, object]:
    """`deadline-cleanup prune ... --json` against the test's database: its JSON."""
    env = dict(os.environ, DATABASE_URL=db_url)
    cli = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "starter.py"), "prune", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    return json.loads(cli.stdout)  # type: ignore[no-any-return]


async def test_old_records_pruned_in_batches_young_and_unsettled_kept(client, pool, db_url, task_queue, worker) -> None:
    old_id, old = await cleaned_cohort(client, pool, task_queue, 25)
    young_id, young = await cleaned_cohort(client, pool, task_queue, 10)
    open_id, unsettled = await cleaned_cohort(client, pool, task_queue, 5)
    await age(pool, old_id, old, 40)
    await age(pool, young_id, young, 20)
    await age(pool, open_id, unsettled, 40)
    # A cleanup whose settlement the database does not hold may still run: all of it stays.
    await pool.execute("DELETE FROM cleanup_settlements WHERE cleanup_id = $1", open_id)
    active = await seed(pool, deadline_in(3600), 3)  # registered, not cleaned
    await pool.execute("UPDATE account_events SET recorded_at = now() - interval '90 days'")
    groups = {"young": young, "open": unsettled, "active": active}
    kept = {name: await counts(pool, accounts) for name, accounts in groups.items()}

    dry = await prune(pool, 30, dry_run=True)
    assert (dry.claims, dry.applied, dry.receipts, dry.events, dry.renewals, dry.outbox) == (25, 25, 25, 25, 25, 25)
    assert await counts(pool, old) == dict.fromkeys(KINDS, 25), "a dry run deletes nothing"
    shown = prune_command(db_url, "--dry-run", "--retention-days", "30")
    assert (shown["dry_run"], shown["claims"], shown["receipts"], shown["outbox"]) == (True, 25, 25, 25)
    assert await counts(pool, old) == dict.fromkeys(KINDS, 25), "the command's dry run deletes nothing"

    # As the workers run it: their role's rights (DELETE on the bookkeeping, EXECUTE on the function).
    worker_role = await asyncpg.create_pool(
        db_url, min_size=1, max_size=2, server_settings={**db.service_settings(), "role": service_roles().worker}
    )
    try:
        assert await worker_role.fetchval("SELECT current_user") == service_roles().worker
        pruned = await prune(worker_role, 30, batch=7)
        # Whatever the worker passes, the function judges each row: an unsettled cleanup's, a young
        # one's, an account not cleaned: nothing goes.
        asked = [(open_id, a) for a in unsettled] + [(young_id, a) for a in young] + [(young_id, a) for a in active]
        refused = await worker_role.fetchrow(
            "SELECT * FROM prune_account_records($1::text[], $2::text[], now() - interval '25 days', false)",
            [c for c, _ in asked],
            [a for _, a in asked],
        )
        assert tuple(refused) == (0, 0, 0, 0)
    finally:
        await worker_role.close()
    assert (pruned.claims, pruned.applied, pruned.receipts, pruned.events, pruned.renewals) == (25,) * 5
    assert pruned.outbox == 25 and pruned.cleanups == 1
    assert pruned.batches >= 4 + 4, "claims and reminders in batches of at most 7"
    assert await counts(pool, old) == dict.fromkeys(KINDS, 0)
    assert not await pool.fetchval("SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = $1", old_id)
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[])", old) == 25
    for name, accounts in groups.items():
        assert await counts(pool, accounts) == kept[name], name
    assert await pool.fetchval("SELECT count(*) FROM cleanup_settlements WHERE cleanup_id = $1", young_id) == 1
    again = await prune(pool, 30, batch=7)
    assert (again.claims, again.outbox, again.cleanups) == (0, 0, 0)


async def test_the_database_refuses_a_cutoff_younger_than_seven_days(pool) -> None:
    with pytest.raises(asyncpg.InvalidParameterValueError, match="at least 7 days"):
        await pool.fetch("SELECT * FROM prune_account_records('{}', '{}', now() - interval '6 days', false)")
