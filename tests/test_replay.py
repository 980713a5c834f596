"""Recorded histories must replay against today's code: deadline sleeps outlive deployments."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows import ALL_WORKFLOWS

HISTORIES = sorted((Path(__file__).resolve().parent / "histories").glob("*.json"))


def test_recorded_histories_exist():
    names = {p.stem for p in HISTORIES}
    current = {"cohort_mid_sleep", "cohort_completed", "single_account_renewed"}
    # v1_*: recorded before the `local-bookkeeping` patch; they must keep replaying after it.
    assert current <= names and {f"v1_{n}" for n in current} <= names
    # Recorded with the `failed-tolerance` patch: a cohort failing its --max-failed.
    assert "cohort_failed_tolerance" in names
    # Ledger: v1_ledger_night was recorded before settlement revisions and re-checks.
    assert {"ledger_night", "ledger_recheck", "v1_ledger_night"} <= names
    # v1_: recorded before the outbox relay's `relay-keep-nudges-during-batch` patch.
    assert {"outbox_relay_nudged_mid_batch", "v1_outbox_relay_nudged_mid_batch"} <= names
    # Recorded after the `chunked-claim` patch, with the planner.
    assert {"chunked_cohort_completed", "bucket_cohort_completed", "deadline_planner_running"} <= names
    # Recorded with the `renewed-phase-kept` patch (single_account_renewed was recorded before it).
    assert "single_account_renewed_phase_kept" in names
    # Recorded with the `claim-overlap` patch: partitions follow the cohort's claim.
    assert "overlapped_cohort_completed" in names
    # ... and with two claim streams at once.
    assert "two_stream_cohort_completed" in names
    # ... and with the `following-partitions-at-once` patch (no more following partitions than run at once).
    assert "capped_cohort_completed" in names


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_recorded_history_replays_against_current_code(path: Path):
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"
