"""Run the scenarios of a profile on one harness stack and build the table."""

from __future__ import annotations

import random
import time
import traceback
from pathlib import Path
from typing import Any

from core.config import PROJECT_ROOT
from harness.checks import Ordering
from harness.common import PROFILES, Ctx, Ids, Row
from harness.scenarios import all_scenarios, registry
from harness.stack import harness

COLUMNS = [
    ("scenario", "scenario"),
    ("runs", "runs"),
    ("duplicates", "duplicate side effects"),
    ("lost", "lost work"),
    ("recovery_seconds", "recovery (s, max)"),
    ("dead_letters", "dead letters"),
    ("ordering", "ordering violations"),
    ("operator_visibility", "operator visibility"),
    ("passed", "result"),
]


async def run_profile(
    profile: str = "quick",
    seed: int = 7,
    only: list[str] | None = None,
    inject_violation: bool = False,
    inject_ordering_violation: bool = False,
    log_dir: Path | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    chosen = PROFILES[profile]
    scenarios = all_scenarios()
    names = only or list(registry())
    unknown = [n for n in names if n not in scenarios]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(scenarios)}")
    logs = log_dir or PROJECT_ROOT / ".state" / "harness" / time.strftime("%Y%m%dT%H%M%S")
    started = time.monotonic()
    rows: list[Row] = []
    async with harness(logs) as h:
        ctx = Ctx(h, chosen, seed, Ids(random.Random(seed)), inject_violation, inject_ordering_violation)
        for name in names:
            t0 = time.monotonic()
            closed = len(h.ordering)
            try:
                row = await scenarios[name](ctx)
            except Exception as err:
                row = Row(name, violations=[f"scenario crashed: {type(err).__name__}: {err}"])
                row.notes.append(traceback.format_exc(limit=6))
            ordering = sum((o for _, o in h.ordering[closed:]), Ordering())
            row.ordering = ordering.violations
            row.violations += ordering.problems()
            row.notes += [f"ordering, lane {lane}: {o.details}" for lane, o in h.ordering[closed:]]
            row.seconds = round(time.monotonic() - t0, 1)
            rows.append(row)
            if progress is not None:
                progress(row)
    return {
        "profile": profile,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "passed": all(r.passed for r in rows),
        "logs": str(logs),
        "rows": [r.as_dict() for r in rows],
    }


def cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if key == "passed":
        return "PASS" if value else "FAIL"
    if key == "operator_visibility":
        return "yes" if value else "NO"
    if value is None:
        return "-"
    return str(value)


def render_table(report: dict[str, Any], markdown: bool = False) -> str:
    headers = [h for _, h in COLUMNS]
    body = [[cell(r, k) for k, _ in COLUMNS] for r in report["rows"]]
    return _grid(headers, body, markdown)


RECOVERY_COLUMNS = [
    ("work", "work stopped"),
    ("signal", "signal"),
    ("stops", "stops"),
    ("min", "min (s)"),
    ("p50", "p50 (s)"),
    ("max", "max (s)"),
    ("goal", "goal (s)"),
    ("met", "goal met"),
]


def render_recovery(report: dict[str, Any], markdown: bool = False) -> str:
    """Recovery per kill (harness/recovery.py): from the stop to the work under way on another worker."""
    rows = [r for row in report["rows"] for r in row.get("recovery") or []]
    if not rows:
        return ""

    def value(r: dict[str, Any], key: str) -> str:
        if key == "met":
            return "yes" if r["met"] else "NO"
        v = r[key]
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    headers = [h for _, h in RECOVERY_COLUMNS]
    body = [[value(r, k) for k, _ in RECOVERY_COLUMNS] for r in rows]
    return _grid(headers, body, markdown)


def _grid(headers: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def render_details(report: dict[str, Any]) -> str:
    out = []
    for r in report["rows"]:
        out.append(f"\n{r['scenario']} ({r['seconds']} s)")
        out += [f"  VIOLATION {v}" for v in r["violations"]]
        out += [f"  visible: {e}" for e in r["evidence"][:8]]
        out += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(out)
