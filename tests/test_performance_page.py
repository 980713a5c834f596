"""docs/performance.md is generated from bench/results/*.json and agrees with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report


def test_the_page_is_what_the_results_render() -> None:
    assert report.PAGE.read_text() == report.render(), "run: python -m bench.report render"


def test_every_result_names_a_known_scenario_commit_and_date() -> None:
    for path in report.RESULTS.glob("*.json"):
        stamped = json.loads(path.read_text())
        assert stamped["scenario"] == path.stem and stamped["scenario"] in report.SCENARIOS
        assert stamped["commit"] and stamped["date"] and stamped["machine"]
        assert report.figures(stamped["result"], stamped["scenario"]), path


def test_figures_are_the_ratio_and_every_figure_with_a_goal() -> None:
    doc = {"ratio": 0.9, "target": ">= 0.85", "a_over_b": 0.5, "a_over_b_target": ">= 0.6", "other": 3}
    got = report.figures(doc)
    assert [(f.name, f.value, f.goal, f.met) for f in got] == [
        ("ratio", 0.9, ">= 0.85", True),
        ("a_over_b", 0.5, ">= 0.6", False),
    ]


def test_a_goal_must_be_a_bound() -> None:
    assert report.goal_met(0.3, "<= 0.3") and not report.goal_met(0.31, "<= 0.3")
    with pytest.raises(ValueError, match="goal"):
        report.goal_met(1.0, "about 5")


def test_record_refuses_smoke_runs_and_stamps_each_scenario(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smoke"):
        report.record({"smoke": True, "scenarios": {}}, tmp_path)
    doc = {"scenario": "poisoned_cohort", "accounts": 1000, "ratio": 0.7, "target": ">= 0.5", "machine": "m"}
    (path,) = report.record(doc, tmp_path, commit="abc1234")
    stamped = json.loads(path.read_text())
    assert stamped["commit"] == "abc1234" and stamped["result"] == doc
    page = report.render(tmp_path)
    row = "| poisoned_cohort | 1,000 accounts | poisoned / clean cohort, accounts/s | 0.700 | >= 0.5 | yes | - |"
    assert row in page


def curve_point(objective: str, means: str, accounts_per_s: float, p99: float, floor_p99: float, held: float | None):
    return {
        "objective": objective,
        "means": means,
        "accounts_per_s": accounts_per_s,
        "throughput_over_no_budget": round(accounts_per_s / 4000, 3),
        "players_p99_ms": p99,
        "players_p99_over_alone_bracketed": round(p99 / 10, 3),
        "paced_floor_players_p99_ms": floor_p99,
        "p99_over_paced_floor": round(p99 / floor_p99, 3),
        "objective_held_fraction": held,
        "objective_windows": 0 if held is None else 4,
    }


def player_load_result() -> dict[str, object]:
    return {
        "scenario": "player_load",
        "accounts_per_cohort": 40000,
        "live_players": 20000,
        "player_rate_per_s": 150.0,
        "machine": "m",
        "window_seconds": 10.0,
        "players_alone_p99_ms": 10.0,
        "no_budget": {"accounts_per_s": 4000.0, "players_p99_ms": 30.0, "players_p99_over_alone_bracketed": 3.0},
        "curve": [
            curve_point("default", "commit probe <= 2 x baseline", 3000.0, 20.0, 19.0, 1.0),
            curve_point("ratio=1.5", "commit probe <= 1.5 x baseline", 2000.0, 16.0, 12.0, 0.75),
            curve_point("ratio=3", "commit probe <= 3 x baseline", 3900.0, 28.0, 27.0, None),
        ],
        "ratio": 1.053,
        "target": "<= 1.1",
        "objective_held_fraction": 1.0,
        "objective_held_fraction_target": ">= 0.95",
        "load_average_1m_before_and_after": {"alone": [1.0, 1.5], "budget[default]": [1.5, 2.5]},
    }


def test_the_load_budgets_curve_renders_from_a_player_load_result(tmp_path: Path) -> None:
    page = report.render(tmp_path)
    assert "No measured curve: `python -m bench.player_load" in page
    report.record(player_load_result(), tmp_path, commit="abc1234")
    page = report.render(tmp_path)
    assert "No measured curve" not in page
    what = "players' p99 under the default objective / under the floor paced at the same accounts/s"
    assert f"| player_load | 40,000 accounts per cohort, 20,000 players | {what} | 1.053 | <= 1.1 | yes |" in page
    assert (
        "| player_load | 40,000 accounts per cohort, 20,000 players | objective held fraction | 1.000 | >= 0.95 | yes |"
        in page
    )
    curve = page.split("## The load budget's curve", 1)[1].split("## Machine", 1)[0]
    assert "40,000 accounts per cohort, 20,000 players; " in curve and "abc1234" in curve and "1.0 / 2.5" in curve
    assert "Players alone: p99 10.0 ms." in curve
    rows = [line for line in curve.splitlines() if line.startswith("| ") and not line.startswith("| objective")]
    head = "| budget off | 4,000 | 1.000 | - | 30.0 | 3.00 | - | - | - | - | - |"
    assert rows == [
        head,
        "| default: commit probe <= 2 x baseline | 3,000 | 0.750 | - (-) | 20.0 | 2.00 | 19.0 | 1.053 "
        "| 1.00 of 4 | - | - |",
        "| ratio=1.5: commit probe <= 1.5 x baseline | 2,000 | 0.500 | - (-) | 16.0 | 1.60 | 12.0 | 1.333 "
        "| 0.75 of 4 | - | - |",
        "| ratio=3: commit probe <= 3 x baseline | 3,900 | 0.975 | - (-) | 28.0 | 2.80 | 27.0 | 1.037 "
        "| no window | - | - |",
    ]


def test_a_player_load_result_without_a_curve_keeps_what_its_ratio_compared(tmp_path: Path) -> None:
    doc = {"scenario": "player_load", "accounts_per_cohort": 1000, "ratio": 1.3, "target": "<= 1.2", "machine": "m"}
    report.record(doc, tmp_path, commit="abc1234")
    page = report.render(tmp_path)
    assert "| players' p99 with the default budget / players alone | 1.300 | <= 1.2 | **no** |" in page
    assert "No measured curve" in page


def test_a_nested_figure_is_read_by_its_path_and_judged_by_its_goal(tmp_path: Path) -> None:
    doc = {
        "scenario": "planner_lateness",
        "accounts": 100000,
        "lateness_seconds": {"p50": 0.6, "p99": 1.2, "max": 5.5},
        "load_average_1m": {"before": 0.3, "after": 0.9},
        "machine": "m",
    }
    report.record(doc, tmp_path, commit="abc1234")
    got = [(f.name, f.value, f.goal, f.met) for f in report.figures(doc, "planner_lateness")]
    assert got == [("ratio", 1.2, "<= 2", True), ("lateness_seconds.max", 5.5, "<= 5", False)]
    page = report.render(tmp_path)
    assert "| lateness seconds max | 5.500 | <= 5 | **no** | 0.3 / 0.9 |" in page
