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

import asyncio
import functools
import zoneinfo
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from temporalio.api.workflowservice.v1 import ListScheduleMatchingTimesRequest
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
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
)
from temporalio.client import (
    ScheduleDescription as ScheduleDescriptionRaw,
)
from temporalio.service import RPCError, RPCStatusCode

from core.errors import InputError
from core.temporal import WORKFLOW_TASK_TIMEOUT
from ledger.models import (
    SCHEDULE_ID,
    SCHEDULED_LEDGER_WORKFLOW,
    DeletedSchedule,
    NightAlreadyRun,
    ScheduleDescription,
    ScheduledLedgerInput,
    ScheduledRun,
    ScheduleListing,
    business_date_at,
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
        recent_runs=await _recent_runs(client, desc),
        waiting=desc.raw_description.info.buffer_size,
    )


async def _recent_runs(client: Client, desc: ScheduleDescriptionRaw) -> list[ScheduledRun]:
    """The schedule's recent actions with each run's status. The schedule's own record says RUNNING
    for a run it does not watch (untracked under ALLOW_ALL, or a second run under a reused ID,
    docs/ledger.md): such a run, absent from the schedule's running workflows, is asked directly."""
    info = desc.raw_description.info
    watched = {ex.run_id for ex in info.running_workflows}
    runs = [
        ScheduledRun(
            scheduled_at=a.scheduled_at.astimezone(UTC),
            workflow_id=getattr(a.action, "workflow_id", None),
            run_id=getattr(a.action, "first_execution_run_id", None),
            status=_run_status(raw.start_workflow_status),
        )
        for a, raw in zip(desc.info.recent_actions, info.recent_actions, strict=False)
    ]
    unwatched = [r for r in runs if r.status == "RUNNING" and r.workflow_id and r.run_id not in watched]
    found = await asyncio.gather(*(_describe_run(client, str(r.workflow_id), r.run_id) for r in unwatched))
    closed = {r.run_id: d.status.name for r, d in zip(unwatched, found, strict=True) if d and d.status}
    return [r.model_copy(update={"status": closed[r.run_id]}) if r.run_id in closed else r for r in runs]


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
    return ScheduleBackfill(start_at=start - timedelta(seconds=1), end_at=end, overlap=OVERLAP)


async def backfill_schedule(
    client: Client, first: date, last: date, schedule_id: str = SCHEDULE_ID
) -> ScheduleDescription:
    """Take the nightly actions for business dates first..last whose nights have no run yet, as if
    their nights were now (buffered, one after another). A night that already has a run is left
    alone and listed in `already_ran`: the server names a night's run after its scheduled time, so
    taking it again would reuse that workflow ID, and the server then badges the second run RUNNING
    for good in the schedule's recent runs and the UI (it updates the first entry of an ID only). To
    judge a date again, `reconcile --date D --recheck` runs under an ID of its own."""
    desc = await _call(client, schedule_id, "describe")
    _refuse_while_waiting(desc.raw_description.info.buffer_size)
    zone = desc.schedule.spec.time_zone_name or DEFAULT_TIME_ZONE
    action = desc.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow)
    (options,) = await client.data_converter.decode(list(action.args), [ScheduledLedgerInput])
    nights = await _matching_times(client, schedule_id, backfill_range(first, last, zone))
    limit = asyncio.Semaphore(16)
    runs = await asyncio.gather(*(_night_run(client, limit, f"{action.id}-{_id_time(t)}") for t in nights))
    already = [
        NightAlreadyRun(
            business_date=business_date_at(t, zone, options.days_before),
            scheduled_at=t,
            workflow_id=run.id,
            run_id=run.run_id,
            status=run.status.name if run.status else "UNKNOWN",
        )
        for t, run in zip(nights, runs, strict=True)
        if run is not None
    ]
    missing = [t for t, run in zip(nights, runs, strict=True) if run is None]
    if missing:
        # One backfill per night: exactly the nights without a run, whatever lies between them.
        await _call(
            client,
            schedule_id,
            "backfill",
            *(ScheduleBackfill(start_at=t - timedelta(seconds=1), end_at=t, overlap=OVERLAP) for t in missing),
        )
    taken = [business_date_at(t, zone, options.days_before) for t in missing]
    return (await describe_schedule(client, schedule_id)).model_copy(
        update={"backfilled_dates": taken, "already_ran": already}
    )


def _refuse_while_waiting(waiting: int) -> None:
    """Nights already taken but not started yet have no run to find: backfilling their range now
    could take them a second time, under the same workflow ID."""
    if waiting:
        raise InputError(
            f"{waiting} night(s) of an earlier backfill or trigger still wait to start (one runs at a "
            "time); backfill again once `schedule describe` shows waiting 0"
        )


async def _matching_times(client: Client, schedule_id: str, window: ScheduleBackfill) -> list[datetime]:
    """The scheduled times of the schedule's spec within the window, as the server computes them."""
    request = ListScheduleMatchingTimesRequest(namespace=client.namespace, schedule_id=schedule_id)
    request.start_time.FromDatetime(window.start_at)
    request.end_time.FromDatetime(window.end_at)
    response = await client.workflow_service.list_schedule_matching_times(request)
    return [t.ToDatetime(tzinfo=UTC) for t in response.start_time]


def _id_time(moment: datetime) -> str:
    """The scheduled time as the server appends it to the action's workflow ID (RFC 3339, UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _night_run(client: Client, limit: asyncio.Semaphore, workflow_id: str) -> WorkflowExecutionDescription | None:
    async with limit:
        return await _describe_run(client, workflow_id)


async def _describe_run(
    client: Client, workflow_id: str, run_id: str | None = None
) -> WorkflowExecutionDescription | None:
    """The run as Temporal describes it; None when there is none (never started, or past retention)."""
    try:
        return await client.get_workflow_handle(workflow_id, run_id=run_id).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


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
