"""Recorded histories must replay against today's code: deadline sleeps outlive deployments."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows import ALL_WORKFLOWS

HISTORIES = sorted((Path(__file__).resolve().parent / "histories").glob("*.json"))
# Histories of released code (named after its release, e.g. `1.0_deadline_planner.json`): kept
# while runs of that code may be open (docs/decisions/0001), beside the current code's.
CURRENT = [p for p in HISTORIES if not p.stem[0].isdigit()]


def test_every_workflow_has_one_recorded_history():
    # A history per workflow (and per path its input chooses: `renewal_cleanup_small_cohort`),
    # recorded by the current code (tests/record_*histories.py); older code's histories join them
    # only while runs of that code are open (docs/decisions/0001).
    recorded = [WorkflowHistory.from_json(p.stem, p.read_text()).events[0] for p in CURRENT]
    types = sorted({e.workflow_execution_started_event_attributes.workflow_type.name for e in recorded})
    assert types == sorted(str(defn.name) for defn in map(workflow._Definition.must_from_class, ALL_WORKFLOWS))


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_recorded_history_replays_against_current_code(path: Path):
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"
