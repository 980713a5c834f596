"""Exit codes a script can act on: 2 bad input or configuration (fix it), 75 the database or Temporal
temporarily unavailable (retry later); and under --json, an error is one JSON object on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.cli import EXIT_INPUT, EXIT_UNAVAILABLE
from core.config import PROJECT_ROOT

DOWN = {"DATABASE_URL": "postgresql://app:pw-hidden@127.0.0.1:1/x", "TEMPORAL_ADDRESS": "127.0.0.1:1"}


def cli(*args: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TEMPORAL_ADDRESS")}
    return subprocess.run(
        [sys.executable, "starter.py", *args],
        cwd=PROJECT_ROOT,
        env={**base, "CLEANUP_STATE_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("argv", [["failed"], ["renew", "acct_1"], ["list"]], ids=" ".join)
def test_an_unavailable_service_exits_75_not_2(argv: list[str], tmp_path: Path) -> None:
    done = cli(*argv, env=DOWN, tmp_path=tmp_path)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    assert "pw-hidden" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "env", "code", "kind"),
    [
        (["failed", "--json"], DOWN, EXIT_UNAVAILABLE, "unavailable"),
        (["list", "--json", "--limit", "-1"], DOWN, EXIT_INPUT, "bad_input"),
        (["list", "--json", "--no-such-flag"], DOWN, EXIT_INPUT, "bad_input"),
        (["failed", "--json"], {}, EXIT_INPUT, "bad_input"),  # DATABASE_URL unset
    ],
)
def test_under_json_an_error_is_one_json_object_on_stderr(
    argv: list[str], env: dict[str, str], code: int, kind: str, tmp_path: Path
) -> None:
    done = cli(*argv, env=env, tmp_path=tmp_path)
    assert done.returncode == code, done.stderr
    error = json.loads(done.stderr)  # the whole of stderr: one object, nothing else
    assert set(error) == {"error", "message", "hint"} and error["error"] == kind
    assert error["message"] and error["hint"] and "pw-hidden" not in done.stderr
    assert done.stdout == ""
