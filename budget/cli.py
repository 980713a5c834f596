"""`starter.py budget show|set`: the database load budget of every cleanup and reconciliation batch.

Needs only the database (not Temporal), so an operator can throttle the work during an outage of
either. A change is read by every worker at its next acquire (docs/budget.md).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from core import addresses, db
from core.cli import Commands, emit, key_values, table
from core.config import Settings
from core.errors import InputError

if TYPE_CHECKING:
    from budget.controller import BudgetChange

INT_MAX = 2**31 - 1  # the integer limits are stored as PostgreSQL integers
LIMITS: dict[str, type] = {
    "max_in_flight": int,
    "rows_per_second": float,
    "latency_ms": float,
    "max_lock_waits": int,
    "max_replication_lag_seconds": float,
    "probe_ratio": float,
    "probe_max_ms": float,
    "probe_added_ms": float,
    "lateness_objective_seconds": float,
    "deadline_max_in_flight": int,
}
AT_MOST_256 = ("max_in_flight", "deadline_max_in_flight")
FROM_ZERO = ("max_in_flight", "max_lock_waits", "deadline_max_in_flight")


def parse_limit(name: str, text: str) -> int | float | None:
    """A number, or `default` (back to the workers' LOAD_BUDGET_* setting)."""
    if text.strip().lower() == "default":
        return None
    try:
        value: int | float = LIMITS[name](text)
    except ValueError:
        raise InputError(f"--{name.replace('_', '-')} must be a number or 'default', got {text!r}") from None
    if not math.isfinite(value):  # NaN compares false with every bound below, and in Postgres above all
        raise InputError(f"--{name.replace('_', '-')} is out of range: must be a finite number, got {text!r}")
    if LIMITS[name] is int and value > INT_MAX:
        raise InputError(f"--{name.replace('_', '-')} is out of range, got {text!r}")
    low = 0 if name in FROM_ZERO else 1 + 1e-9 if name == "probe_ratio" else 1e-9
    if value < low or (name in AT_MOST_256 and value > 256):
        bounds = "0-256" if name in AT_MOST_256 else ">= 0" if low == 0 else "> 1" if name == "probe_ratio" else "> 0"
        raise InputError(f"--{name.replace('_', '-')} must be {bounds}, got {text!r}")
    return value


def _human(d: dict[str, Any]) -> str:
    # What it does and why first, then the settings and the rest.
    first = ("enabled", "doing", "limited_by", "objective", "deadline")
    shown = {k: d[k] for k in first} | {k: v for k, v in d.items() if k != "slots" and k not in first}
    for name in LIMITS:
        value = d[name]["value"]
        shown[name] = f"{'none' if value is None else value} ({d[name]['source']})"
    slots = table(d["slots"], ["slot", "job", "holder", "rows", "acquired_at"]) if d["slots"] else "(none)"
    return key_values(shown) + "\nin flight now:\n" + slots


async def cmd_budget_show(args: argparse.Namespace, settings: Settings) -> None:
    await _budget(args, settings, None)


async def cmd_budget_set(args: argparse.Namespace, settings: Settings) -> None:
    from budget.controller import BudgetChange  # lazy: keeps `--help` fast to start

    changes: dict[str, Any] = {
        name: parse_limit(name, value) for name in LIMITS if (value := getattr(args, name)) is not None
    }
    enabled = {"on": True, "off": False}.get(args.enabled) if args.enabled else None
    if not changes and enabled is None and not args.reset_scale:
        raise InputError("nothing to set: give a limit (e.g. --max-in-flight 4), --enabled or --reset-scale")
    await _budget(args, settings, BudgetChange(enabled=enabled, reset_scale=args.reset_scale, **changes))


async def _budget(args: argparse.Namespace, settings: Settings, change: BudgetChange | None) -> None:
    from budget.controller import budget_status, set_budget  # lazy: keeps `--help` fast to start

    # Only the database: no Temporal server is needed, nor started.
    url = addresses.database_url(settings)
    await db.check_schema_url(url, settings)
    pool = await db.create_pool(url, max_size=2, connect_timeout=settings.connect_timeout_seconds, settings=settings)
    try:
        if change is not None:
            await set_budget(pool, change)
        emit(args, (await budget_status(pool, settings.budget)).model_dump(), _human)
    finally:
        await pool.close()


LIMIT_HELP = {
    "max_in_flight": "batches at once across all workers (0 pauses)",
    "rows_per_second": "rows (accounts, ledger keys) per second",
    "latency_ms": "mean batch latency per 1000 rows that means stress",
    "max_lock_waits": "lock waits in the database that means stress",
    "max_replication_lag_seconds": "standby lag that means stress",
    "probe_ratio": "optional bound: commit probe latency / its quiet baseline that means stress (> 1)",
    "probe_max_ms": "commit probe latency (mean per window) that means stress, in ms",
    "probe_added_ms": "the players' objective: ms a commit may take above its quiet baseline (mean per window)",
    "lateness_objective_seconds": "the deadline objective: seconds after its deadline a cohort may finish",
    "deadline_max_in_flight": "batches in flight the deadline objective may hold past the players' objective",
}


def register(commands: Commands) -> None:
    """Add `budget show|set` to starter.py."""
    budget = commands.group("budget", "the database load budget of cleanup and reconciliation batches: show or set it")
    budget.add("show", cmd_budget_show, "the limits and where each comes from, what the budget is doing, in flight now")
    p = budget.add("set", cmd_budget_set, "change limits for every worker (read at their next acquire)")
    for name, help in LIMIT_HELP.items():
        env = f"LOAD_BUDGET_{name.upper()}"
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            metavar="N|default",
            help=f"{help}; 'default': the workers' own setting (env: {env})",
        )
    p.add_argument("--enabled", choices=["on", "off"], help="off: batches run without any limit")
    p.add_argument(
        "--reset-scale", action="store_true", help="forget the adaptive throttle (unthrottled until the next stress)"
    )
