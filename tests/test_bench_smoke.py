"""Tiny runs of every benchmark so they cannot rot. No speed is asserted: figures are in docs/performance.md."""

from __future__ import annotations

import json

import pytest

from bench import (
    batch_plan,
    batch_sizes,
    cohort_cleanup,
    game_realm,
    game_schema,
    ledger_reconciliation,
    ledger_rerun,
    outbox_delivery,
    outbox_writes,
    planner_cohort,
    planner_events,
    planner_lateness,
    player_load,
    poisoned_cohort,
    single_accounts,
)
from harness import restart_chaos

# Each benchmark starts its own stack: under `./dev test` (xdist, `--dist loadgroup`) one worker runs
# them one at a time, with the harness runs (tests/test_harness.py), while the others run the rest.
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("whole_stacks")]


@pytest.mark.whole_machine  # the benchmark checks its cohort was moved well inside its lead (5 s)
async def test_cohort_cleanup_benchmark_runs_and_measures_a_ratio(tmp_path):
    timeline = tmp_path / "timeline.json"
    result = await cohort_cleanup.run(
        accounts=300,
        partitions=4,
        parallel=2,
        batch_size=50,
        sweep=(25, 100),
        timeline_file=str(timeline),
        compare_parallel=1,
    )
    assert result["pipeline_cleaned"] == [300, 300] and result["direct_cleaned"] == [300, 300]
    assert [(r["batch_size"], r["cleaned"]) for r in result["direct_batch_size_sweep"]] == [
        (25, 300),
        (100, 300),
        (100, 300),
        (25, 300),
    ]
    by_size = result["direct_batch_size_sweep_by_size"]
    assert [(r["batch_size"], r["runs"]) for r in by_size["sizes"]] == [(25, 2), (100, 2)]
    assert isinstance(by_size["each_no_slower_than_the_one_before"], bool)
    assert all(0 <= r["batches_machine_busy"] <= 1 for r in by_size["sizes"])
    assert [t["batch_size"] for t in json.loads(timeline.read_text())] == [25, 100, 100, 25]
    assert result["floor_cleaned"] == [300, 300]
    assert result["floor_receipts"] == [300, 300]  # the same effects as the batches, receipts included
    assert result["compare_parallel_partitions"] == 1 and result["compare_direct_cleaned"] == [300, 300]
    assert result["direct_over_compare_parallel"] > 0
    assert result["direct_over_floor"] > 0 and result["pipeline_over_floor"] > 0
    assert result["ratio"] > 0
    assert result["worker_0_peak_rss_mib"] > 0 and result["temporal_server_peak_rss_mib"] > 0


async def test_game_schema_benchmark_cleans_every_user_by_both_paths_and_measures_a_ratio():
    """bench.game_schema at a tiny size: both floor runs and both pipeline runs clean every user (the
    script asserts it, and that no game row of a cleaned user is left), with their receipts."""
    result = await game_schema.run(users=200, partitions=4, parallel=2, batch_size=50)
    assert result["floor_rows"]["users"] == result["floor_rows"]["receipts"] == 200
    assert result["floor_rows"]["inventory"] == 800 and result["floor_rows"]["friends"] == 200
    assert result["pipeline_over_floor"] > 0


async def test_game_realm_benchmark_cleans_three_cohorts_leaving_nothing_behind():
    """bench.game_realm at a tiny size: the floor, the cohort through the planner and the spread cohort
    each clean every player (nothing personal left, counters right), and the unindexed sender column is
    reported and fixed before the workers start."""
    result = await game_realm.run(
        users=300, spread=10, workers=1, drain=60, planner={"max_idle_seconds": "2", "tick_seconds": "1"}
    )
    assert [m["target"] for m in result["missing_indexes_reported_and_built"]] == ["realm.notifications (sender_id)"]
    assert result["floor"]["cleaned"] == result["floor"]["receipts"] == 300
    assert result["pipeline"]["cleaned"] == 300 and result["lateness"]["cleaned"] == 300
    assert result["left_behind"] == {
        "floor": {"archived": 600},
        "pipeline": {"archived": 600},
        "lateness": {"archived": 600},
        "wrong_counters": {"players": 0, "groups": 0},
    }
    assert result["ratio"] > 0 and result["lateness_p99_seconds"] is not None


async def test_single_account_benchmark_runs_and_measures_a_ratio():
    result = await single_accounts.run(workflows=20)
    assert result["accounts_cleaned"] == 20
    assert result["ratio"] > 0


async def test_outbox_delivery_benchmark_runs_and_measures_a_ratio():
    result = await outbox_delivery.run(events=300, batch_max=50, claim=100, relays=2, rounds=1)
    [relay] = result["relay_runs"]
    assert relay["delivered"] == relay["recorded_delivered"] == 300 and relay["by_status"] == {"delivered": 300}
    assert [f["delivered"] for f in result["floors"]] == [300, 300]
    # Every event through the batch endpoint, each once: 300 relayed, 600 by the floors, no duplicate.
    assert result["provider"]["delivered"] == result["provider"]["batch_messages"] == 900
    assert result["provider"]["duplicates"] == 0
    assert result["ratio"] > 0 and result["relay_events_per_s"] > 0


async def test_outbox_writes_benchmark_runs_and_measures_a_ratio():
    result = await outbox_writes.run(events=200, claim=100)  # each claim full, each event recorded (asserted)
    for part in ("claim_as_shipped", "record_as_shipped", "claim_lock_only", "record_into_log"):
        assert result[part]["wal_mb_per_100k"] > 0
    assert result["ratio"] is None or result["ratio"] > 0


async def test_ledger_reconciliation_benchmark_runs_and_measures_a_ratio():
    result = await ledger_reconciliation.run(payments=300, shards=4, parallel=2, batch_size=50)
    assert result["pipeline_outcome"] == result["expected"]
    assert result["direct_outcomes"] == result["direct_expected"]
    assert result["floor_outcomes"] == result["floor_expected"]
    assert result["direct_over_floor"] > 0 and result["pipeline_over_floor"] > 0
    assert result["pipeline_outcome"]["keys_examined"] > 300 and result["pipeline_outcome"]["corrected"] > 0
    assert result["ratio"] > 0
    assert result["worker_0_peak_rss_mib"] > 0 and result["temporal_server_peak_rss_mib"] > 0


async def test_ledger_rerun_benchmark_changes_nothing_and_measures_a_ratio():
    result = await ledger_rerun.run(
        payments=300, shards=4, parallel=2, batch_size=50, with_direct=False, changed_per_10000=1000
    )
    assert result["first_outcome"] == result["rerun_outcome"] == result["expected"]
    assert result["rerun_reports_same_as_first"]
    assert result["rerun_shards_unchanged_since_report"] == 4, "the rerun took the unchanged-inputs shortcut"
    assert result["counters_saw_the_first_run"], result["first_run_inserts_counted_and_held"]
    assert result["ratio"] > 0
    deltas = result["rerun_table_deltas"]
    for table in ("ledger_corrections", "ledger_review"):
        assert deltas[table]["n_tup_ins"] == 0, deltas
        assert deltas[table]["n_dead_tup"] == 0, deltas
        assert deltas[table]["heap_bytes"] == 0 and deltas[table]["identity_last_value"] == 0, deltas
    assert result["rerun_rows_inserted"] == 0
    assert deltas["ledger_payments"]["n_tup_upd"] == 0
    assert result["rerun_rows_written"] == 0 and result["rerun_dead_tuples"] == 0, deltas
    assert result["rerun_latest_revision"] == 1, "an unchanged re-check records no revision"
    # 10% of the payments changed: the re-check judges the changed shards again and adds exactly
    # what the change must add, as revision 2, without a dead tuple in the effect tables.
    changed = result["changed"]
    assert changed["change"]["payments_changed"] > 0 and changed["change"]["expect_new_corrections"] > 0
    assert changed["shards_judged_again"] == changed["change"]["shards_changed"]
    assert changed["revision"]["revision"] == 2 and changed["revision_adds_what_the_change_must"], changed
    assert changed["dead_tuples_in_effect_tables"] == 0 and changed["rows_written"] > 0, changed
    assert changed["ratio"] > 0


async def test_poisoned_cohort_benchmark_isolates_the_poisoned_and_measures_a_ratio():
    result = await poisoned_cohort.run(accounts=400, poisoned=4, partitions=4, parallel=2, batch_size=50)
    assert result["clean_cleaned"] == 400
    assert (result["poisoned_cleaned"], result["poisoned_failed"]) == (396, 4)
    assert result["ratio"] > 0


async def test_player_load_benchmark_measures_the_budgets_curve_beside_the_paced_floor():
    objectives = player_load.parse_objectives("default,ratio=3")
    result = await player_load.run(
        accounts=300,
        players=200,
        rate=50,
        alone_seconds=1,
        partitions=4,
        parallel=2,
        batch_size=50,
        objectives=objectives,
        floor_slice=50,
        half_floor=True,
        window_seconds=0.2,
    )
    assert result["cohorts"] == 6, "the unbudgeted cohort, a budgeted and a paced one per objective, the half floor's"
    phases = ["alone", "no_budget", "alone_between", "paced_floor_half", "alone_after_floor_half"]
    for label in ("default", "ratio=3"):
        phases += [f"budget[{label}]", f"alone_after[{label}]", f"paced_floor[{label}]", f"alone_after_floor[{label}]"]
    assert sorted(result["players"]) == sorted(phases)
    for phase in phases:
        assert result["players"][phase]["queries"] > 0 and result["players"][phase]["errors"] == 0
    assert result["cleanup_no_budget"]["cleaned"] == 300
    assert [p["objective"] for p in result["curve"]] == ["default", "ratio=3"]
    for point in result["curve"]:
        measured = result["by_objective"][point["objective"]]
        # each objective's cohort is cleaned in full, then the floor's at exactly its throughput
        assert measured["cleanup"]["cleaned"] == measured["paced_floor"]["cleaned"] == 300
        assert measured["paced_floor"]["paced_at_accounts_per_s"] == point["accounts_per_s"]
        assert measured["paced_floor"]["slices"] == 6
        assert point["p99_over_paced_floor"] > 0 and point["probe_baseline_ms"] > 0
        assert point["objective_windows"] == len(measured["windows"]) > 0
        assert 0 <= point["objective_held_fraction"] <= 1
        assert measured["budget_after_run"]["doing"] and measured["budget_after_run"]["limited_by"]
    assert result["figures_for_objective"] == "default"
    assert result["ratio"] == result["curve"][0]["p99_over_paced_floor"] and result["target"] == "<= 1.1"
    half = result["paced_floor_half"]
    assert half["cleaned"] == 300 and half["paced_at_accounts_per_s"] == round(
        0.5 * result["cleanup_no_budget"]["accounts_per_s"], 1
    )
    assert result["p99_ratio_floor_at_half_throughput"] > 0
    assert result["budget_counters_after_no_budget_run"]["granted"] > 0, "the unbudgeted run still asked"
    assert result["commit_probe_errors"] == 0


async def test_planner_events_benchmark_counts_every_workflows_history_per_account_and_idle_day():
    result = await planner_events.run(
        dense=30,
        per_second=4,
        per_minute=1,
        idle_seconds=5,
        lead=6,
        workers=1,
        planner={"tick_seconds": "1", "max_idle_seconds": "2"},
        curve=(3.0,),
        drain=60,
    )
    for name in ("dense", "one_per_second", "one_per_minute"):
        spread = result[name]
        assert spread["all_cleaned"] and spread["cleanups"] >= 1, spread
        assert spread["history_events"] == sum(spread["events_by_workflow_type"].values())
        assert spread["billable"]["workflow_starts"] >= spread["cleanups"] + 1  # and the planner
        assert spread["lateness_seconds"]["p99"] is not None
    assert result["dense"]["cleanups"] <= 2, "30 accounts within 1 s: one cohort (two across a window's edge)"
    idle = result["idle"]
    assert idle["iterations_measured"] >= 1 and 1.5 <= idle["seconds_per_iteration"] <= 4
    assert idle["events_per_day"] > 0 and idle["billable_per_day"]["timers"] > 0
    assert [p["lateness_objective_seconds"] for p in result["curve"]] == [3.0]


async def test_planner_lateness_benchmark_cleans_every_account_once_by_the_planner_alone():
    result = await planner_lateness.run(
        accounts=40,
        spread_seconds=1,
        lead_seconds=3,
        workers=1,
        planner={"tick_seconds": "1", "max_idle_seconds": "1"},
        drain_seconds=60,
    )
    assert result["all_cleaned"] and (result["cleaned"], result["not_cleaned"]) == (40, 0)
    assert result["idempotency_records_per_account"] == {"min": 1, "max": 1, "total": 40}
    assert sum(c["accounts"] for c in result["cleaned_by"].values()) == 40
    assert "other" not in result["cleaned_by"], "cleaned by the planner's cleanups only"
    assert result["lateness_seconds"]["min"] >= 0, "never cleaned before the deadline"
    assert result["temporal_server_peak_rss_mib"] > 0 and result["worker_0_peak_rss_mib"] > 0


async def test_planner_cohort_benchmark_cleans_a_registered_cohort_through_the_planner_beside_the_floor():
    """bench.planner_cohort, one budget mode, tiny: the cohort registered through `set_deadline` is
    cleaned by one planner bucket (nobody started a cleanup), the floor's cohort by the floor alone,
    and the timeline orders the bucket's phases after its deadline."""
    result = await planner_cohort.run(
        accounts=60,
        budgets=("off",),
        workers=1,
        drain=60,
        lead=8,  # the deadline is cut to whole seconds and must stay two ticks ahead after a settle
        planner={"tick_seconds": "1", "max_idle_seconds": "1"},
    )
    off = result["budget_off"]
    assert off["registered"] == off["cleaned"] == 60
    assert result["floor_accounts_per_s"] > 0 and result["blackbox_over_floor"] > 0
    assert result["ratio"] == result["blackbox_over_floor"] and result["target"] == ">= 0.7"
    [bucket] = off["timeline"]["cleanups"]
    assert bucket["cleanup_id"].startswith("cleanup-bucket-") and bucket["accounts"] == 60
    assert off["timeline"]["first_claimed"] >= 0, "never claimed before the deadline"
    # A cohort of one partition claims, cleans and settles in one activity: its steps have no marks.
    phases = ("claim_started", "claim_done", "last_partition_done", "closed")
    marks = [bucket[k] for k in phases if bucket[k] is not None]
    assert bucket["closed"] is not None and marks == sorted(marks)
    assert off["seconds_deadline_to_last_cleaned"] == off["timeline"]["last_cleaned"] > 0
    # the phases are consecutive: together they are the time from the deadline to the last account
    assert sum(off["where_the_time_goes_s"].values()) == pytest.approx(off["timeline"]["last_cleaned"], abs=0.01)
    assert result["workers_alive_at_end"] == [True]


async def test_restart_chaos_benchmark_runs_the_night_calm_and_under_restarts_with_nothing_lost():
    """bench.restart_chaos, tiny: both nights clean the cohort, close the ledger date and deliver
    every reminder; the harness's checks find nothing doubled or lost and no worker died."""
    chaos = restart_chaos.Chaos(restarts=1, every=(0.5, 1.0), down_max=2.0, seed=3)
    result = await restart_chaos.run(
        accounts=50,
        payments=300,
        chaos=chaos,
        within=120,
        lead=4,
        planner_env={"PLANNER_TICK_SECONDS": "1", "PLANNER_MAX_IDLE_SECONDS": "1"},
    )
    for night in (result["calm"], result["under_restarts"]):
        assert night["cleaned"] == night["reminders"] == 50 and night["reminders_pending"] == 0, night
        assert night["cohort_closed_s"] > 0 and night["ledger_closed_s"] > 0 and night["last_reminder_s"] > 0
    assert (result["duplicates"], result["lost"], result["problems"]) == (0, 0, []), result
    assert result["worker_deaths"] == 0, result["worker_logs"]
    assert result["chaos"]["restarts_during_the_night"] == len(result["chaos"]["downtime_s"]) <= 1
    assert result["ratio"] > 0 and result["ledger_closed_ratio"] > 0


async def test_batch_plans_process_as_many_rows_per_key_at_both_sizes():
    """The guard against a batch plan that turns quadratic again: each job's batch statement under
    EXPLAIN ANALYZE, custom and generic plans, at 200 and 1,000 keys. Rows processed are counted, not
    timed; the cleanup statement from before its fix grew 4.2x per account here."""
    result = await batch_plan.run(accounts=2000, sizes=(200, 1000), repeat=1, payments=4000)
    assert set(result["rows_per_key_growth"]) == {
        "custom_plan_growth",
        "generic_plan_growth",
        "analyzed_custom_plan_growth",
        "analyzed_generic_plan_growth",
        "ledger_custom_plan_growth",
        "ledger_generic_plan_growth",
    }
    assert result["worst_rows_per_key_growth"] < batch_plan.GROWTH_LIMIT, result["rows_per_key_growth"]
    # No plan reads a whole table per batch (the cleanup's join of its batch to the accounts did, as
    # a hash of every account, before it was pinned to the batch's keys).
    assert result["full_table_scans"] == {}, result["full_table_scans"]


async def test_batch_sizes_benchmark_interleaves_the_sizes_and_cleans_every_account(tmp_path):
    """bench.batch_sizes at a tiny size: every account cleaned once, each size measured by its own
    backends' statements, a ratio printed per step (its value at this size means nothing)."""
    statements = tmp_path / "statements.jsonl"
    result = await batch_sizes.run(accounts=6000, sizes=(50, 100, 500), parallel=2, statements_file=str(statements))
    assert result["cleaned"] == 6000
    assert [s["batch_size"] for s in result["sizes"]] == [50, 100, 500]
    assert all(s["statements"] > 0 and s["cpu_us_per_account"] > 0 for s in result["sizes"])
    assert [(s["from"], s["to"]) for s in result["steps"]] == [(50, 100), (100, 500)]
    assert result["cycles_counted"] >= 1 and result["ratio"] > 0
    lines = statements.read_text().splitlines()
    assert sum(json.loads(line)["rows"] for line in lines) == 6000
    # All partitions on one size at once, switching together (as a cleanup runs its batch size).
    together = await batch_sizes.run(accounts=8000, sizes=(50, 100, 500), parallel=2, together=1000)
    assert together["cleaned"] == 8000 and together["cycles_counted"] >= 1
    assert set(together["phase_accounts_per_s"]) == {"50", "100", "500"}
    # Each size's work per account where the server preloads pg_stat_statements (the tuned one).
    work = together["work_per_account"]
    assert work is None or (set(work) == {"50", "100", "500"} and all(w["wal_records"] > 0 for w in work.values()))
