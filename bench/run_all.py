"""Every benchmark, one after the other, as one JSON document: `python -m bench.run_all [--smoke]`.

Full sizes: cohort cleanup 100,000 accounts, ledger reconciliation 1,000,000 payments,
2,000 single-account cleanups, ledger rerun 1,000,000 payments, the poisoned cohort, players
during a cleanup, the batch plans' growth per key (the quadratic-plan guard), and a 100,000-account
cohort through the planner beside the floor. `--smoke` runs tiny sizes (what
tests/test_bench_smoke.py runs) to check that everything still works. Each scenario starts its
own Temporal dev server and database; a scenario that fails is reported and the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from bench import (
    batch_plan,
    cohort_cleanup,
    ledger_reconciliation,
    ledger_rerun,
    planner_cohort,
    player_load,
    poisoned_cohort,
    single_accounts,
)
from bench.common import machine, run_benchmark

Scenario = Callable[[], Awaitable[dict[str, Any]]]

FULL: dict[str, Scenario] = {
    "cohort_cleanup": lambda: cohort_cleanup.run(accounts=100_000),
    "ledger_reconciliation": lambda: ledger_reconciliation.run(payments=1_000_000),
    "single_account_cleanups": lambda: single_accounts.run(workflows=2000),
    "ledger_rerun": lambda: ledger_rerun.run(payments=1_000_000),
    "poisoned_cohort": lambda: poisoned_cohort.run(accounts=100_000, poisoned=100),
    "player_load": lambda: player_load.run(accounts=100_000, players=20_000),
    "batch_plan": lambda: batch_plan.run(accounts=20_000, payments=40_000),
    "cohort_through_planner": lambda: planner_cohort.run(accounts=100_000),
}
SMOKE: dict[str, Scenario] = {
    "cohort_cleanup": lambda: cohort_cleanup.run(accounts=300, partitions=4, parallel=2, batch_size=50),
    "ledger_reconciliation": lambda: ledger_reconciliation.run(payments=300, shards=4, parallel=2, batch_size=50),
    "single_account_cleanups": lambda: single_accounts.run(workflows=20),
    "ledger_rerun": lambda: ledger_rerun.run(payments=300, shards=4, parallel=2, batch_size=50, with_direct=False),
    "poisoned_cohort": lambda: poisoned_cohort.run(accounts=400, poisoned=4, partitions=4, parallel=2, batch_size=50),
    "player_load": lambda: player_load.run(
        accounts=300, players=200, rate=50, alone_seconds=1, partitions=4, parallel=2, batch_size=50
    ),
    "batch_plan": lambda: batch_plan.run(accounts=2000, sizes=(200, 1000), repeat=1, payments=4000),
    "cohort_through_planner": lambda: planner_cohort.run(
        accounts=60,
        budgets=("off",),
        workers=1,
        drain=60,
        lead=4,
        planner={"tick_seconds": "1", "max_idle_seconds": "1"},
    ),
}


def target_met(ratio: float, target: str) -> bool:
    op, _, value = target.partition(" ")
    return ratio >= float(value) if op == ">=" else ratio <= float(value)


async def run_all(smoke: bool = False, only: list[str] | None = None) -> dict[str, Any]:
    scenarios = SMOKE if smoke else FULL
    results: dict[str, Any] = {}
    summary: list[dict[str, Any]] = []
    started = datetime.now(UTC)
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result = await scenario()
        except Exception as err:  # one broken scenario must not hide the others' figures
            results[name] = {"error": repr(err), "traceback": traceback.format_exc()}
            summary.append({"scenario": name, "error": repr(err)})
            continue
        result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = result
        summary.append(
            {
                "scenario": name,
                "ratio": result["ratio"],
                "target": result["target"],
                "met": target_met(result["ratio"], result["target"]),
            }
        )
    return {
        "smoke": smoke,
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "summary": summary,
        "scenarios": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every scenario runs")
    parser.add_argument("--only", action="append", choices=list(FULL), help="run only this scenario (repeatable)")
    args = parser.parse_args()
    document = run_benchmark(run_all(args.smoke, args.only))
    print(json.dumps(document, indent=2))
    return 1 if any("error" in s for s in document["summary"]) else 0


if __name__ == "__main__":
    sys.exit(main())
