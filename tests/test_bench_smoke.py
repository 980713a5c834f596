"""Tiny runs of every benchmark so they cannot rot. No speed is asserted: figures are in BENCHMARKS.md."""

from __future__ import annotations

from bench import cohort_cleanup, single_accounts


async def test_cohort_cleanup_benchmark_runs_and_measures_a_ratio():
    result = await cohort_cleanup.run(accounts=300, partitions=4, parallel=2, batch_size=50)
    assert result["pipeline_cleaned"] == 300 and result["direct_cleaned"] == [300, 300]
    assert result["ratio"] > 0
    assert result["worker_0_peak_rss_mib"] > 0 and result["temporal_server_peak_rss_mib"] > 0


async def test_single_account_benchmark_runs_and_measures_a_ratio():
    result = await single_accounts.run(workflows=20)
    assert result["accounts_cleaned"] == 20
    assert result["ratio"] > 0
