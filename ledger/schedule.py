"""The nightly Temporal Schedule of the ledger reconciliation (see docs/ledger.md for the policies).

The schedule fires at a configurable time of day in the game's IANA time zone (default 02:00 UTC)
and starts `ScheduledLedgerReconciliationWorkflow`, which reconciles the *previous* business date of
its scheduled time, computed in that zone, under the date-keyed workflow ID
`ledger-reconciliation-{date}`. The zone is in two places that `create` and `update` keep equal: the
schedule's spec (when the server fires: 02:00 Europe/Berlin is 01:00 UTC in winter, 00:00 in
summer) and the action's input (which date a firing reconciles). Across a daylight-saving change
the server fires once per local day, so a night of 23 or 25 hours still reconciles one date. A time
of day that a change skips (02:30 in Europe/Berlin on the spring-forward night) never fires on that
night -- the server skips it, and that business date would wait for a backfill -- so `create` and
`update` refuse such a time (`check_time_exists`).

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

import functools
import zoneinfo
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
from core.temporal import WORKFLOW_TASK_TIMEOUT
from ledger.models import (
    SCHEDULE_ID,
    SCHEDULED_LEDGER_WORKFLOW,
    DeletedSchedule,
    ScheduleDescription,
    ScheduledLedgerInput,
    ScheduledRun,
    ScheduleListing,
)

DEFAULT_AT = time(2, 0)
OVERLAP = ScheduleOverlapPolicy.BUFFER_ALL
CATCHUP_WINDOW = timedelta(days=1)
MAX_BACKFILL_DAYS = 366


DEFAULT_TIME_ZONE = "UTC"


def parse_time_of_day(text: str) -> time:
    try:
        value = time.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"not a time of day: {text!r} (expected HH:MM in the schedule's zone, e.g. 02:00)") from None
    if value.tzinfo is not None or value.second or value.microsecond:
        raise InputError(f"time of day {text!r}: give HH:MM, without seconds or an offset (--time-zone sets the zone)")
    return value


@functools.cache
def _zones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones()) | {DEFAULT_TIME_ZONE}


def parse_time_zone(text: str) -> str:
    """An IANA time zone name (`Europe/Berlin`, `America/Los_Angeles`, `UTC`), as the tz database spells it."""
    name = text.strip()
    if name not in _zones():
        hint = next((z for z in sorted(_zones()) if z.lower() == name.lower()), None)
        raise InputError(
            f"unknown time zone {text!r}: give an IANA name such as Europe/Berlin"
            + (f" (did you mean {hint}?)" if hint else "")
        )
    return name


def check_time_exists(at: time, time_zone: str, today: date | None = None) -> None:
    """Refuse a time of day that a daylight-saving change skips in `time_zone` within a year: the
    server does not fire on such a night, so its business date would never be reconciled."""
    zone = zoneinfo.ZoneInfo(time_zone)
    start = today or datetime.now(UTC).date()
    for offset in range(366):
        day = start + timedelta(days=offset)
        local = datetime.combine(day, at, tzinfo=zone)
        if local.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != local.replace(tzinfo=None):
            raise InputError(
                f"{at.strftime('%H:%M')} does not exist in {time_zone} on {day.isoformat()} (the clocks "
                "skip it): that night would not run; pick a time outside the daylight-saving change"
            )


def _calendar(at: time) -> ScheduleCalendarSpec:
    return ScheduleCalendarSpec(hour=[ScheduleRange(at.hour)], minute=[ScheduleRange(at.minute)])


def nightly_schedule(
    task_queue: str,
    *,
    at: time = DEFAULT_AT,
    options: ScheduledLedgerInput | None = None,
    paused: bool = False,
    schedule_id: str = SCHEDULE_ID,
    time_zone: str = DEFAULT_TIME_ZONE,
) -> Schedule:
    check_time_exists(at, time_zone)
    options = (options or ScheduledLedgerInput()).model_copy(update={"time_zone": time_zone})
    return Schedule(
        action=ScheduleActionStartWorkflow(
            SCHEDULED_LEDGER_WORKFLOW,
            options,
            # Temporal appends the scheduled time to this ID; the date-keyed child carries the business key.
            id=schedule_id,
            task_queue=task_queue,
            task_timeout=WORKFLOW_TASK_TIMEOUT,
            static_summary="nightly ledger reconciliation (previous business date)",
        ),
        spec=ScheduleSpec(calendars=[_calendar(at)], time_zone_name=time_zone),
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
    time_zone: str = DEFAULT_TIME_ZONE,
) -> ScheduleDescription:
    schedule = nightly_schedule(
        task_queue, at=at, options=options, paused=paused, schedule_id=schedule_id, time_zone=time_zone
    )
    try:
        await client.create_schedule(schedule_id, schedule)
    except ScheduleAlreadyRunningError:
        if not await _upgrade_policy(client, schedule_id):
            raise InputError(
                f"schedule {schedule_id!r} already exists; `schedule describe` shows it, `schedule delete` removes it"
            ) from None
        return (await describe_schedule(client, schedule_id)).model_copy(update={"policy_upgraded": True})
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


async def describe_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> ScheduleDescription:
    desc = await _call(client, schedule_id, "describe")
    sched = desc.schedule
    calendars = sched.spec.calendars
    at = (
        f"{calendars[0].hour[0].start:02d}:{calendars[0].minute[0].start:02d} {sched.spec.time_zone_name or 'UTC'}"
        if calendars
        else None
    )
    info = desc.info
    zone = sched.spec.time_zone_name or DEFAULT_TIME_ZONE
    return ScheduleDescription(
        schedule_id=schedule_id,
        runs_at=at,
        time_zone=zone,
        paused=sched.state.paused,
        note=sched.state.note,
        overlap=sched.policy.overlap.name,
        catchup_window=str(sched.policy.catchup_window),
        task_queue=getattr(sched.action, "task_queue", None),
        actions_taken=info.num_actions,
        missed_catchup_window=info.num_actions_missed_catchup_window,
        next_runs=[t.astimezone(UTC) for t in info.next_action_times[:3]],
        next_runs_local=[_local(t, zone) for t in info.next_action_times[:3]],
        recent_runs=[
            ScheduledRun(
                scheduled_at=a.scheduled_at.astimezone(UTC),
                workflow_id=getattr(a.action, "workflow_id", None),
                run_id=getattr(a.action, "first_execution_run_id", None),
                status=_run_status(raw.start_workflow_status),
            )
            for a, raw in zip(info.recent_actions, desc.raw_description.info.recent_actions, strict=False)
        ],
    )


def _local(moment: datetime, zone: str) -> datetime:
    return moment.astimezone(zoneinfo.ZoneInfo(zone))


def _run_status(value: int) -> str | None:
    return WorkflowExecutionStatus(value).name if value else None


async def pause_schedule(client: Client, note: str = "", schedule_id: str = SCHEDULE_ID) -> ScheduleDescription:
    await _call(client, schedule_id, "pause", note=note or "paused by an operator")
    return await describe_schedule(client, schedule_id)


async def unpause_schedule(client: Client, note: str = "", schedule_id: str = SCHEDULE_ID) -> ScheduleDescription:
    await _call(client, schedule_id, "unpause", note=note or "unpaused by an operator")
    return await describe_schedule(client, schedule_id)


async def trigger_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> ScheduleDescription:
    """Run the action now: it reconciles yesterday (in the schedule's zone), once, even if yesterday already ran."""
    await _call(client, schedule_id, "trigger", overlap=OVERLAP)
    return await describe_schedule(client, schedule_id)


def backfill_range(first: date, last: date, time_zone: str = DEFAULT_TIME_ZONE) -> ScheduleBackfill:
    """The nights that reconcile business dates first..last are the nights after them: the range
    covers the whole following local day of each date (23 or 25 hours across a daylight-saving
    change), whatever the schedule's time of day."""
    if last < first:
        raise InputError(f"--to {last.isoformat()} is before --from {first.isoformat()}")
    if (last - first).days + 1 > MAX_BACKFILL_DAYS:
        raise InputError(f"at most {MAX_BACKFILL_DAYS} business dates per backfill")
    zone = zoneinfo.ZoneInfo(time_zone)
    start = datetime.combine(first + timedelta(days=1), time(0), tzinfo=zone).astimezone(UTC)
    end = datetime.combine(last + timedelta(days=2), time(0), tzinfo=zone).astimezone(UTC) - timedelta(seconds=1)
    # Every backfilled night runs (buffered, one after another); a date with a run already is not redone.
    return ScheduleBackfill(start_at=start - timedelta(seconds=1), end_at=end, overlap=OVERLAP)


async def backfill_schedule(
    client: Client, first: date, last: date, schedule_id: str = SCHEDULE_ID
) -> ScheduleDescription:
    """Take the nightly actions for business dates first..last as if their nights were now; a date
    that already has a run (manual, scheduled or an earlier backfill) is not reconciled again."""
    desc = await _call(client, schedule_id, "describe")
    backfill = backfill_range(first, last, desc.schedule.spec.time_zone_name or DEFAULT_TIME_ZONE)
    await _call(client, schedule_id, "backfill", backfill)
    dates = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    return (await describe_schedule(client, schedule_id)).model_copy(update={"backfilled_dates": dates})


async def delete_schedule(client: Client, schedule_id: str = SCHEDULE_ID) -> DeletedSchedule:
    await _call(client, schedule_id, "delete")
    return DeletedSchedule(schedule_id=schedule_id, deleted=True)


async def update_schedule(
    client: Client,
    schedule_id: str = SCHEDULE_ID,
    *,
    at: time | None = None,
    time_zone: str | None = None,
    note: str | None = None,
) -> ScheduleDescription:
    """Change the time of day, the zone or the note of a schedule in place: its ID, its recent runs,
    its pause state and its other options stay. The zone changes in the spec and in the action's
    input together (module docstring)."""

    async def change(update_input: ScheduleUpdateInput) -> ScheduleUpdate:
        schedule = update_input.description.schedule
        action = schedule.action
        assert isinstance(action, ScheduleActionStartWorkflow)
        (options,) = await client.data_converter.decode(list(action.args), [ScheduledLedgerInput])
        calendar = schedule.spec.calendars[0]
        check_time_exists(
            at or time(calendar.hour[0].start, calendar.minute[0].start),
            time_zone or schedule.spec.time_zone_name or DEFAULT_TIME_ZONE,
        )
        if time_zone is not None:
            schedule.spec.time_zone_name = time_zone
            options = options.model_copy(update={"time_zone": time_zone})
        if at is not None:
            schedule.spec.calendars = [_calendar(at)]
        action.args = [options]
        if note is not None:
            schedule.state.note = note
        return ScheduleUpdate(schedule=schedule)

    try:
        await _handle(client, schedule_id).update(change)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise InputError(f"no schedule {schedule_id!r}; create it with `schedule create`") from None
        raise
    return await describe_schedule(client, schedule_id)


async def list_schedules(client: Client) -> list[ScheduleListing]:
    """Every ledger-reconciliation schedule of the namespace: when it runs, in which zone, paused or not."""
    out = []
    async for entry in await client.list_schedules():
        sched = entry.schedule
        if sched is None or getattr(sched.action, "workflow", None) != SCHEDULED_LEDGER_WORKFLOW:
            continue
        calendars = sched.spec.calendars
        zone = sched.spec.time_zone_name or DEFAULT_TIME_ZONE
        out.append(
            ScheduleListing(
                schedule_id=entry.id,
                runs_at=f"{calendars[0].hour[0].start:02d}:{calendars[0].minute[0].start:02d} {zone}"
                if calendars
                else None,
                time_zone=zone,
                paused=sched.state.paused,
                note=sched.state.note,
                next_runs=[t.astimezone(UTC) for t in entry.info.next_action_times[:1]] if entry.info else [],
            )
        )
    return sorted(out, key=lambda d: d.schedule_id)
