"""The planner commands of starter.py: `planner status|pause|resume|start`.

Registered by one line in starter.build_parser. The planner itself is ensured by every worker at
start-up (worker.py); these commands only look at it and steer it. Operations: cleanup/planner.py.
"""

from __future__ import annotations

import argparse
from typing import Any

from core.cli_common import CliContext, emit, key_values
from core.config import Settings


def _human_status(d: dict[str, Any]) -> str:
    lateness = d["lateness_seconds"]

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    lines = {
        "planner": f"{d['workflow_id']} ({d['temporal_status'] or 'not started'}, phase {d['phase']})",
        "paused": f"{d['paused']}" + (f" ({d['pause_reason']})" if d.get("pause_reason") else ""),
        "next deadlines": ", ".join(f"{r['deadline'].isoformat()} x{r['accounts']}" for r in d["next_deadlines"])
        or "(none)",
        "due in the next hour": d["due_next_hour"],
        "overdue now": d["overdue"],
        "overdue swept": f"{d['overdue_swept']} account(s) in {d['overdue_sweeps']} sweep(s)",
        "stranded claims recovered": f"{d['stranded_claims_recovered']} in {d['stranded_recoveries']} recovery(ies)",
        "lateness (last hour)": f"{lateness['cleanups']} cleanups, p50 {secs(lateness['p50'])}, "
        f"p99 {secs(lateness['p99'])}, max {secs(lateness['max'])}",
    }
    return key_values(lines)


async def cmd_planner(args: argparse.Namespace, settings: Settings) -> None:
    from cleanup.planner import ensure_planner, planner_status, planner_workflow_id, signal_planner

    async with CliContext(settings) as ctx:
        queue = ctx.settings.task_queue
        if args.action == "status":
            data = await planner_status(ctx.client, ctx.pool, queue)
            data["ui"] = ctx.settings.workflow_url(data["workflow_id"])
            emit(args, data, _human_status)
            return
        if args.action == "start":
            workflow_id, started = await ensure_planner(ctx.client, queue)
            data = {"workflow_id": workflow_id, "started": started}
        else:
            await signal_planner(ctx.client, queue, args.action, args.reason)
            data = {"workflow_id": planner_workflow_id(queue), "signalled": args.action}
        data["ui"] = ctx.settings.workflow_url(data["workflow_id"])
    emit(args, data)


def register_planner_commands(sub: Any) -> None:
    """Add `planner ...` to starter.py's sub-parsers."""
    help = "the deadline planner: status (next deadlines, overdue, recovered, lateness), pause, resume, start"
    p = sub.add_parser("planner", help=help, description=help)
    p.add_argument("action", choices=["status", "pause", "resume", "start"])
    p.add_argument("--reason", default="", help="pause: why (shown by status and in the Temporal UI)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=cmd_planner)
