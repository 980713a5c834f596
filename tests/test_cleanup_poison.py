"""One bad account never blocks a cohort, against real Temporal and real Postgres.

Accounts are poisoned the ways a team's schema poisons them: a trigger that raises on delete from a
target table, a foreign key from an extra team table to a target table, a CHECK on the archive
table that one account's data violates. A transient fault (the worker's own connection terminated,
then a deadlock error) hits another account in the same run. Effects are counted in the database.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from cleanup.errors import FailedToleranceExceeded
from cleanup.inputs import StartCleanup, parse_failed_tolerance
from cleanup.models import CleanupResult, cohort_cleanup_id
from cleanup.operations import cleanup_status, renew, start_cleanup
from cleanup.review import list_failed, preview_cleanup, retry_failed
from cleanup.targets import load_targets
from core.errors import is_deterministic
from tests.helpers import deadline_in, effect_counts, seed
from tests.test_cleanup_input import run_cli
from workflows import ALL_WORKFLOWS
from workflows.renewal_cleanup import RenewalCleanupWorkflow

TARGET_TABLES = ("demo_game.cloud_saves", "demo_game.inventory_items", "demo_game.match_history")
SEEDED = {
    "demo_game.cloud_saves": 2,
    "demo_game.inventory_items": 5,
    "demo_game.match_history": 5,
}  # rows per account (seed defaults)


async def poison_by_trigger(pool: asyncpg.Pool, accounts: list[str]) -> None:
    """A trigger that raises (P0001) on delete from inventory_items for these accounts."""
    await pool.execute(
        """
        CREATE TABLE legal_holds (account_id text PRIMARY KEY);
        CREATE FUNCTION refuse_held_inventory() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM legal_holds WHERE account_id = OLD.account_id) THEN
                RAISE EXCEPTION 'inventory of % is under legal hold', OLD.account_id;
            END IF;
            RETURN OLD;
        END $$;
        CREATE TRIGGER refuse_held_inventory BEFORE DELETE ON demo_game.inventory_items
            FOR EACH ROW EXECUTE FUNCTION refuse_held_inventory();
        """
    )
    await pool.execute("INSERT INTO legal_holds SELECT unnest($1::text[])", accounts)


async def poison_by_foreign_key(pool: asyncpg.Pool, accounts: list[str]) -> None:
    """An extra team table whose foreign key points at these accounts' cloud saves (23503 on delete)."""
    await pool.execute(
        """
        CREATE TABLE team_loadouts (
            account_id text NOT NULL,
            slot smallint NOT NULL,
            FOREIGN KEY (account_id, slot) REFERENCES demo_game.cloud_saves (account_id, slot)
        )
        """
    )
    await pool.execute(
        "INSERT INTO team_loadouts SELECT account_id, slot FROM demo_game.cloud_saves WHERE account_id = ANY($1)",
        accounts,
    )


async def poison_by_archive_check(pool: asyncpg.Pool, account: str) -> None:
    """A CHECK of the archive table that this account's match history violates (23514 on archive)."""
    await pool.execute(
        "ALTER TABLE demo_game.match_history_archive ADD CONSTRAINT archive_score_sane CHECK (score >= 0)"
    )
    await pool.execute("UPDATE demo_game.match_history SET score = -1 WHERE account_id = $1", account)


async def transient_fault_on(pool: asyncpg.Pool, account: str) -> None:
    """Deleting this account's first cloud save terminates the worker's own connection (57P01, a
    lost connection) the first time and raises a deadlock (40P01) the second; then it passes.
    A sequence counts the firings: it is not rolled back with the failed attempts."""
    await pool.execute(
        f"""
        CREATE SEQUENCE transient_faults;
        CREATE FUNCTION transient_fault() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE n bigint;
        BEGIN
            IF OLD.account_id = '{account}' AND OLD.slot = 1 THEN
                n := nextval('transient_faults');
                IF n = 1 THEN
                    PERFORM pg_terminate_backend(pg_backend_pid());
                    PERFORM pg_sleep(5);  -- not reached: the termination is processed first
                ELSIF n = 2 THEN
                    RAISE EXCEPTION 'simulated deadlock' USING ERRCODE = 'deadlock_detected';
                END IF;
            END IF;
            RETURN OLD;
        END $$;
        CREATE TRIGGER transient_fault BEFORE DELETE ON demo_game.cloud_saves
            FOR EACH ROW EXECUTE FUNCTION transient_fault();
        """
    )


async def rows_left(pool: asyncpg.Pool, accounts: list[str]) -> dict[str, int]:
    out = {}
    for table in TARGET_TABLES:
        out[table] = await pool.fetchval(f"SELECT count(*) FROM {table} WHERE account_id = ANY($1)", accounts)
    out["archived"] = await pool.fetchval(
        "SELECT count(*) FROM demo_game.match_history_archive WHERE account_id = ANY($1)", accounts
    )
    out["outbox"] = await pool.fetchval("SELECT count(*) FROM outbox WHERE account_id = ANY($1)", accounts)
    out["applied"] = await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1)", accounts)
    return out


async def run_cohort(client, pool, task_queue, deadline, **options: Any) -> tuple[str, CleanupResult]:
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, **options))
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    return started.workflow_id, await handle.result()


async def test_poisoned_accounts_are_isolated_the_rest_cleaned_once_and_retry_cleans_them_once(
    client, pool, task_queue, worker, settings
):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 200)
    held, referenced, bad_archive, flaky = [accounts[3], accounts[77]], accounts[120], accounts[121], accounts[60]
    poisoned = sorted([*held, referenced, bad_archive])
    await poison_by_trigger(pool, held)
    await poison_by_foreign_key(pool, [referenced])
    await poison_by_archive_check(pool, bad_archive)
    await transient_fault_on(pool, flaky)

    workflow_id, result = await run_cohort(client, pool, task_queue, deadline, partitions=2, batch_size=40)

    # The cohort settled, with the poisoned accounts counted as failed.
    assert result.outcome == "cleaned"
    assert result.settlement is not None
    assert (result.settlement.claimed, result.settlement.cleaned, result.settlement.failed) == (200, 196, 4)
    # Codes and counts only, grouped by reason: no account key, no text of the game's.
    assert sorted(result.settlement.failed_reasons) == [
        "1 account(s): [23503] foreign key violation in demo_game.cloud_saves",
        "1 account(s): [23514] check violation in demo_game.match_history_archive",
        "2 account(s): [P0001] raised by a trigger or function in demo_game.inventory_items",
    ]
    # Every other account cleaned exactly once: duplicates 0, lost 0.
    assert await effect_counts(pool) == {
        "applied": 196,
        "reminders": 196,
        "duplicate_reminders": 0,
        "archived_matches": 196 * 5,
        "duplicate_archives": 0,
        "cleaned_accounts": 196,
        "settlements": 1,
    }
    healthy = sorted(set(accounts) - set(poisoned))
    assert await rows_left(pool, healthy) == {
        "demo_game.cloud_saves": 0,
        "demo_game.inventory_items": 0,
        "demo_game.match_history": 0,
        "archived": 196 * 5,
        "outbox": 196,
        "applied": 196,
    }
    # No partial effect on a failed account: all its data is where it was.
    assert await rows_left(pool, poisoned) == {
        "demo_game.cloud_saves": 4 * 2,
        "demo_game.inventory_items": 4 * 5,
        "demo_game.match_history": 4 * 5,
        "archived": 0,
        "outbox": 0,
        "applied": 0,
    }
    statuses = await pool.fetch("SELECT status, count(*) AS n FROM accounts GROUP BY status ORDER BY status")
    assert {r["status"]: r["n"] for r in statuses} == {"cleaned": 196, "cleanup_failed": 4}

    # In review, with the SQLSTATE's condition, the names the error gives, and the target table:
    # never the error's text (a game's trigger can raise anything, personal data included).
    failed = {r.account_id: r for r in await list_failed(pool, workflow_id)}
    assert sorted(failed) == poisoned
    for account in held:
        assert failed[account].sqlstate == "P0001"
        assert failed[account].message == "raised by a trigger or function"
        assert failed[account].target == "demo_game.inventory_items"
    assert failed[referenced].sqlstate == "23503"
    assert failed[referenced].message == "foreign key violation"
    assert failed[referenced].target == "demo_game.cloud_saves"
    assert failed[bad_archive].sqlstate == "23514"
    assert failed[bad_archive].message == "check violation"
    assert 'constraint "archive_score_sane"' in (failed[bad_archive].detail or "")
    assert failed[bad_archive].target == "demo_game.match_history_archive"

    # The transient fault fired (twice) and was retried, not sent to review.
    assert await pool.fetchval("SELECT last_value FROM transient_faults") >= 3
    assert flaky not in failed
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", flaky) == "cleaned"

    # `status` and the CLI show them.
    status = await cleanup_status(client, pool, workflow_id)
    assert status.settlement is not None and status.settlement.failed == 4
    assert str(status.failed_accounts).startswith("4 pending review")
    shown = run_cli(settings, "failed", "--cleanup", workflow_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert sorted(r["account_id"] for r in json.loads(shown.stdout)) == poisoned

    # Retrying before the fix: still failing, the reasons are kept, nothing is applied.
    again = await retry_failed(pool, load_targets(), workflow_id)
    assert (again.retried, again.cleaned, again.still_failed) == (4, 0, 4)
    assert await rows_left(pool, poisoned) == {
        "demo_game.cloud_saves": 8,
        "demo_game.inventory_items": 20,
        "demo_game.match_history": 20,
        "archived": 0,
        "outbox": 0,
        "applied": 0,
    }

    # Remove the causes, then retry: each poisoned account cleaned once.
    await pool.execute("DELETE FROM legal_holds; DELETE FROM team_loadouts")
    await pool.execute("ALTER TABLE demo_game.match_history_archive DROP CONSTRAINT archive_score_sane")
    fixed = await retry_failed(pool, load_targets(), workflow_id)
    assert (fixed.retried, fixed.cleaned, fixed.still_failed, fixed.already_applied) == (4, 4, 0, 0)
    assert await effect_counts(pool) == {
        "applied": 200,
        "reminders": 200,
        "duplicate_reminders": 0,
        "archived_matches": 200 * 5,
        "duplicate_archives": 0,
        "cleaned_accounts": 200,
        "settlements": 1,
    }
    resolved = await list_failed(pool, workflow_id, include_resolved=True)
    assert {r.resolution for r in resolved} == {"cleaned"}
    assert all(r.attempts >= 2 for r in resolved)
    assert await list_failed(pool, workflow_id) == []

    # Nothing pending: a retry does nothing; a review row forced back to pending is absorbed by the
    # idempotency record (already applied), never cleaned twice.
    assert (await retry_failed(pool, load_targets(), workflow_id)).retried == 0
    await pool.execute("UPDATE cleanup_failed SET resolved_at = NULL, resolution = NULL WHERE account_id = $1", held[0])
    replay = await retry_failed(pool, load_targets(), workflow_id)
    assert (replay.retried, replay.cleaned, replay.already_applied) == (1, 0, 1)
    assert (await effect_counts(pool))["applied"] == 200
    assert (await effect_counts(pool))["duplicate_reminders"] == 0


async def test_a_failed_account_follows_the_renewal_rule_like_an_active_one(client, pool, task_queue, worker):
    """Past its deadline a renewal is too late, whether the account was cleaned, is active, or failed:
    the renewal is recorded, the failure stays pending for retry-failed, nothing is cleaned twice."""
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 10)
    await poison_by_trigger(pool, [accounts[4]])
    _, result = await run_cohort(client, pool, task_queue, deadline, partitions=1)
    assert result.settlement is not None and result.settlement.failed == 1

    outcome = await renew(client, pool, task_queue, accounts[4])
    assert not outcome.in_time and outcome.status_seen == "cleanup_failed"
    [row] = await list_failed(pool, include_resolved=True)
    assert row.resolution is None, "a renewal after the deadline does not resolve the failure"
    assert await rows_left(pool, [accounts[4]]) == {
        "demo_game.cloud_saves": 2,
        "demo_game.inventory_items": 5,
        "demo_game.match_history": 5,
        "archived": 0,
        "outbox": 0,
        "applied": 0,
    }


async def test_more_failures_than_tolerated_fail_the_workflow_naming_the_count_and_reasons(
    client, pool, task_queue, worker
):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 40)
    held = [accounts[5], accounts[17], accounts[30]]
    await poison_by_trigger(pool, held)

    with pytest.raises(WorkflowFailureError) as failure:
        await run_cohort(client, pool, task_queue, deadline, partitions=2, max_failed="2")
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == FailedToleranceExceeded.TYPE and cause.non_retryable
    assert "3 account(s) failed cleanup, more than the tolerance 2" in cause.message
    assert "3 account(s): [P0001] raised by a trigger or function in demo_game.inventory_items" in cause.message
    assert held[0] not in cause.message, "a Temporal payload carries codes and counts, no account"
    # The new path (behind the `failed-tolerance` patch) replays deterministically.
    history = await client.get_workflow_handle(cohort_cleanup_id(deadline)).fetch_history()
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)
    replay = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replay.replay_failure is None, replay.replay_failure
    # It still settled first, with every other account cleaned.
    settled = await pool.fetchrow("SELECT claimed, cleaned, failed FROM cleanup_settlements")
    assert dict(settled) == {"claimed": 40, "cleaned": 37, "failed": 3}

    # Within the tolerance (3 of 40 = 7.5% <= 10%), a cohort with failures completes.
    other = deadline_in(-120)
    more = await seed(pool, other, 40)
    await pool.execute("INSERT INTO legal_holds SELECT unnest($1::text[])", [more[1], more[2], more[3]])
    _, result = await run_cohort(client, pool, task_queue, other, partitions=2, max_failed="10%")
    assert result.outcome == "cleaned" and result.settlement is not None and result.settlement.failed == 3


def test_tolerance_and_error_classification():
    assert parse_failed_tolerance("3") == (3, None)
    assert parse_failed_tolerance("5%") == (None, 5.0)
    assert parse_failed_tolerance(None) == (None, None)
    for bad in ("-1", "abc", "150%", "2.5"):
        with pytest.raises(ValueError):
            parse_failed_tolerance(bad)

    class Pg(Exception):
        def __init__(self, sqlstate: str) -> None:
            self.sqlstate = sqlstate

    for state in ("23505", "23503", "23514", "P0001", "22001", "22P02"):
        assert is_deterministic(Pg(state)), state
    for state in ("40001", "40P01", "55P03", "57014", "57P01", "08006", "53300", "42501"):
        assert not is_deterministic(Pg(state)), state
    assert not is_deterministic(ConnectionResetError()) and not is_deterministic(OSError())


async def table_digests(pool: asyncpg.Pool) -> dict[str, tuple[int, str | None]]:
    out = {}
    for table in (
        "accounts",
        *TARGET_TABLES,
        "demo_game.match_history_archive",
        "outbox",
        "renewals",
        "cleanup_claims",
        "cleanup_applied",
        "cleanup_failed",
        "cleanup_partition_reports",
        "cleanup_settlements",
    ):
        row = await pool.fetchrow(
            f"SELECT count(*) AS n, md5(string_agg(t::text, '|' ORDER BY t::text)) AS d FROM {table} t"
        )
        out[table] = (row["n"], row["d"])
    return out


async def test_dry_run_changes_nothing_and_matches_what_the_cleanup_then_does(
    client, pool, task_queue, worker, settings
):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 60)
    for account in accounts[:5]:  # renewed before the deadline: judged in time, then back in the cohort's range
        await pool.execute(
            "UPDATE accounts SET renewal_deadline = now() + interval '1 hour' WHERE account_id = $1", account
        )
        assert (await renew(client, pool, task_queue, account)).in_time
        await pool.execute("UPDATE accounts SET renewal_deadline = $2 WHERE account_id = $1", account, deadline)
    await seed(pool, deadline_in(3600), 7)  # another cohort: out of scope
    iso = deadline.isoformat().replace("+00:00", "Z")

    before = await table_digests(pool)
    preview = await preview_cleanup(pool, load_targets(), deadline=deadline)
    cli = run_cli(settings, "cleanup", "--deadline", iso, "--dry-run", "--json")
    one = run_cli(settings, "cleanup", "--account", accounts[9], "--dry-run", "--json")
    assert await table_digests(pool) == before, "the dry run changed the database"
    assert cli.returncode == 0, cli.stderr
    assert one.returncode == 0, one.stderr
    shown, expected = json.loads(cli.stdout), preview.model_dump(mode="json")
    for key in ("accounts_in_scope", "already_renewed", "reminders", "targets", "workflow_id"):
        assert shown[key] == expected[key], key
    single = json.loads(one.stdout)
    assert (single["accounts_in_scope"], single["reminders"]) == (1, 1)
    assert {t["table"]: t["rows"] for t in single["targets"]} == SEEDED

    assert (preview.accounts_in_scope, preview.already_renewed, preview.reminders) == (55, 5, 55)
    rows = {t.table: t.rows for t in preview.targets}
    scope = accounts[5:]
    left_before = await rows_left(pool, scope)

    _, result = await run_cohort(client, pool, task_queue, deadline, partitions=3)
    assert result.settlement is not None
    left_after = await rows_left(pool, scope)
    assert result.settlement.cleaned == preview.accounts_in_scope
    assert result.settlement.reminders == preview.reminders
    assert result.settlement.skipped_renewed == preview.already_renewed
    for table in TARGET_TABLES:
        assert left_before[table] - left_after[table] == rows[table], table
    assert left_after["archived"] - left_before["archived"] == rows["demo_game.match_history"]
