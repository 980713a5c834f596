"""The harness scenarios, in the order of the evaluation; each is `async def run(ctx: Ctx) -> Row`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from harness.common import Ctx, Row

Scenario = Callable[[Ctx], Awaitable[Row]]


def registry() -> dict[str, Scenario]:
    from harness.scenarios import (
        consumers,
        db_faults,
        delay,
        kill,
        late_data,
        oversized,
        planner_kills,
        renewal_order,
        renewal_race,
        replay,
        schedule,
        server_restart,
        zombie,
    )

    return {
        "replay": replay.run,
        "kill": kill.run,
        "delay": delay.run,
        "oversized": oversized.run,
        "consumers": consumers.run,
        "renewal-race": renewal_race.run,
        "schedule": schedule.run,
        "db-faults": db_faults.run,
        "server-restart": server_restart.run,
        "renewal-order": renewal_order.run,
        "zombie": zombie.run,
        "late-data": late_data.run,
        "planner-kills": planner_kills.run,
    }


def opt_in() -> dict[str, Scenario]:
    """Scenarios run only when named (`--scenarios poison`): not part of the quick/full tables."""
    from harness.scenarios import db_restart, ledger_overlap, poison

    return {"poison": poison.run, "ledger-overlap": ledger_overlap.run, "db-restart": db_restart.run}


def all_scenarios() -> dict[str, Scenario]:
    """Every scenario the CLI accepts: the default set plus the opt-in ones."""
    return registry() | opt_in()
