"""The README's first command must stay true: the demo runs the whole job and reports no duplicates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from core.config import PROJECT_ROOT


def test_demo_cleans_renews_and_delivers_each_reminder_once(admin_db_url, temporal_address, tmp_path):
    env = dict(
        os.environ, TEMPORAL_ADDRESS=temporal_address, DATABASE_URL=admin_db_url, CLEANUP_STATE_DIR=str(tmp_path)
    )
    done = subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "starter.py"),
            "demo",
            "--accounts",
            "300",
            "--lead-seconds",
            "6",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    s = result["settlement"]
    assert result["outcome"] == "cleaned"
    assert s["claimed"] + s["skipped_renewed"] == 300
    assert s["cleaned"] == s["claimed"] == s["reminders"] == 300 - result["renewed_in_time"]
    assert result["duplicate_reminders"] == 0
    assert result["reminders_delivered"] == result["customer_mailbox"] == s["reminders"]
    assert result["late_renewal_reported"] is True
