"""The evaluation harness run as a user runs it: `python -m devstack harness ...`.

The quick profile must pass; a deliberately broken invariant must make it fail (a harness that
cannot fail proves nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from core.config import PROJECT_ROOT
from harness.runner import render_table
from harness.scenarios import registry

# Each run starts whole stacks of its own: under `./dev test` (xdist, `--dist loadgroup`) one worker
# runs them one at a time, with the benchmarks (tests/test_bench_smoke.py), while the others run the rest.
pytestmark = [pytest.mark.timeout(600), pytest.mark.server, pytest.mark.xdist_group("whole_stacks")]


def start_harness(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "CLEANUP_FAILPOINTS")}
    return subprocess.Popen(
        [sys.executable, "-m", "devstack", "harness", *args],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(run: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = run.communicate(timeout=580)
    finally:
        stop(run)
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


def stop(run: subprocess.Popen[str]) -> None:
    """Interrupt a harness still running (SIGINT: its stack stops its Temporal server and workers,
    which run in sessions of their own and would outlive a SIGKILL), then kill it if it hangs."""
    if run.poll() is not None:
        return
    run.send_signal(signal.SIGINT)
    try:
        run.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()


def harness(*args: str) -> subprocess.CompletedProcess[str]:
    return finish(start_harness(*args))


@pytest.fixture(scope="module")
def injected_runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both injected-violation runs, started side by side at once (each mostly waits on its own
    stack): each test reads its own."""
    runs = {flag: start_harness("--scenarios", "replay", flag, "--json") for flag in INJECTIONS}
    yield runs
    for run in runs.values():
        stop(run)


INJECTIONS = ("--inject-violation", "--inject-ordering-violation")


def failed_rows(done: subprocess.CompletedProcess[str]) -> str:
    """The failing rows' violations and notes first: the tail of the whole report may not hold them."""
    try:
        rows = json.loads(done.stdout)["rows"]
    except (ValueError, KeyError, TypeError):
        return ""
    bad = [{k: r.get(k) for k in ("scenario", "violations", "notes", "seconds")} for r in rows if not r.get("passed")]
    return json.dumps(bad, indent=1) + "\n" if bad else ""


# The quick profile's default scenarios in three groups, each a harness process of its own run side
# by side: most of a scenario's time is waiting (deadlines, heartbeat timeouts), not CPU, so the
# groups at once keep the suite near its time budget. The groups are of about equal length (the kill
# scenario alone is the longest, then zombie and renewal order); every default scenario is in
# exactly one group.
GROUPS = [
    ["kill", "oversized", "schedule", "renewal-race"],
    ["zombie", "renewal-order", "db-faults"],
    ["replay", "delay", "consumers", "server-restart", "late-data", "planner-kills"],
]


@pytest.mark.whole_machine  # its scenarios race their own stacks (a zombie's batches open at once)
def test_quick_profile_passes_every_scenario():
    names = [n for group in GROUPS for n in group]
    assert sorted(names) == sorted(registry()), "every default scenario in exactly one group"
    with ThreadPoolExecutor(len(GROUPS)) as pool:
        runs = list(
            pool.map(
                lambda group: harness("--profile", "quick", "--seed", "7", "--scenarios", ",".join(group), "--json"),
                GROUPS,
            )
        )
    report: dict[str, Any] = {"rows": []}
    for done in runs:
        assert done.returncode == 0, failed_rows(done) + done.stdout[-4000:] + done.stderr[-4000:]
        report["rows"] += json.loads(done.stdout)["rows"]
    rows = {r["scenario"]: r for r in report["rows"]}
    assert len(rows) == 13, list(rows)
    for name, r in rows.items():
        assert r["passed"], (name, r["violations"], r["notes"])
        assert r["runs"] >= 1 and r["duplicates"] == 0 and r["lost"] == 0, (name, r)
        assert r["ordering"] == 0, (name, r["violations"], r["notes"])
        assert r["operator_visibility"], (name, r["evidence"])
    kill = next(r for r in report["rows"] if r["scenario"].startswith("2 "))
    assert kill["runs"] >= 14, "every commit point stopped at least once with SIGKILL and once with SIGTERM"
    # Each stop's recovery was seen in its workflow's history (the figures are the harness's to
    # report, not this test's to bound: docs/harness.md).
    recovery = {(r["work"], r["signal"]): r for r in kill["recovery"]}
    works = ["cleanup partition", "claim", "settlement (cleanup)", "ledger shard", "settlement (ledger)"]
    works.append("outbox relay")
    assert set(recovery) == {(w, s) for w in works for s in ("SIGKILL", "SIGTERM")}, sorted(recovery)
    for r in recovery.values():
        assert r["measured"] == r["stops"] >= 1 and r["max"] is not None, r
    zombie = next(r for r in report["rows"] if r["scenario"].startswith("11 "))
    for job in ("cleanup partition", "ledger shard", "relay batch"):
        # The frozen zombie of each job was woken, worked late, and the job's tables did not change.
        assert any(f"frozen {job}: zombie woke" in e and "unchanged" in e for e in zombie["evidence"]), (
            job,
            zombie["evidence"],
        )
    late = rows["12 late data"]
    assert late["runs"] == 4 and any(e.endswith("ledger equal") for e in late["evidence"]), late["evidence"]
    planner = rows["13 planner under kills"]
    assert any("planner status" in e and "'overdue': 0" in e for e in planner["evidence"]), planner["evidence"]


def test_a_broken_invariant_makes_the_harness_fail(injected_runs):
    done = finish(injected_runs["--inject-violation"])

    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    [row] = report["rows"]
    assert not row["passed"] and row["duplicates"] >= 1
    assert any("dup_reminders=1" in v for v in row["violations"]), row["violations"]


def test_an_out_of_order_settlement_shows_in_the_ordering_column(injected_runs):
    """A settlement revision stamped before the one it follows: only the ordering column sees it."""
    done = finish(injected_runs["--inject-ordering-violation"])

    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    [row] = json.loads(done.stdout)["rows"]
    assert not row["passed"] and row["ordering"] >= 1, row
    assert row["duplicates"] == 0 and row["lost"] == 0, row
    assert any(v.startswith("ord_settlement_revisions=") for v in row["violations"]), row["violations"]
    # The table an operator reads is rendered from the same report (one harness run, not two).
    header, _, line = render_table(json.loads(done.stdout)).splitlines()[:3]
    assert "ordering violations" in header
    column = header.index("ordering violations")
    assert int(line[column:].split()[0]) >= 1, (header, line)


@pytest.mark.slow  # the parts are proven by default: test_cleanup_poison.py and scenarios 2 and 8
def test_opt_in_poison_scenario_passes():
    """Poisoned accounts under a kill after COMMIT and terminated connections."""
    done = harness("--scenarios", "poison", "--json")

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [row] = json.loads(done.stdout)["rows"]
    assert row["passed"] and row["duplicates"] == 0 and row["lost"] == 0, row
    assert any("failed=" in e and "retry-failed cleaned" in e for e in row["evidence"]), row["evidence"]
