"""Embedded services only when asked: a command or a worker with TEMPORAL_ADDRESS or DATABASE_URL
unset exits 2 naming the variable and starts nothing; after `./dev up` the checkout's commands find
the stack through <state dir>/dev/env, and a variable that is set wins over that file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import starter
from core.config import PROJECT_ROOT, Settings, dev_env_file

COMMANDS = [
    ["starter.py", "list"],
    ["starter.py", "renew", "a-1"],
    ["starter.py", "budget", "show"],
    ["starter.py", "planner", "status"],
    ["starter.py", "migrate"],
    ["worker.py"],
]


UNSET = ("TEMPORAL_ADDRESS", "DATABASE_URL")


def bare_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return {**env, "CLEANUP_STATE_DIR": str(state_dir), **extra}


def run(
    cmd: list[str], state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], **env: str
) -> tuple[int | str | None, str, str]:
    """Exit code, stdout and stderr of `python *cmd` with neither address set but those in `env`.
    starter.py's commands run in this process (starter.main reads the environment on each call;
    tests/test_exit_codes.py runs its process): a start-up each was most of this module's time.
    worker.py, the process a deployment runs, runs as one."""
    if cmd[0] == "worker.py":
        done = subprocess.run(
            [sys.executable, *cmd],
            cwd=PROJECT_ROOT,
            env=bare_env(state_dir, **env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.returncode, done.stdout, done.stderr
    with monkeypatch.context() as patch:
        for name in UNSET:
            patch.delenv(name, raising=False)
        for name, value in {"CLEANUP_STATE_DIR": str(state_dir), **env}.items():
            patch.setenv(name, value)
        try:
            code: int | str | None = starter.main(cmd[1:])
        except SystemExit as exited:
            code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_missing_addresses_exit_2_naming_them_and_start_nothing(
    cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    code, out, err = run(cmd, state, monkeypatch, capsys, TEMPORAL_ADDRESS="127.0.0.1:1")
    if cmd[1:] != ["list"]:  # Temporal-only commands never ask for the database
        assert code == 2, out + err
        assert "DATABASE_URL" in err and "Traceback" not in err
    else:
        assert code == 75 and "DATABASE_URL" not in err, out + err  # it went on to Temporal (refused)
    code, out, err = run(cmd, state, monkeypatch, capsys, DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    if cmd[1:] not in (["budget", "show"], ["migrate"]):  # database-only commands never need Temporal
        assert code == 2, out + err
        assert "TEMPORAL_ADDRESS" in err and "Traceback" not in err
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
