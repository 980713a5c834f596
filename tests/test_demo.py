"""The README's first command must stay true: the planner alone cleans accounts with spread
deadlines, renewals are honoured, every effect happens once and every reminder reaches the customer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.config import PROJECT_ROOT


@pytest.mark.whole_machine  # its renewals must land inside a 4 s lead before their deadlines
def test_demo_planner_cleans_spread_deadlines_renews_and_delivers_each_reminder_once(
    admin_db_url, temporal_address, tmp_path
):
    env = dict(
        os.environ, TEMPORAL_ADDRESS=temporal_address, DATABASE_URL=admin_db_url, CLEANUP_STATE_DIR=str(tmp_path)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devstack",
            "demo",
            "--accounts",
            "300",
            "--lead-seconds",
            "4",
            "--spread-seconds",
            "5",
            "--json",
        ],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    c = result["counts"]
    # The demo's own planner, started by the workers, did it all: no cleanup command.
    assert result["planner_workflow_id"] == f"deadline-planner-{result['task_queue']}"
    assert result["cleanups"] and all(w.startswith(("cleanup-bucket-", "cleanup-sweep-")) for w in result["cleanups"])
    assert all(w.endswith(f"-{result['task_queue']}") for w in result["cleanups"]), "the demo's own cleanups"
    assert result["buckets"] >= 2, (
        "deadlines spread over several cohorts (sparse ones share one up to the lateness objective)"
    )
    # Every account in one terminal state: cleaned once, or renewed in time (for good).
    cleaned = 300 - result["renewed_in_time"]
    assert result["renewed_in_time"] >= 1
    assert result["cleaned_accounts"] == c["cleaned"] == c["claimed"] == c["reminders"] == cleaned
    assert result["moved"] == {
        "account_id": result["moved"]["account_id"],
        "in_time": True,
        "status": "cleaned",
        "version": 2,
    }
    assert result["duplicate_effects"] == 0
    assert result["reminders_delivered"] == result["customer_mailbox"] == cleaned
    assert result["late_renewal_reported"] is True
    lateness = result["lateness_seconds"]
    assert lateness["cleanups"] == cleaned and 0 <= lateness["p50"] <= lateness["p99"] <= lateness["max"]
    assert "Result of the deadline planner" in result["report"] and "reported too late" in result["report"]
