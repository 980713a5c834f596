"""Scenario 4: a request above the 256 KiB envelope is rejected before anything starts."""

from __future__ import annotations

from cleanup.inputs import StartCleanup
from cleanup.models import cohort_cleanup_id
from cleanup.operations import cleanup_status, start_cleanup
from core.envelope import MAX_PAYLOAD_BYTES, PayloadTooLargeError
from core.errors import InputError
from harness.common import Ctx, Row, seed_cohort


async def run(ctx: Ctx) -> Row:
    row = Row("4 oversized body")
    lane = await ctx.h.lane("oversized", 0)
    pool = lane.pool
    try:
        for size in (MAX_PAYLOAD_BYTES + 1024, 2 * MAX_PAYLOAD_BYTES):
            prefix, deadline = ctx.ids.prefix("ov"), ctx.ids.past_deadline()
            await seed_cohort(pool, prefix, deadline, 5)
            wf = cohort_cleanup_id(deadline)
            message = ""
            try:
                await start_cleanup(ctx.client, pool, lane.task_queue, StartCleanup(deadline=deadline, note="x" * size))
                row.violations.append(f"a {size // 1024} KiB request was accepted")
            except PayloadTooLargeError as err:
                message = str(err)
            row.runs += 1
            try:
                await cleanup_status(ctx.client, pool, wf)
                row.violations.append(f"{wf} exists after a rejected request")
                status_says = ""
            except InputError as err:
                status_says = str(err)
            touched = await pool.fetchval(
                "SELECT count(*) FROM accounts WHERE account_id LIKE $1 AND status <> 'active'", f"acct_{prefix}_%"
            )
            claims = await pool.fetchval("SELECT count(*) FROM cleanup_claims")
            row.lost += 0
            row.duplicates += int(touched) + int(claims)
            visible = "over the 256 KiB envelope; nothing was started" in message and "no cleanup" in status_says
            row.operator_visibility = visible if row.runs == 1 else row.operator_visibility and visible
            row.evidence.append(f"CLI error (exit 2): {message!r}; status: {status_says!r}")
    finally:
        await ctx.h.close_lane(lane)
    return row
