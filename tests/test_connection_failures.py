"""Every connection failure classified, as the operator reads it: a wrong address, name or credential
exits 2 with one sentence naming the setting to fix (never the driver's class name alone, never the
password); a service away (refused, or accepting and never answering) exits 75 within
CONNECT_TIMEOUT_SECONDS, the same bound for the database and for Temporal."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from core import db
from core.cli import EXIT_INPUT, EXIT_UNAVAILABLE
from core.config import PROJECT_ROOT, Settings
from core.errors import DatabaseMisconfigured, InputError, TemporalUnavailable
from core.temporal import connect_failure

UNRESOLVABLE = "no-such-host.invalid"  # RFC 6761: never resolves


def cli(*args: str, env: dict[str, str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """The CLI as an operator runs it (`python -m devstack` for args starting "devstack"), with only
    the addresses in `env`; and how long it took."""
    drop = ("DATABASE_URL", "TEMPORAL_ADDRESS", "CONNECT_TIMEOUT_SECONDS")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, *(["-m", *args] if args[:1] == ("devstack",) else ["starter.py", *args])],
        cwd=PROJECT_ROOT,
        env={**base, "CLEANUP_STATE_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - began


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP (the kernel's backlog) and never answers a byte."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield silent.getsockname()[1]


def _one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    return stderr


def _with_user(url: str, user: str, password: str | None = None) -> str:
    parts = urlsplit(url)
    credentials = user + (f":{password}" if password else "")
    host = f"{parts.hostname}:{parts.port or 5432}" if parts.hostname else ""  # a socket URL: host in the query
    return urlunsplit(parts._replace(netloc=f"{credentials}@{host}"))


# --- bad configuration: exit 2, naming the setting ------------------------------------------------


@pytest.mark.parametrize("argv", [["failed"], ["planner", "status"]], ids=" ".join)
@pytest.mark.parametrize("case", ["unknown database", "unknown role"])
def test_a_database_url_naming_what_does_not_exist_exits_2_naming_it(
    admin_db_url: str, argv: list[str], case: str, tmp_path: Path
) -> None:
    """`planner status` reads the database when it can (optional): a wrong URL is still exit 2."""
    if case == "unknown database":
        url, named, fix = db.with_database(admin_db_url, "no_such_db_x"), '"no_such_db_x"', "database name"
    else:
        url, named = _with_user(admin_db_url, "no_such_role_x", "pw-hidden"), '"no_such_role_x"'
        fix = "user (role) name"
    done, took = cli(*argv, env={"DATABASE_URL": url, "TEMPORAL_ADDRESS": "127.0.0.1:1"}, tmp_path=tmp_path)
    assert done.returncode == EXIT_INPUT, done.stderr
    err = _one_line(done.stderr)
    assert named in err and f"fix the {fix} in DATABASE_URL" in err, err
    assert "Error" not in err and "pw-hidden" not in err, err  # no driver class name, no password
    assert took < 8, f"{took:.1f} s"


def test_a_database_host_that_does_not_resolve_exits_2_naming_it(tmp_path: Path) -> None:
    url = f"postgresql://app:pw-hidden@{UNRESOLVABLE}:5432/game"
    done, took = cli("failed", env={"DATABASE_URL": url}, tmp_path=tmp_path)
    assert done.returncode == EXIT_INPUT, done.stderr
    err = _one_line(done.stderr)
    assert f"the host name '{UNRESOLVABLE}' of DATABASE_URL" in err and "pw-hidden" not in err, err
    assert took < 8, f"{took:.1f} s"


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (f"{UNRESOLVABLE}:7233", f"the host name '{UNRESOLVABLE}' of TEMPORAL_ADDRESS"),
        ("127.0.0.1:99999", "TEMPORAL_ADDRESS (--temporal-address) '127.0.0.1:99999' is not a host:port"),
    ],
)
def test_a_temporal_address_that_cannot_be_right_exits_2_naming_it(address: str, message: str, tmp_path: Path) -> None:
    done, took = cli("list", env={"TEMPORAL_ADDRESS": address}, tmp_path=tmp_path)
    assert done.returncode == EXIT_INPUT, done.stderr
    assert message in _one_line(done.stderr), done.stderr
    assert took < 8, f"{took:.1f} s"


def test_a_wrong_password_and_refused_credentials_are_named_without_the_secret() -> None:
    """The local servers trust every local user, so the refusals are built as the drivers raise them."""
    url = "postgresql://app:pw-hidden@db.internal:5432/game"
    refused = asyncpg.exceptions.InvalidPasswordError('password authentication failed for user "app"')
    wrong = db.misconfiguration(url, refused)
    assert isinstance(wrong, DatabaseMisconfigured)
    assert "fix the password in DATABASE_URL" in str(wrong) and "pw-hidden" not in str(wrong)
    assert db.misconfiguration(url, socket.gaierror(socket.EAI_AGAIN, "Temporary failure")) is None  # resolver away
    assert db.misconfiguration(url, ConnectionRefusedError(111, "refused")) is None
    settings = Settings(temporal_address="temporal.internal:7233")
    denied = RuntimeError("Failed client connect: `get_system_info` call error: Status { code: Unauthenticated }")
    assert isinstance(connect_failure(settings, denied), InputError)
    assert "TEMPORAL_API_KEY" in str(connect_failure(settings, denied))
    away = RuntimeError("Failed client connect: dns error: Temporary failure in name resolution")
    assert isinstance(connect_failure(settings, away), TemporalUnavailable)


# --- unavailable: exit 75, within the one bound ---------------------------------------------------


def test_refused_connections_exit_75_at_once_for_both(tmp_path: Path) -> None:
    for argv, env, named in (
        (["failed"], {"DATABASE_URL": "postgresql://app:pw-hidden@127.0.0.1:1/x"}, "database postgresql://app:***@"),
        (["list"], {"TEMPORAL_ADDRESS": "127.0.0.1:1"}, "TEMPORAL_ADDRESS"),
    ):
        done, took = cli(*argv, env=env, tmp_path=tmp_path)
        assert done.returncode == EXIT_UNAVAILABLE, done.stderr
        assert named in _one_line(done.stderr) and "pw-hidden" not in done.stderr, done.stderr
        assert took < 8, f"{argv}: {took:.1f} s"


@pytest.mark.parametrize("service", ["database", "temporal"])
def test_an_address_that_accepts_and_never_answers_exits_75_after_the_one_timeout(
    service: str, silent_port: int, tmp_path: Path
) -> None:
    """The same setting bounds both (the SDK's own bound for Temporal is 30 s)."""
    if service == "database":
        argv, env = ["failed"], {"DATABASE_URL": f"postgresql://app:pw-hidden@127.0.0.1:{silent_port}/x"}
        message = "is unavailable (TimeoutError: no answer within 2 s, CONNECT_TIMEOUT_SECONDS)"
    else:
        argv, env = ["list"], {"TEMPORAL_ADDRESS": f"127.0.0.1:{silent_port}"}
        message = "did not answer within 2 s (CONNECT_TIMEOUT_SECONDS)"
    done, took = cli(*argv, env={**env, "CONNECT_TIMEOUT_SECONDS": "2"}, tmp_path=tmp_path)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    err = _one_line(done.stderr)
    assert message in err and f"127.0.0.1:{silent_port}" in err and "pw-hidden" not in err, err
    assert 2 <= took < 7, f"{took:.1f} s"


def test_the_connect_timeout_is_about_ten_seconds_by_default() -> None:
    assert Settings().connect_timeout_seconds == 10.0


# --- bad values and missing settings: one line, only what the command uses ------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["ledger", "seed", "--date", "2026-10-25", "--payments", "-5"],
        ["ledger", "seed", "--date", "2026-10-25", "--payments", "many"],
        ["list", "--limit", "0"],
        ["schedule", "create", "--heartbeat-timeout", "nan"],
        ["ledger"],  # a group without its verb
        ["no-such-command"],
        ["worker", "--no-such-flag"],  # the worker's own parser too
    ],
    ids=" ".join,
)
def test_every_bad_value_is_one_line_exit_2(argv: list[str], tmp_path: Path) -> None:
    done, _ = cli(*argv, env={}, tmp_path=tmp_path)
    assert done.returncode == EXIT_INPUT, done.stderr
    err = _one_line(done.stderr)
    assert err.startswith("error: deadline-cleanup") and "usage:" not in err and "--help" in err, err


@pytest.mark.parametrize(
    ("argv", "named", "not_named"),
    [
        (["schedule", "describe"], "TEMPORAL_ADDRESS is not set", "DATABASE_URL"),
        (["schedule", "list"], "TEMPORAL_ADDRESS is not set", "DATABASE_URL"),
        (["list"], "TEMPORAL_ADDRESS is not set", "DATABASE_URL"),
        (["outbox", "relay", "stop"], "TEMPORAL_ADDRESS is not set", "DATABASE_URL"),
        (["failed"], "DATABASE_URL is not set", "TEMPORAL_ADDRESS"),
        (
            ["devstack", "seed", "--accounts", "1", "--deadline", "2030-01-01T00:00:00Z"],
            "DATABASE_URL is not set",
            "TEMPORAL",
        ),
        (["status", "cleanup-acct_1-x"], "DATABASE_URL and TEMPORAL_ADDRESS are not set", "Error"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_each_command_asks_only_for_the_settings_it_uses(
    argv: list[str], named: str, not_named: str, tmp_path: Path
) -> None:
    done, _ = cli(*argv, env={}, tmp_path=tmp_path)
    assert done.returncode == EXIT_INPUT, done.stderr
    err = _one_line(done.stderr)
    assert named in err and not_named not in err, err
