"""The dashboard and the alert rules in deploy/, checked against a real Prometheus (Debian's package).

`promtool` checks the rules and runs their unit tests; then a Prometheus of the test's own scrapes a
real worker through a short cleanup (planner on) and a ledger night, and every dashboard query and
every alert's query (its expression without the threshold) must return at least one series: a
renamed metric or label breaks this test, not a night on call.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from temporalio.client import Client

from devstack.embedded import free_port
from tests.conftest import WorkerProcesses
from tests.helpers import deadline_in, seed
from tests.ledger_helpers import reconcile, seed_day

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboard.json"
THRESHOLD = re.compile(r"^(?P<query>.+?)\s+(?:>|<|==|!=|>=|<=)\s+(?P<threshold>[\d.\s*]+)$", re.DOTALL)


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip(f"{name} is not installed: apt-get install prometheus")
    return path


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def alert_queries() -> list[tuple[str, str]]:
    out = []
    for rule in alert_rules():
        m = THRESHOLD.match(rule["expr"].strip())
        assert m, f"{rule['alert']}: write the expression as `<query> <comparison> <threshold>`"
        out.append((rule["alert"], m["query"]))
    return out


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = binary("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", ALERTS_TEST.name],
        cwd=ALERTS_TEST.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    tested_alerts = {case["alertname"] for t in tests for case in t.get("alert_rule_test", [])}
    firing = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    names = {rule["alert"] for rule in alert_rules()}
    assert tested_alerts == names and firing == names, "every alert has a unit test in which it fires"


def test_the_dashboard_covers_what_operators_watch() -> None:
    exprs = " ".join(e for _, e in dashboard_queries())
    for metric in (
        "cleanup_lateness_seconds_bucket",
        "cleanup_lateness_max_seconds",
        "planner_overdue_accounts",
        "held_accounts",
        "cleanups_in_flight",
        "cleanup_accounts_failed",
        "outbox_backlog",
        "outbox_dead_letters",
        "ledger_corrections",
        "ledger_review_rows",
        "load_budget_throttled",
        "worker_ready",
    ):
        assert metric in exprs, f"no dashboard panel reads {metric}"


class Prometheus:
    """A Prometheus of the test's own: temporary storage, a free port, one scrape target."""

    def __init__(self, target: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="test-prometheus-"))
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "worker", "static_configs": [{"targets": [target]}]}],
        }
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={self.root / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


async def empty_queries(prom: Prometheus, queries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    empty = []
    for name, expr in queries:
        try:
            found = await asyncio.to_thread(prom.query, expr)
        except OSError:  # still starting
            found = []
        if not found:
            empty.append((name, expr))
    return empty


async def test_every_panel_and_rule_query_returns_series_from_a_real_worker(
    worker_processes: WorkerProcesses, pool: asyncpg.Pool, client: Client, task_queue: str
) -> None:
    metrics_port = free_port()
    worker_processes.start(CLEANUP_PLANNER="on", METRICS_PORT=str(metrics_port), METRICS_HOST="127.0.0.1")
    prom = Prometheus(f"127.0.0.1:{metrics_port}")
    try:
        await seed(pool, deadline_in(3), 30)  # the planner cleans them at their deadline
        business_date = date(2026, 3, 1)
        await seed_day(pool, business_date, payments=300, shards=2)
        await reconcile(client, pool, task_queue, business_date)

        queries = dashboard_queries() + alert_queries()
        deadline = time.monotonic() + 240
        empty = await empty_queries(prom, queries)
        while empty and time.monotonic() < deadline:
            await asyncio.sleep(2)
            empty = await empty_queries(prom, empty)
        assert not empty, f"queries with no series: {empty}\n{worker_processes.logs()[-3000:]}"
        cleaned = await asyncio.to_thread(prom.query, "sum(cleanup_accounts_cleaned)")
        assert float(cleaned[0]["value"][1]) > 0, "the cleanup ran in the scraped worker"
    finally:
        prom.close()
