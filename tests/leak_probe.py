"""Run only by tests/test_leftovers.py, in a pytest session of its own (not a test_* module).

With LEAK_PROBE=leave it starts a detached process and leaves it running, as a server fixture that
forgot its teardown would; with LEAK_PROBE=stop it stops what it started; with LEAK_PROBE=wait it
holds the suite's servers (Temporal, Postgres) until the session is interrupted.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_start_a_process() -> None:
    mode = os.environ.get("LEAK_PROBE")
    if mode is None:
        pytest.skip("only run by tests/test_leftovers.py")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    Path(os.environ["LEAK_PROBE_PID_FILE"]).write_text(str(proc.pid))
    if mode == "stop":
        proc.terminate()
        proc.wait(10)


async def test_wait_on_the_servers(pool: object, client: object) -> None:
    """With LEAK_PROBE=wait: holds the suite's servers until the session is interrupted."""
    if os.environ.get("LEAK_PROBE") != "wait":
        pytest.skip("only run by tests/test_leftovers.py")
    Path(os.environ["LEAK_PROBE_PID_FILE"]).write_text(os.environ["CLEANUP_TEST_SESSION"])
    await asyncio.sleep(600)
