"""Processes a pytest session started and left running (servers, workers, their children).

Every process the session starts inherits `SESSION_ENV` from it (subprocess, pg_ctl, the Temporal
CLI: none of them clears the environment), so a process that still carries the session's token
when the session ends was started by it and outlived it, whatever became of its parent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

SESSION_ENV = "CLEANUP_TEST_SESSION"
GRACE_ENV = "CLEANUP_TEST_LEFTOVER_GRACE"  # seconds the session's processes get to exit (default 15)


def carrying(token: str) -> dict[int, str]:
    """Live processes (other than this one) whose environment has SESSION_ENV=token: pid -> command line."""
    needle = f"{SESSION_ENV}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return found


def left_running(token: str) -> dict[int, str]:
    """The session's processes still alive after a grace period (servers stopping take a moment)."""
    grace = float(os.environ.get(GRACE_ENV, "15"))
    deadline = time.monotonic() + grace
    while (found := carrying(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
