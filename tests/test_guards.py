"""Guards on numbers and on switches that must be explicit: NaN and infinities are rejected by every
numeric flag, setting and budget limit (NaN passes any comparison-based bound, and in Postgres it
sorts above every number); failpoints arm only with CLEANUP_FAILPOINTS_ENABLED=1 and say so;
metrics listen on loopback unless told otherwise."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import asyncpg
import pytest
from pydantic import ValidationError

import starter
import worker
from budget.cli import LIMITS, parse_limit
from budget.controller import BudgetChange, BudgetSettings, set_budget
from cleanup.planner_models import PlannerSettings
from core import failpoints
from core.cli import reject_non_finite
from core.config import PROJECT_ROOT, ConfigError, Settings, read
from core.errors import InputError
from devstack.cli import main as devstack_main

NOT_FINITE = ["nan", "NaN", "inf", "-inf", "Infinity"]


def typed_actions(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.Action]]:
    """Every argument of the parser and its subparsers (nested) that converts its value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from typed_actions(sub, f"{path} {name}".strip())
        elif action.type is not None and callable(action.type):
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action


def numeric_actions() -> list[tuple[str, argparse.Action]]:
    found = [*typed_actions(starter.build_parser())]
    assert len(found) >= 10, "the walk found the numeric flags"
    return found


@pytest.mark.parametrize("text", NOT_FINITE)
def test_no_flag_of_any_command_accepts_a_non_finite_number(text: str) -> None:
    accepted = []
    for where, action in numeric_actions():
        assert callable(action.type)
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError, InputError):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            accepted.append(where)
    assert not accepted, f"{text!r} accepted by {accepted}"


def test_the_parser_backstop_rejects_a_non_finite_float_from_any_flag() -> None:
    """A flag declared with a plain `type=float` (by a later change) is still caught after parsing."""
    parser = starter.build_parser()
    with pytest.raises(SystemExit) as exited:
        reject_non_finite(parser, argparse.Namespace(some_rate=float("nan")))
    assert exited.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["cleanup", "--deadline", "2026-11-01T09:00:00Z", "--heartbeat-timeout", "nan"],
        ["cleanup", "--deadline", "2026-11-01T09:00:00Z", "--heartbeat-interval", "inf"],
        ["ledger", "seed", "--date", "2026-11-01", "--payments", "10", "--refund-rate", "nan"],
        ["demo", "--renew-share", "inf"],
        ["demo", "--renew-share", "1.5"],
        ["list", "--limit", "-1"],
    ],
)
def test_bad_numbers_exit_2_before_anything_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        (devstack_main if argv[0] == "demo" else starter.main)(argv)
    assert exited.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_worker_metrics_port_is_a_port() -> None:
    with pytest.raises(SystemExit) as exited:
        worker.main(["--metrics-port", "70000"])
    assert exited.value.code == 2


@pytest.mark.parametrize("text", NOT_FINITE)
@pytest.mark.parametrize("name", [n for n, kind in LIMITS.items() if kind is float])
def test_budget_limits_reject_non_finite_numbers(name: str, text: str) -> None:
    with pytest.raises(InputError):
        parse_limit(name, text)


@pytest.mark.parametrize(("name", "text", "bound"), [("probe_ratio", "0.5", "> 1"), ("rows_per_second", "0", "> 0")])
def test_an_out_of_range_budget_limit_names_its_real_bound(name: str, text: str, bound: str) -> None:
    with pytest.raises(InputError, match=f"must be {bound}, got"):
        parse_limit(name, text)


async def test_the_database_refuses_a_non_finite_budget_limit(pool: asyncpg.Pool) -> None:
    """Postgres sorts NaN above every number, so `CHECK (rows_per_second > 0)` alone let it in; the
    request model refuses it before any statement."""
    for value in (math.nan, math.inf):
        with pytest.raises(ValidationError):
            BudgetChange(rows_per_second=value)
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute("UPDATE load_budget SET rows_per_second = $1", value)
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute("UPDATE load_budget SET latency_ms = $1", value)
    await set_budget(pool, BudgetChange(rows_per_second=250.0))  # a finite one is still taken


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS", "nan"),
        ("WORKER_GRACEFUL_SHUTDOWN_SECONDS", "inf"),
        ("WORKER_STICKY_QUEUE_TIMEOUT_SECONDS", "nan"),
        ("DB_POOL_MAX_SIZE", "0"),
    ],
)
def test_settings_reject_non_finite_and_out_of_range(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env()


@pytest.mark.parametrize(
    "variable", ["LOAD_BUDGET_ROWS_PER_SECOND", "LOAD_BUDGET_LATENCY_MS", "LOAD_BUDGET_MIN_ROWS_PER_SECOND"]
)
def test_budget_settings_reject_infinity(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "inf")
    with pytest.raises(ConfigError, match=variable):
        read(BudgetSettings)


def test_planner_settings_and_heartbeat_seconds_reject_non_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANNER_SWEEP_GRACE_SECONDS", "nan")
    with pytest.raises(ConfigError, match="PLANNER_SWEEP_GRACE_SECONDS"):
        read(PlannerSettings)
    for name in ("CLEANUP_HEARTBEAT_TIMEOUT_SECONDS", "LEDGER_HEARTBEAT_TIMEOUT_SECONDS"):
        monkeypatch.setenv(name, "inf")
        with pytest.raises(ConfigError, match=name):
            Settings.from_env()
        monkeypatch.delenv(name)


def test_metrics_listen_on_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("METRICS_HOST", raising=False)
    assert Settings.from_env().metrics_host == "127.0.0.1"
    monkeypatch.setenv("METRICS_HOST", "0.0.0.0")
    assert Settings.from_env().metrics_host == "0.0.0.0"


def hit_failpoint(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CLEANUP_FAILPOINTS")}
    code = "from core import failpoints\nfailpoints.hit('x.after_commit')\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT_ROOT,
        env={**clean, "CLEANUP_FAILPOINTS": "x.after_commit=exit", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_failpoints_need_the_enable_setting_and_warn() -> None:
    ignored = hit_failpoint()
    assert ignored.returncode == 0, "a stray CLEANUP_FAILPOINTS arms nothing"
    assert "WARNING" in ignored.stderr or "NOT armed" in ignored.stderr
    assert "CLEANUP_FAILPOINTS_ENABLED" in ignored.stderr
    armed = hit_failpoint(CLEANUP_FAILPOINTS_ENABLED="1")
    assert armed.returncode == failpoints.EXIT_CODE
    assert "failpoint armed: x.after_commit" in armed.stderr


def test_failpoints_configure_logs_each_armed_point(caplog: pytest.LogCaptureFixture) -> None:
    try:
        with caplog.at_level("WARNING", logger="core.failpoints"):
            failpoints.configure("a.one=exit@2,b.two=stop", enabled=True)
        armed = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("a.one" in m for m in armed) and any("b.two" in m for m in armed)
    finally:
        failpoints.configure(None)
