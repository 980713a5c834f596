"""Embedded services only when asked: a command or a worker with TEMPORAL_ADDRESS or DATABASE_URL
unset exits 2 naming the variable and starts nothing; after `dev up` the checkout's commands find
the stack through <state dir>/dev/env, and a variable that is set wins over that file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import PROJECT_ROOT, Settings, dev_env_file

COMMANDS = [
    ["starter.py", "list"],
    ["starter.py", "renew", "a-1"],
    ["starter.py", "budget", "show"],
    ["starter.py", "planner", "status"],
    ["starter.py", "migrate"],
    ["worker.py"],
]


def bare_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "DATABASE_URL", "CLEANUP_EMBEDDED")}
    return {**env, "CLEANUP_STATE_DIR": str(state_dir), **extra}


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *cmd], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_missing_addresses_exit_2_naming_them_and_start_nothing(cmd: list[str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = run(cmd, bare_env(state, TEMPORAL_ADDRESS="127.0.0.1:1"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "DATABASE_URL" in result.stderr and "Traceback" not in result.stderr
    result = run(cmd, bare_env(state, DATABASE_URL="postgresql://nobody@127.0.0.1:1/none"))
    if cmd[1:] not in (["budget", "show"], ["migrate"]):  # database-only commands never need Temporal
        assert result.returncode == 2, result.stdout + result.stderr
        assert "TEMPORAL_ADDRESS" in result.stderr and "Traceback" not in result.stderr
    assert not state.exists() or not any(state.rglob("*")), "something was started or written"


def test_dev_env_file_is_read_only_for_unset_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANUP_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TEMPORAL_ADDRESS", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert Settings.from_env().temporal_address is None, "no file: nothing"
    env_file = dev_env_file(tmp_path)
    env_file.parent.mkdir(parents=True)
    env_file.write_text("TEMPORAL_ADDRESS=127.0.0.1:7777\nDATABASE_URL=postgresql://dev@127.0.0.1/dev\nOTHER=x\n")
    settings = Settings.from_env()
    assert (settings.temporal_address, settings.database_url) == ("127.0.0.1:7777", "postgresql://dev@127.0.0.1/dev")
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.prod:7233")
    assert Settings.from_env().temporal_address == "temporal.prod:7233", "a set variable wins"
