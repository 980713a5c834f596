"""The nightly Temporal Schedule of the ledger reconciliation (see docs/ledger.md for the policies).

The schedule fires at a configurable time of day (default 02:00 UTC) and starts
`ScheduledLedgerReconciliationWorkflow`, which reconciles the *previous* business date of its
scheduled time under the date-keyed workflow ID `ledger-reconciliation-{date}`.

Policies:
- overlap BUFFER_ALL: no night is skipped or dropped (a night that comes while a slow one still
  runs waits for it), and the server tracks each run, so its status in the schedule (and in the
  UI's recent runs) turns COMPLETED when it closes; under ALLOW_ALL the server does not track runs
  and they stay RUNNING there forever (docs/ledger.md). Two actions for the *same* date (a trigger,
  a backfill, a manual run) collide on the date-keyed workflow ID and only one of them reconciles.
- catch-up window 1 day: a night missed while the Temporal service was unavailable still runs
  when it returns within a day; older gaps are closed deliberately with `schedule backfill`.
- pause_on_failure off: one bad date (e.g. its report never arrived) must not stop later nights.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleBackfill,
    ScheduleCalendarSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleRange,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WorkflowExecutionStatus,
)
from temporalio.service import RPCError, RPCStatusCode

from core.errors import InputError
from ledger.models import SCHEDULE_ID, SCHEDULED_LEDGER_WORKFLOW, ScheduledLedgerInput

DEFAULT_AT = time(2, 0)
OVERLAP = ScheduleOverlapPolicy.BUFFER_ALL
CATCHUP_WINDOW = timedelta(days=1)
MAX_BACKFILL_DAYS = 366


def parse_time_of_day(text: str) -> time:
    try:
        value = time.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"not a time of day: {text!r} (expected HH:MM in UTC, e.g. 02:00)") from None
    if value.tzinfo is not None or value.second or value.microsecond:
        raise InputError(f"time of day {text!r}: give HH:MM in UTC, without seconds or an offset")
    return value


def nightly_schedule(
    task_queue: str,
    *,
    at: time = DEFAULT_AT,
    options: ScheduledLedgerInput | None = None,
    paused: bool = False,
    schedule_id: str = SCHEDULE_ID,
) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            SCHEDULED_LEDGER_WORKFLOW,
            options or ScheduledLedgerInput(),
            # Temporal appends the scheduled time to this ID; the date-keyed child carries the business key.
            id=schedule_id,
            task_queue=task_queue,
            static_summary="nightly ledger reconciliation (previous business date)",
        ),
        spec=ScheduleSpec(
            calendars=[ScheduleCalendarSpec(hour=[ScheduleRange(at.hour)], minute=[ScheduleRange(at.minute)])],
            time_zone_name="UTC",
        ),
        policy=SchedulePolicy(overlap=OVERLAP, catchup_window=CATCHUP_WINDOW, pause_on_failure=False),
        state=ScheduleState(paused=paused, note="created paused" if paused else "nightly ledger reconciliation"),
    )


async def create_schedule(
    client: Client,
    task_queue: str,
    *,
    at: time = DEFAULT_AT,
    options: ScheduledLedgerInput | None = None,
    paused: bool = False,
    schedule_id: str = SCHEDULE_ID,
) -> dict[str, Any]:
    try:
        await client.create_schedule(
            schedule_id, nightly_schedule(task_queue, at=at, options=options, paused=paused, schedule_id=schedule_id)
        )
    except ScheduleAlreadyRunningError:
        if not await _upgrade_policy(client, schedule_id):
            raise InputError(
                f"schedule {schedule_id!r} already exists; `schedule describe` shows it, `schedule delete` removes it"
            ) from None
        out = await describe_schedule(client, schedule_id)
        out["policy_upgraded"] = True
        return out
    return await describe_schedule(client, schedule_id)


async def _upgrade_policy(client: Client, schedule_id: str) -> bool:
    """A schedule created under an older policy (ALLOW_ALL) gets today's overlap policy in place, so
    its history, pause state and spec survive; True when something changed."""
    changed = False

    def upgrade(update_input: ScheduleUpdateInput) -> ScheduleUpdate | None:
        nonlocal changed
        schedule = update_input.description.schedule
        if schedule.policy.overlap == OVERLAP:
            return None
        schedule.policy.overlap = OVERLAP
        changed = True
        return ScheduleUpdate(schedule=schedule)

    await _handle(client, schedule_id).update(upgrade)
    return changed


def _handle(client: Client, schedule_id: str) -> Any:
    return client.get_schedule_handle(schedule_id)


async def _call(client: Client, schedule_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return await getattr(_handle(client, schedule_id), method)(*args, **kwargs)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise InputError(f"no schedule {schedule_id!r}; create it with `schedule create`") from None
        raise


async def describe_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    desc = await _call(client, schedule_id, "describe")
    sched = desc.schedule
    calendars = sched.spec.calendars
    at = (
        f"{calendars[0].hour[0].start:02d}:{calendars[0].minute[0].start:02d} {sched.spec.time_zone_name or 'UTC'}"
        if calendars
        else None
    )
    info = desc.info
    return {
        "schedule_id": schedule_id,
        "runs_at": at,
        "paused": sched.state.paused,
        "note": sched.state.note,
        "overlap": sched.policy.overlap.name,
        "catchup_window": str(sched.policy.catchup_window),
        "task_queue": getattr(sched.action, "task_queue", None),
        "actions_taken": info.num_actions,
        "missed_catchup_window": info.num_actions_missed_catchup_window,
        "next_runs": [t.astimezone(UTC).isoformat() for t in info.next_action_times[:3]],
        "recent_runs": [
            {
                "scheduled_at": a.scheduled_at.astimezone(UTC).isoformat(),
                "workflow_id": getattr(a.action, "workflow_id", None),
                "run_id": getattr(a.action, "first_execution_run_id", None),
                # What the Temporal UI badges the run with: the server updates it when the run
                # closes only for actions it tracks (not under ALLOW_ALL; see docs/ledger.md).
                "status": _run_status(raw.start_workflow_status),
            }
            for a, raw in zip(info.recent_actions, desc.raw_description.info.recent_actions, strict=False)
        ],
    }


def _run_status(value: int) -> str | None:
    return WorkflowExecutionStatus(value).name if value else None


async def pause_schedule(client: Client, note: str = "", schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    await _call(client, schedule_id, "pause", note=note or "paused by an operator")
    return await describe_schedule(client, schedule_id)


async def unpause_schedule(client: Client, note: str = "", schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    await _call(client, schedule_id, "unpause", note=note or "unpaused by an operator")
    return await describe_schedule(client, schedule_id)


async def trigger_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    """Run the action now: it reconciles yesterday (UTC), once, even if yesterday already ran."""
    await _call(client, schedule_id, "trigger", overlap=OVERLAP)
    return await describe_schedule(client, schedule_id)


def backfill_range(first: date, last: date) -> ScheduleBackfill:
    """The nights that reconcile business dates first..last are the nights after them: the range
    covers the whole following day of each date, whatever the schedule's time of day."""
    if last < first:
        raise InputError(f"--to {last.isoformat()} is before --from {first.isoformat()}")
    if (last - first).days + 1 > MAX_BACKFILL_DAYS:
        raise InputError(f"at most {MAX_BACKFILL_DAYS} business dates per backfill")
    start = datetime.combine(first + timedelta(days=1), time(0), tzinfo=UTC)
    end = datetime.combine(last + timedelta(days=2), time(0), tzinfo=UTC) - timedelta(seconds=1)
    # Every backfilled night runs (buffered, one after another); a date with a run already is not redone.
    return ScheduleBackfill(start_at=start - timedelta(seconds=1), end_at=end, overlap=OVERLAP)


async def backfill_schedule(client: Client, first: date, last: date, schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    """Take the nightly actions for business dates first..last as if their nights were now; a date
    that already has a run (manual, scheduled or an earlier backfill) is not reconciled again."""
    backfill = backfill_range(first, last)
    await _call(client, schedule_id, "backfill", backfill)
    out = await describe_schedule(client, schedule_id)
    out["backfilled_dates"] = [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]
    return out


async def delete_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> dict[str, Any]:
    await _call(client, schedule_id, "delete")
    return {"schedule_id": schedule_id, "deleted": True}
