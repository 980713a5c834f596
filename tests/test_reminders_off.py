"""CLEANUP_REMINDERS=off: a cohort is cleaned with no renewal reminder in the outbox, and its
settlement (and the dry run) say 0 reminders; on (the default) the statement is unchanged."""

from __future__ import annotations

import pytest

from cleanup.batches import REMINDERS_ON, with_reminders
from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from cleanup.review import preview_cleanup
from cleanup.targets import load_targets
from core.config import Settings
from tests.helpers import deadline_in, effect_counts, seed
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow


def test_the_switch_is_one_constant_in_the_statement(monkeypatch: pytest.MonkeyPatch) -> None:
    sql = f"SELECT 1 WHERE {REMINDERS_ON}"
    monkeypatch.delenv("CLEANUP_REMINDERS", raising=False)
    assert with_reminders(sql, Settings.from_env().cleanup.reminders) == sql
    monkeypatch.setenv("CLEANUP_REMINDERS", "off")
    off = Settings.from_env().cleanup.reminders
    assert with_reminders(sql, off) == "SELECT 1 WHERE false"
    assert with_reminders(sql, off) == with_reminders(sql, off), "the same text for every worker with the same settings"
    with pytest.raises(ValueError):
        with_reminders("SELECT 1", True)


async def test_reminders_off_cleans_a_cohort_with_no_outbox_rows(client, pool, task_queue, monkeypatch) -> None:
    monkeypatch.setenv("CLEANUP_REMINDERS", "off")
    settings = Settings.from_env()  # as a worker reads it, once at start
    deadline = deadline_in(4)
    await seed(pool, deadline, 60)
    preview = await preview_cleanup(pool, load_targets(), deadline=deadline, reminders=settings.cleanup.reminders)
    assert (preview.accounts_in_scope, preview.reminders) == (60, 0)
    async with build_worker(client, task_queue, await build_activities(pool, settings=settings)):
        started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await handle.result()
    assert result.settlement is not None
    assert (result.settlement.claimed, result.settlement.cleaned, result.settlement.reminders) == (60, 60, 0)
    counts = await effect_counts(pool)
    assert (counts["applied"], counts["reminders"]) == (60, 0)
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    assert await pool.fetchval("SELECT count(*) FROM erasure_receipts") == 60, "receipts are written as before"
