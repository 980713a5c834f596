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
    assert "| poisoned_cohort | 1,000 accounts | poisoned / clean cohort, accounts/s | 0.700 | >= 0.5 | yes | - |" in page
