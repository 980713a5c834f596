"""The performance page, generated: `python -m bench.report record OUTPUT.json`, then `python -m bench.report render`.

`record` takes what a benchmark printed (one scenario's JSON document, or `bench.run_all`'s document of
several) and keeps each scenario's latest result in `bench/results/<scenario>.json`, stamped with the
date, the commit and the machine. `render` writes `docs/performance.md` from those files only: the page
is never edited by hand, and `render --check` (run by the tests) fails when it and the files disagree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"

# What each scenario's main `ratio` compares, and the command that measures it.
SCENARIOS: dict[str, tuple[str, str]] = {
    "cohort_cleanup": (
        "pipeline / direct, accounts/s",
        "python -m bench.cohort_cleanup --accounts 100000 --budget default",
    ),
    "ledger_reconciliation": (
        "pipeline / direct, payments/s",
        "python -m bench.ledger_reconciliation --payments 200000 --budget default",
    ),
    "ledger_reconciliation_1m": (
        "pipeline / direct, payments/s",
        "python -m bench.ledger_reconciliation --payments 1000000 --budget default",
    ),
    "single_account_cleanups": (
        "cleanup / bare workflow, completions/s",
        "python -m bench.single_accounts --workflows 2000",
    ),
    "ledger_rerun": ("unchanged re-check / first run, seconds", "python -m bench.ledger_rerun --payments 1000000"),
    "poisoned_cohort": ("poisoned / clean cohort, accounts/s", "python -m bench.poisoned_cohort --accounts 100000"),
    "player_load": (
        "players' p99 under the default objective / under the floor paced at the same accounts/s",
        "python -m bench.player_load --accounts 100000 --players 20000",
    ),
    "batch_plan": ("rows processed per key, largest / smallest batch", "python -m bench.batch_plan"),
    "game_schema": (
        "pipeline / floor on a game server's own schema, accounts/s",
        "python -m bench.game_schema --users 100000",
    ),
    "game_schema_1m": (
        "pipeline / floor on a game server's own schema, accounts/s",
        "python -m bench.game_schema --users 1000000",
    ),
    "game_realm": (
        "the game realm through the planner (deadline -> last cleaned) / floor, budget as shipped, accounts/s",
        "python -m bench.game_realm --users 100000",
    ),
    "cohort_through_planner": (
        "through the planner (deadline -> last account cleaned) / floor, budget off, accounts/s",
        "python -m bench.planner_cohort --accounts 100000",
    ),
    "cohort_through_planner_progress": (
        "through the planner / floor, budget as shipped, a progress query each second in a new session, accounts/s",
        "python -m bench.planner_cohort --accounts 100000 --budget default --side-load progress",
    ),
    "cohort_through_planner_monitor": (
        "through the planner / floor, budget as shipped, a monitoring poll every 5 s and 10 idle connections",
        "python -m bench.planner_cohort --accounts 100000 --budget default --side-load monitor",
    ),
    "restart_chaos": (
        "cohort closed after its deadline, 20 database restarts / none, seconds",
        "python -m harness.restart_chaos --accounts 200000 --payments 1000000 --restarts 20",
    ),
    "planner_lateness": (
        "lateness p99 (deadline -> cleaned, deadlines spread over 10 minutes), seconds",
        "python -m bench.planner_lateness --accounts 100000 --spread 600",
    ),
    "planner_events": (
        "history events per account, one deadline a second (every workflow's history / accounts)",
        "python -m bench.planner_events --curve 3,5,10,20",
    ),
    "outbox_delivery": (
        "relay / provider floor (batches of 500, no database), reminders delivered/s",
        "python -m bench.outbox_delivery --events 100000",
    ),
}
# A benchmark whose output has no `ratio`: its main figure and that figure's goal.
MAIN_FIGURE = {
    "planner_events": ("one_per_second.events_per_account", "<= 6"),
    "game_schema": ("pipeline_over_floor", ">= 0.6"),
    "game_schema_1m": ("pipeline_over_floor", ">= 0.6"),
    "planner_lateness": ("lateness_seconds.p99", "<= 2"),
}
# Figures with a goal inside a nested result (a dotted path), after the main one.
NESTED_FIGURES = {
    "planner_lateness": [("lateness_seconds.max", "<= 5")],
    # The lateness objective's default is 10 s.
    "planner_events": [
        ("one_per_second.lateness_seconds.p99", "<= 10"),
        ("dense.events_per_account", "<= 1"),
        ("idle.events_per_day", "<= 30000"),
    ],
}
# A result recorded while its scenario's `ratio` compared something else: the key only the current
# results have, and what the recorded ratio compares.
EARLIER_RATIO = {"player_load": ("curve", "players' p99 with the default budget / players alone")}
SIZE_KEYS = (
    "events",
    "accounts",
    "accounts_per_cohort",
    "payments",
    "workflows",
    "live_players",
    "poisoned",
    "users_per_cohort",
)


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    goal: str
    met: bool


def goal_met(value: float, goal: str) -> bool:
    op, _, bound = goal.partition(" ")
    if op == ">=":
        return value >= float(bound)
    if op == "<=":
        return value <= float(bound)
    raise ValueError(f"a goal reads '>= N' or '<= N', not {goal!r}")


def figures(document: dict[str, Any], scenario: str = "") -> list[Figure]:
    """The scenario's main ratio, then every figure `X` that has a goal `X_target` beside it."""
    key, goal = MAIN_FIGURE.get(scenario, ("ratio", document.get("target", "")))
    main = float(at_path(document, key))
    out = [Figure("ratio", main, goal, goal_met(main, goal))]
    for path, nested_goal in NESTED_FIGURES.get(scenario, []):
        value = float(at_path(document, path))
        out.append(Figure(path, value, nested_goal, goal_met(value, nested_goal)))
    for key, goal in document.items():
        name = key.removesuffix("_target")
        if key.endswith("_target") and name != key and isinstance(document.get(name), int | float):
            out.append(Figure(name, float(document[name]), goal, goal_met(document[name], goal)))
    return out


def at_path(document: dict[str, Any], path: str) -> Any:
    """The value at a dotted path (`lateness_seconds.p99`) of a result."""
    value: Any = document
    for part in path.split("."):
        value = value[part]
    return value


def this_machine() -> str:
    from bench.common import machine  # the benchmarks' own description of the machine

    return machine()


def current_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def scenario_documents(document: dict[str, Any], scenario: str | None = None) -> dict[str, dict[str, Any]]:
    """A `bench.run_all` document holds several scenarios; a benchmark's own output is one (named by
    its `scenario` field, or by `scenario` for a benchmark that prints none)."""
    if "scenarios" in document:
        return {name: doc for name, doc in document["scenarios"].items() if "error" not in doc}
    return {str(scenario or document["scenario"]): document}


def record(
    document: dict[str, Any], results: Path = RESULTS, commit: str | None = None, scenario: str | None = None
) -> list[Path]:
    if document.get("smoke"):
        raise ValueError("a smoke run's figures are fixed latencies, not results: run the full sizes")
    written = []
    results.mkdir(parents=True, exist_ok=True)
    for name, doc in scenario_documents(document, scenario).items():
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}: add it to bench.report.SCENARIOS")
        stamped = {
            "scenario": name,
            "date": datetime.now(UTC).date().isoformat(),
            "commit": commit or current_commit(),
            # A benchmark that prints no machine ran on this one: recording follows the run.
            "machine": doc.get("machine") or document.get("machine") or this_machine(),
            "result": doc,
        }
        path = results / f"{name}.json"
        path.write_text(json.dumps(stamped, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


SIZE_LABELS = {"users_per_cohort": "users", "accounts_per_cohort": "accounts per cohort", "live_players": "players"}


def size_of(doc: dict[str, Any]) -> str:
    """The run's size, and the load budget it ran under when the benchmark says."""
    parts = [f"{doc[k]:,} {SIZE_LABELS.get(k, k)}" for k in SIZE_KEYS if isinstance(doc.get(k), int)]
    if isinstance(doc.get("load_budget"), str):
        parts.append(f"budget {doc['load_budget']}")
    return ", ".join(parts)


def load_of(doc: dict[str, Any]) -> str:
    """The machine's 1-minute load average before and after the run, as the benchmark recorded it."""
    pair = doc.get("load_average_1m_before_and_after")
    for sampled in ("load_average", "load_average_1m"):
        if isinstance(doc.get(sampled), dict):
            pair = [doc[sampled].get("before"), doc[sampled].get("after")]
    if isinstance(pair, dict):  # per phase: the lowest and highest of them all
        values = [float(v) for phase in pair.values() for v in phase]
        pair = [min(values), max(values)] if values else None
    if not isinstance(pair, list) or len(pair) != 2 or None in pair:
        return "-"
    return f"{float(pair[0]):.1f} / {float(pair[1]):.1f}"


def ratio_label(scenario: str, doc: dict[str, Any]) -> str:
    """What the result's `ratio` compares."""
    key, earlier = EARLIER_RATIO.get(scenario, ("", ""))
    return earlier if key and key not in doc else SCENARIOS[scenario][0]


def _number(value: Any, digits: int = 3) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:,.0f}" if digits == 0 else f"{value:.{digits}f}"


def curve_table(doc: dict[str, Any]) -> list[str]:
    """The load budget's curve of a `player_load` result: one row per objective, after the budget off."""
    window = doc.get("window_seconds", 10)
    alone = doc.get("players_alone_p99_ms")
    off = doc["no_budget"]
    lines = [
        f"Players alone: p99 {_number(alone, 1)} ms. Each p99 counts the players' queries scheduled while the",
        "cleanup ran; `/ alone` divides it by the mean of the players-alone windows right before and after it.",
        "Lateness: each account's cleaned_at - its deadline. Held: the share of the cleanup's "
        f"{window:g} s windows in which the objective held, judged on the commit probe's mean (as the budget",
        "judges it) and on the players' p99 (against their p99 alone before the phase); the paced floor's",
        "windows judged the same way.",
        "",
        "| objective | cleanup accounts/s | / budget off | lateness p99 s (max) | players' p99 ms | / alone "
        "| paced floor's p99 ms at the same accounts/s | budget / paced floor (goal <= 1.1) "
        "| held: commit probe (goal >= 0.95) | held: players' p99 | paced floor held: players' p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| budget off | {_number(off['accounts_per_s'], 0)} | 1.000 | {_number(off.get('lateness_p99_s'), 1)} "
        f"| {_number(off['players_p99_ms'], 1)} "
        f"| {_number(off['players_p99_over_alone_bracketed'], 2)} | - | - | - | - | - |",
    ]

    def held(p: dict[str, Any], key: str, count: str) -> str:
        if key not in p:
            return "-"  # a result recorded before this figure was measured
        value = p[key]
        return "no window" if value is None else f"{value:.2f} of {p.get(count)}"

    for p in doc["curve"]:
        lateness = f"{_number(p.get('lateness_p99_s'), 1)} ({_number(p.get('lateness_max_s'), 1)})"
        lines.append(
            f"| {p['objective']}: {p['means']} | {_number(p['accounts_per_s'], 0)} "
            f"| {_number(p['throughput_over_no_budget'])} | {lateness} | {_number(p['players_p99_ms'], 1)} "
            f"| {_number(p['players_p99_over_alone_bracketed'], 2)} | {_number(p['paced_floor_players_p99_ms'], 1)} "
            f"| {_number(p['p99_over_paced_floor'])} | {held(p, 'objective_held_fraction', 'objective_windows')} "
            f"| {held(p, 'players_p99_held_fraction', 'objective_windows')} "
            f"| {held(p, 'paced_floor_players_p99_held_fraction', 'paced_floor_windows')} |"
        )
    return lines


def curve_section(stamped: list[dict[str, Any]]) -> list[str]:
    """The load budget's curve (docs/budget.md): objective, throughput, players' p99, from `player_load`."""
    lines = ["", "## The load budget's curve", ""]
    found = [s for s in stamped if s["scenario"] == "player_load" and "curve" in s["result"]]
    if not found:
        command = SCENARIOS["player_load"][1]
        return [*lines, f"No measured curve: `{command} > out.json`, then `record` it."]
    s = found[0]
    doc = s["result"]
    lines += [
        "What each objective of the load budget ([budget](budget.md)) gives the cleanup and costs the",
        f"players, measured in one `player_load` run ({size_of(doc)}; {s['date']}, {s['commit']}; load",
        f"before / after {load_of(doc)}): the players at {_number(doc.get('player_rate_per_s'), 0)} queries/s, each",
        "objective's cleanup followed by the floor's statement paced at the throughput that cleanup measured.",
        "",
        *curve_table(doc),
    ]
    return lines


COST_KINDS = (
    "workflow_starts",
    "activities",
    "local_activities",
    "timers",
    "signals",
    "queries",
    "heartbeats_estimated",
    "search_attribute_upserts",
    "memo_upserts",
    "markers",
)


def _kinds(billable: dict[str, Any], per: float = 1.0, digits: int = 2) -> str:
    return " | ".join(_number(billable.get(k, 0) / per, digits) for k in COST_KINDS)


def costs_section(stamped: list[dict[str, Any]]) -> list[str]:
    """What a day of deadlines costs on Temporal, from `planner_events`: per account at each spread
    and per idle day, beside the lateness; then events per account against the lateness objective."""
    lines = ["", "## What deadlines cost on Temporal", ""]
    found = [s for s in stamped if s["scenario"] == "planner_events"]
    if not found:
        command = SCENARIOS["planner_events"][1]
        return [*lines, f"No measured costs: `{command} > out.json`, then `record` it."]
    s = found[0]
    doc = s["result"]
    header = " | ".join(k.replace("_", " ") for k in COST_KINDS)
    lines += [
        f"Every workflow's history, read once the last cleanup closed (`planner_events`; {s['date']}, {s['commit']};",
        f"lateness objective {doc['lateness_objective_seconds']:g} s, longest idle sleep "
        f"{doc['max_idle_seconds']:g} s, {doc['workers']} workers). Billable kinds per account, then per idle",
        "day; heartbeats are estimated from each activity's run time, queries are not in a history (none sent).",
        "",
        f"| deadlines | accounts | cleanups | events | per account | lateness p99 s | {header} |",
        "|---|---|---|---|---|---|" + "---|" * len(COST_KINDS),
    ]
    for name in ("dense", "one_per_second", "one_per_minute"):
        r = doc[name]
        lines.append(
            f"| {name.replace('_', ' ')} | {r['accounts']:,} | {r['cleanups']:,} | {r['history_events']:,} "
            f"| {_number(r['events_per_account'], 2)} | {_number(r['lateness_seconds']['p99'], 2)} "
            f"| {_kinds(r['billable'], r['accounts'])} |"
        )
    idle = doc["idle"]
    lines += [
        f"| idle, per day ({idle['iterations_measured']} iterations of {idle['seconds_per_iteration']:g} s measured) "
        f"| - | - | {idle['events_per_day']:,} | - | - | {_kinds(idle['billable_per_day'], digits=0)} |",
    ]
    if doc.get("curve"):
        lines += [
            "",
            "One deadline a second under each lateness objective (PLANNER_LATENESS_OBJECTIVE):",
            "",
            "| objective s | cleanups | events per account | lateness p50 s | p99 s | max s |",
            "|---|---|---|---|---|---|",
        ]
        for p in doc["curve"]:
            late = p["lateness_seconds"]
            lines.append(
                f"| {p['lateness_objective_seconds']:g} | {p['cleanups']:,} | {_number(p['events_per_account'], 2)} "
                f"| {_number(late['p50'], 2)} | {_number(late['p99'], 2)} | {_number(late['max'], 2)} |"
            )
    return lines


def render(results: Path = RESULTS) -> str:
    stamped = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    lines = [
        "# Performance",
        "",
        "Generated by `python -m bench.report render` from `bench/results/*.json`; do not edit by hand.",
        "Each ratio compares two runs made in the same benchmark run, so machine noise cancels as far as",
        "it can. The floor is the same effects done by one set-based statement with no orchestration.",
        "The load column is the 2-core machine's 1-minute load average: above 2, other work shared it.",
        "",
        "## Results",
        "",
        "| scenario | size | figure | value | goal | met | load before / after | machine | date | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    machines = sorted({s["machine"] for s in stamped})
    # Ratios move with the hardware (a faster CPU speeds the floor's one statement more than the
    # orchestration around the batches), so each row names its machine.
    tag = {m: chr(ord("A") + i) for i, m in enumerate(machines)}
    for s in stamped:
        what = ratio_label(s["scenario"], s["result"])
        for f in figures(s["result"], s["scenario"]):
            name = what if f.name == "ratio" else f.name.replace("_over_", " / ").replace("_", " ").replace(".", " ")
            met = "yes" if f.met else "**no**"
            lines.append(
                f"| {s['scenario']} | {size_of(s['result'])} | {name} | {f.value:.3f} | {f.goal} | {met} "
                f"| {load_of(s['result'])} | {tag[s['machine']]} | {s['date']} | {s['commit']} |"
            )
    missing = [name for name in SCENARIOS if name not in {s["scenario"] for s in stamped}]
    if missing:
        lines += ["", "No current result: " + ", ".join(f"`{m}`" for m in missing) + "."]
    lines += curve_section(stamped)
    lines += costs_section(stamped)
    lines += ["", "## Machines", ""] + [f"- {tag[m]}: {m}" for m in machines]
    lines += ["", "## How to measure", "", "```bash"]
    lines += [f"{cmd} > out.json  # {name}" for name, (_, cmd) in SCENARIOS.items()]
    lines += [
        "python -m bench.report record out.json   # keeps the result in bench/results/",
        "python -m bench.report render            # rewrites this page",
        "```",
        "",
        "Why the designs are what they are: [decisions](decisions/).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record", help="keep a benchmark's JSON output as its scenario's current result")
    rec.add_argument("output", type=Path, help="a file holding what the benchmark printed")
    rec.add_argument("--scenario", choices=list(SCENARIOS), help="for a benchmark whose output names none")
    rec.add_argument("--commit", help="the commit the benchmark ran (default: HEAD)")
    ren = verbs.add_parser("render", help="write docs/performance.md from bench/results/")
    ren.add_argument("--check", action="store_true", help="exit 1 when the page differs from the results")
    args = parser.parse_args()
    if args.verb == "record":
        for path in record(json.loads(args.output.read_text()), commit=args.commit, scenario=args.scenario):
            print(f"recorded {path.relative_to(ROOT)}")
        return 0
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("docs/performance.md is stale: run python -m bench.report render", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
