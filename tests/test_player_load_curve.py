"""How bench.player_load judges the load budget's objective, and the `--objectives` it accepts."""

from __future__ import annotations

import pytest

from bench import player_load
from budget.controller import BudgetSettings, StressLimits

START = 1000.0


def limits(ratio: float = 2.0, max_ms: float | None = None) -> StressLimits:
    return player_load.Objective(probe_ratio=ratio, probe_max_ms=max_ms).limits(BudgetSettings())


def probes(*means: float, every: float = 0.5, window: float = 10.0) -> list[tuple[float, float]]:
    """Probes every `every` seconds, each window's all at that window's value."""
    return [(START + k * window + i * every, ms) for k, ms in enumerate(means) for i in range(int(window / every))]


def test_windows_are_ten_seconds_and_a_last_partial_one_counts_from_five() -> None:
    got = player_load.objective_windows(probes(2.0, 2.0, 2.0), [], (START, START + 25.0), limits(), 2.0)
    assert [(w["from_s"], w["seconds"]) for w in got] == [(0.0, 10.0), (10.0, 10.0), (20.0, 5.0)]
    got = player_load.objective_windows(probes(2.0, 2.0, 2.0), [], (START, START + 24.9), limits(), 2.0)
    assert [w["seconds"] for w in got] == [10.0, 10.0], "a last window under 5 s is not judged"
    assert player_load.objective_windows(probes(2.0), [], (START, START + 4.0), limits(), 2.0) == []


def test_a_window_holds_as_the_budget_judges_the_probe_mean() -> None:
    # baseline 4 ms, ratio 2: 8 ms holds, 8.5 does not
    got = player_load.objective_windows(probes(8.0, 8.5), [], (START, START + 20.0), limits(2.0), 4.0)
    assert [w["held"] for w in got] == [True, False]
    assert "8.5 ms > 2 x baseline 4.0 ms" in got[1]["why_not"]
    # within probe_min_ms (1 ms) of a tiny baseline it holds, whatever the ratio
    got = player_load.objective_windows(probes(1.2), [], (START, START + 10.0), limits(2.0), 0.3)
    assert got[0]["held"]
    # an absolute bound applies beside the ratio
    got = player_load.objective_windows(probes(7.0), [], (START, START + 10.0), limits(2.0, max_ms=6.0), 4.0)
    assert not got[0]["held"] and "> 6 ms" in got[0]["why_not"]


def test_a_window_without_a_probe_did_not_hold_and_players_are_counted_per_window() -> None:
    players = [(START + 1.0, 0.010), (START + 2.0, 0.030), (START + 12.0, 0.005)]
    got = player_load.objective_windows(probes(1.0), players, (START, START + 20.0), limits(), 1.0)
    assert [w["held"] for w in got] == [True, False]
    assert got[1]["probes"] == 0 and "no commit probe" in got[1]["why_not"]
    assert [w["players_p99_ms"] for w in got] == [30.0, 5.0]
    assert player_load.held_fraction(got) == 0.5 and player_load.held_fraction([]) is None


def test_objectives_parse_into_the_budget_settings_they_set() -> None:
    got = player_load.parse_objectives("default, ratio=1.5,max_ms=20,ratio=3+max_ms=25")
    assert [(o.probe_ratio, o.probe_max_ms) for o in got] == [(None, None), (1.5, None), (None, 20.0), (3.0, 25.0)]
    assert [o.label for o in got] == ["default", "ratio=1.5", "max_ms=20", "ratio=3+max_ms=25"]
    settings = BudgetSettings()
    assert got[0].limits(settings).probe_ratio == settings.probe_ratio
    assert got[3].describe(settings) == "commit probe <= baseline + 5 ms and <= 3 x baseline and <= 25 ms"


@pytest.mark.parametrize(
    ("objectives", "says"),
    [
        ("ratio=nan", "finite number > 1"),
        ("ratio=inf", "finite number > 1"),
        ("ratio=-2", "finite number > 1"),
        ("ratio=1", "finite number > 1"),
        ("max_ms=-5", "finite number > 0"),
        ("max_ms=NaN", "finite number > 0"),
        ("ratio=fast", "must be a number"),
        ("speed=2", "unknown objective 'speed=2'"),
        ("ratio", "unknown objective 'ratio'"),
        ("default,,ratio=3", "unknown objective ''"),
        ("ratio=3,ratio=3.0", "given twice"),
        ("ratio=2+ratio=3", "given twice"),
    ],
)
def test_bad_objectives_exit_2_before_anything_starts(
    objectives: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        player_load.main(["--objectives", objectives])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_bad_window_seconds_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        player_load.main(["--window-seconds", "0"])
    assert stopped.value.code == 2 and "> 0" in capsys.readouterr().err
