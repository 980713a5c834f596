"""Cohort cleanup with poisoned accounts vs. a clean cohort: `python -m bench.poisoned_cohort`.

One bad account must not block a cohort, and isolating it must not cost the cohort much.
Two cohorts of the same size are seeded into one fresh database, and a trigger on inventory_items
raises for the accounts on a legal-hold list (installed for both runs, so both pay its per-row
lookup). The *clean* cohort has no account on the list; the *poisoned* one has `poisoned` accounts
spread evenly over it, so that many batches fail and are bisected. Both are cleaned directly with
the activity's code (`clean_partition_batches`: same SQL, same batch size, same partition
parallelism, no Temporal). The ratio is accounts/s of the poisoned run over that of the clean run.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from activities.cleanup import CleanupActivities
from bench.cohort_cleanup import direct_cleanup
from bench.common import machine, run_benchmark, stack
from cleanup.targets import load_targets
from demo.fixture import seed_accounts

HOLD_TRIGGER = """
CREATE TABLE legal_holds (account_id text PRIMARY KEY);
CREATE FUNCTION refuse_held_inventory() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM legal_holds WHERE account_id = OLD.account_id) THEN
        RAISE EXCEPTION 'inventory of % is under legal hold', OLD.account_id;
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER refuse_held_inventory BEFORE DELETE ON demo_game.inventory_items
    FOR EACH ROW EXECUTE FUNCTION refuse_held_inventory();
"""


async def run(
    accounts: int, poisoned: int, partitions: int = 16, parallel: int = 8, batch_size: int = 1000
) -> dict[str, Any]:
    if not 0 < poisoned < accounts:
        raise ValueError("poisoned must be between 1 and accounts - 1")
    async with stack() as s:
        # Deadlines already passed by the database clock: the claim never takes an account before it.
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        clean_deadline, poisoned_deadline = base, base + timedelta(hours=1)
        await seed_accounts(s.pool, prefix="c", deadline=clean_deadline, count=accounts)
        await seed_accounts(s.pool, prefix="x", deadline=poisoned_deadline, count=accounts)
        await s.pool.execute(HOLD_TRIGGER)
        step = accounts // poisoned
        await s.pool.execute(
            "INSERT INTO legal_holds SELECT account_id FROM ("
            " SELECT account_id, row_number() OVER (ORDER BY account_id) AS n"
            " FROM accounts WHERE renewal_deadline = $1) a WHERE n % $2 = 0 LIMIT $3",
            poisoned_deadline,
            step,
            poisoned,
        )
        await s.pool.execute("VACUUM ANALYZE")
        acts = await CleanupActivities.create(s.pool, load_targets())
        clean = await direct_cleanup(acts, s.claim_backends, clean_deadline, partitions, parallel, batch_size)
        bad = await direct_cleanup(acts, s.claim_backends, poisoned_deadline, partitions, parallel, batch_size)
        failed = await s.pool.fetchval("SELECT count(*) FROM cleanup_failed")
        held = await s.pool.fetchval("SELECT count(*) FROM legal_holds")
    clean_rate = clean["cleaned"] / clean["seconds"]
    bad_rate = (bad["cleaned"] + failed) / bad["seconds"]
    return {
        "scenario": "poisoned_cohort",
        "accounts": accounts,
        "poisoned": held,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "clean_seconds": round(clean["seconds"], 3),
        "poisoned_seconds": round(bad["seconds"], 3),
        "clean_accounts_per_s": round(clean_rate, 1),
        "poisoned_accounts_per_s": round(bad_rate, 1),
        "ratio": round(bad_rate / clean_rate, 3),
        "target": ">= 0.5",
        "clean_cleaned": clean["cleaned"],
        "poisoned_cleaned": bad["cleaned"],
        "poisoned_failed": failed,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=100_000)
    parser.add_argument("--poisoned", type=int, default=100, help="accounts poisoned (default 100, 0.1%%)")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    result = run_benchmark(run(args.accounts, args.poisoned, args.partitions, args.parallel, args.batch_size))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
