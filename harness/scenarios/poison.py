"""Scenario 10 (opt-in): poisoned accounts, a killed worker and terminated connections.

A cohort where a few accounts cannot be cleaned (a trigger that raises on delete from a target
table, a foreign key from an extra team table to a target table) is cleaned by two worker
processes while one of them is killed right after a batch COMMIT and every worker connection is
terminated once mid-run. Counted in the database: every healthy account cleaned exactly once, each
poisoned account in cleanup_failed with no partial effect (and nothing transient sent to review),
the cohort settled with failed = k; after the causes are removed, retry-failed cleans them once.

Run with `./dev harness --scenarios poison` (not part of the default profiles).
"""

from __future__ import annotations

import asyncio

import asyncpg

from cleanup.inputs import StartCleanup
from cleanup.operations import cleanup_status, start_cleanup
from cleanup.review import list_failed, retry_failed
from cleanup.targets import load_targets
from core import db
from harness.checks import cleanup_effects
from harness.common import MATCHES, Ctx, Row, account_ids, seed_cohort, wait_for
from harness.scenarios.db_faults import TERMINATE
from harness.stack import HARNESS_APP
from harness.visibility import temporal_evidence
from workflows.renewal_cleanup import RenewalCleanupWorkflow

POISON_SCHEMA = """
CREATE TABLE IF NOT EXISTS legal_holds (account_id text PRIMARY KEY);
CREATE OR REPLACE FUNCTION refuse_held_inventory() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM legal_holds WHERE account_id = OLD.account_id) THEN
        RAISE EXCEPTION 'inventory of % is under legal hold', OLD.account_id;
    END IF;
    RETURN OLD;
END $$;
DROP TRIGGER IF EXISTS refuse_held_inventory ON demo_game.inventory_items;
CREATE TRIGGER refuse_held_inventory BEFORE DELETE ON demo_game.inventory_items
    FOR EACH ROW EXECUTE FUNCTION refuse_held_inventory();
CREATE TABLE IF NOT EXISTS team_loadouts (
    account_id text NOT NULL,
    slot smallint NOT NULL,
    FOREIGN KEY (account_id, slot) REFERENCES demo_game.cloud_saves (account_id, slot)
);
"""

UNTOUCHED = """
SELECT count(*)::int FROM unnest($1::text[]) AS p(account_id)
WHERE (SELECT count(*) FROM demo_game.cloud_saves s WHERE s.account_id = p.account_id) <> 1
   OR (SELECT count(*) FROM demo_game.inventory_items i WHERE i.account_id = p.account_id) <> 2
   OR (SELECT count(*) FROM demo_game.match_history m WHERE m.account_id = p.account_id) <> $2
   OR EXISTS (SELECT 1 FROM demo_game.match_history_archive h WHERE h.account_id = p.account_id)
   OR EXISTS (SELECT 1 FROM outbox o WHERE o.account_id = p.account_id)
   OR EXISTS (SELECT 1 FROM cleanup_applied c WHERE c.account_id = p.account_id)
"""


async def run(ctx: Ctx) -> Row:
    row = Row("14 poisoned accounts")
    lane = await ctx.h.lane("poison", 2)
    rng = ctx.rng("poison")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    await pool.execute(POISON_SCHEMA)
    try:
        for _ in range(ctx.profile.rounds):
            n = rng.randint(300, 600) * ctx.profile.scale
            prefix, deadline = ctx.ids.prefix("pz"), ctx.ids.past_deadline()
            await seed_cohort(pool, prefix, deadline, n)
            accounts = await account_ids(pool, prefix)
            poisoned = sorted(rng.sample(accounts, rng.randint(3, 6)))
            held, referenced = poisoned[:-1], poisoned[-1:]
            await pool.execute("INSERT INTO legal_holds SELECT unnest($1::text[])", held)
            await pool.execute(
                "INSERT INTO team_loadouts SELECT account_id, slot FROM demo_game.cloud_saves"
                " WHERE account_id = ANY($1)",
                referenced,
            )
            # The only worker dies right after its 2nd batch COMMIT (the supervisor restarts it), then
            # the second worker joins.
            supervisor, first, second = ctx.h.supervisor, lane.slots[0], lane.slots[1]
            await supervisor.stop(second)
            await supervisor.start(first, "cleanup_partition.after_commit=exit@2")
            deaths_before = len(first.deaths)
            cleanup = await start_cleanup(
                client,
                pool,
                tq,
                StartCleanup(deadline=deadline, partitions=4, batch_size=20, heartbeat_timeout_seconds=5),
            )
            wf = cleanup.workflow_id
            death = await supervisor.wait_death(first, deaths_before, 120)
            if death is None:
                row.violations.append("the worker armed to die after a batch COMMIT did not die")
            await supervisor.start(second)

            async def busy(cleanup_id: str = wf) -> bool:
                return bool(
                    await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE cleanup_id = $1", cleanup_id)
                )

            await wait_for(busy, 60, 0.05)
            admin = await asyncpg.connect(
                lane.database_url, server_settings={"application_name": HARNESS_APP, **db.service_settings()}
            )
            try:
                terminated = int(await admin.fetchval(TERMINATE, HARNESS_APP))
            finally:
                await admin.close()
            t_fault = asyncio.get_running_loop().time()
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, wf)
            result = await asyncio.wait_for(handle.result(), 240)
            row.recovered(asyncio.get_running_loop().time() - t_fault)
            row.notes.append(
                f"{wf}: worker killed after a batch COMMIT (exit {death and death.returncode}); "
                f"terminated {terminated} worker connections"
            )

            effects = await cleanup_effects(
                pool, prefix, matches_per_account=MATCHES, expect_cleaned=n - len(poisoned), cleanup_ids=[wf]
            )
            # The poisoned accounts are 'cleanup_failed', not lost: the generic check counts them as
            # not terminal, so they are checked here instead.
            effects.details["lost_not_terminal"] -= await pool.fetchval(
                "SELECT count(*) FROM accounts WHERE account_id = ANY($1) AND status = 'cleanup_failed'", poisoned
            )
            failed = {r.account_id: r for r in await list_failed(pool, wf)}
            effects.details["lost_poisoned_not_in_review"] = len(set(poisoned) - set(failed))
            effects.details["dup_healthy_sent_to_review"] = len(set(failed) - set(poisoned))
            effects.details["dup_partial_effect_on_failed"] = await pool.fetchval(UNTOUCHED, poisoned, MATCHES)
            settlement = result.settlement
            if settlement is None or settlement.failed != len(poisoned):
                row.violations.append(f"settlement failed={settlement and settlement.failed}, expected {len(poisoned)}")
            for account in held:
                if account in failed and failed[account].sqlstate != "P0001":
                    row.violations.append(f"{account}: sqlstate {failed[account].sqlstate}, expected P0001")

            # After the fix: retry-failed cleans each poisoned account once.
            await pool.execute("DELETE FROM legal_holds; DELETE FROM team_loadouts")
            retried = await retry_failed(pool, load_targets(), wf)
            if retried.cleaned != len(poisoned) or retried.still_failed:
                row.violations.append(f"retry-failed after the fix: {retried}")
            after = await cleanup_effects(pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf])
            for name, value in after.details.items():
                if isinstance(value, int) and name.startswith(("dup_", "lost_")):
                    effects.details[f"{name}_after_retry"] = value
            dup = sum(v for k, v in effects.details.items() if k.startswith("dup_") and isinstance(v, int))
            lost = sum(v for k, v in effects.details.items() if k.startswith("lost_") and isinstance(v, int))
            row.runs += 1
            row.duplicates += dup
            row.lost += lost
            row.violations += effects.problems()

            status = await cleanup_status(client, pool, wf)
            evidence = await temporal_evidence(client, wf)
            settled = status.settlement
            visible = bool(status.settled and settled and settled.failed == len(poisoned) and evidence)
            row.operator_visibility = visible if row.runs == 1 else row.operator_visibility and visible
            row.evidence.append(
                f"{wf}: settled claimed={settled and settled.claimed} cleaned={settled and settled.cleaned} "
                f"failed={settled and settled.failed}; in review: "
                + "; ".join(f"{a} [{r.sqlstate}] {r.target}" for a, r in sorted(failed.items()))
                + f"; retry-failed cleaned {retried.cleaned}"
            )
            row.evidence += evidence[:3]
    finally:
        await ctx.h.close_lane(lane)
    return row
