"""The Temporal UI, driven by headless Chromium (Debian's `chromium`), shows a finished cleanup.

A dev server with its UI is started for this module; a cohort cleanup runs to completion; Chromium
loads the workflow's page by its ID, and the rendered DOM must show the outcome (Completed, `"outcome": "cleaned"`), the
partitions (activity type `cleanup_partition`, summaries `partition N`) and the settlement. A
screenshot goes to tests/artifacts/ui-cleanup.png (and, with UPDATE_UI_SCREENSHOT=1, docs/ui-cleanup.png).

Chromium is launched with every background-network feature off: this machine's network is closed,
and without them Chromium waits on connections that never come.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect
from devstack.embedded import DevServer, free_port
from tests.helpers import deadline_in, seed
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

ARTIFACTS = PROJECT_ROOT / "tests" / "artifacts"
DOCS_SCREENSHOT = PROJECT_ROOT / "docs" / "ui-cleanup.png"
PARTITIONS = 3
SCREEN = (1400, 1050)


def chromium_path() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found:
        return found
    reason = "headless Chromium is not installed (apt-get install -y --no-install-recommends chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI must install it (.ci/run does)")
    pytest.skip(reason)


def chromium(binary: str, profile: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-default-apps",
        "--metrics-recording-only",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest_asyncio.fixture(scope="module")
async def ui_server() -> AsyncIterator[DevServer]:
    state = Path(tempfile.mkdtemp(prefix="ui-devserver-"))
    server = DevServer(state, port=None, ui_port=free_port())
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)
        shutil.rmtree(state, ignore_errors=True)


async def test_ui_shows_a_finished_cleanup_with_its_partitions(ui_server: DevServer, pool: asyncpg.Pool) -> None:
    binary = chromium_path()
    client = await connect(Settings(temporal_address=ui_server.address))
    task_queue = f"ui-{uuid.uuid4().hex[:8]}"
    deadline = deadline_in(1)
    await seed(pool, deadline, 60)
    async with build_worker(client, task_queue, await build_activities(pool)):
        started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=PARTITIONS))
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await handle.result()
    assert result.outcome == "cleaned"

    url = f"http://127.0.0.1:{ui_server.ui_port}/namespaces/default/workflows/{started.workflow_id}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        dom = await asyncio.to_thread(
            chromium, binary, profile, "--dump-dom", "--virtual-time-budget=20000", "--window-size=1400,1000", url
        )
    (ARTIFACTS / "ui-cleanup.html").write_text(dom.stdout)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert started.workflow_id in page
    assert "RenewalCleanupWorkflow" in page
    assert "Completed" in page, "the run's status"
    assert '"outcome"' in page and '"cleaned"' in page, "the result with its outcome"
    assert '"settlement"' in page and '"reminders"' in page, "the settlement's counts"
    for p in range(PARTITIONS):
        assert f"cleanup_partition • partition {p}" in page, f"partition {p} missing from the timeline"

    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        shot = await asyncio.to_thread(
            chromium,
            binary,
            profile,
            f"--screenshot={ARTIFACTS / 'ui-cleanup.png'}",
            "--virtual-time-budget=20000",
            f"--window-size={SCREEN[0]},{SCREEN[1]}",
            url,
        )
    assert shot.returncode == 0, shot.stderr[-2000:]
    png = (ARTIFACTS / "ui-cleanup.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000, "a real screenshot, not an empty page"
    if os.environ.get("UPDATE_UI_SCREENSHOT") or not DOCS_SCREENSHOT.exists():
        DOCS_SCREENSHOT.write_bytes(png)
