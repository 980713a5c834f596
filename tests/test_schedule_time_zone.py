"""The nightly ledger schedule in the game's time zone: business dates across daylight-saving changes,
`schedule list` and `schedule update` in place, and bad zones refused with exit code 2."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from datetime import UTC, date, datetime, time
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from core.config import PROJECT_ROOT, Settings
from core.errors import InputError
from ledger import schedule as ls
from ledger.models import ScheduledLedgerInput, ScheduledLedgerResult, business_date_at
from tests.helpers import wait_until
from tests.ledger_helpers import id_prefix, seed_day

BERLIN = "Europe/Berlin"
# Europe/Berlin in 2026: clocks go forward on 29 March at 02:00 (a night of 23 hours) and back on
# 25 October at 03:00 (25 hours). Business date D is reconciled by the night that follows it.
SPRING = [date(2026, 3, 27), date(2026, 3, 28), date(2026, 3, 29)]
AUTUMN = [date(2026, 10, 24), date(2026, 10, 25), date(2026, 10, 26)]


def test_business_date_is_the_local_date_of_the_scheduled_time() -> None:
    # 00:30 in Berlin is the evening before in UTC: a UTC date would be a day early.
    winter = datetime(2026, 3, 28, 23, 30, tzinfo=UTC)  # 2026-03-29 00:30 CET
    summer = datetime(2026, 3, 29, 22, 30, tzinfo=UTC)  # 2026-03-30 00:30 CEST
    assert business_date_at(winter, BERLIN, 1) == date(2026, 3, 28)
    assert business_date_at(summer, BERLIN, 1) == date(2026, 3, 29)
    assert business_date_at(winter, "UTC", 1) == date(2026, 3, 27), "UTC stays the default's answer"
    # Both 02:30s of the 25-hour night are the same local date.
    first, second = datetime(2026, 10, 25, 0, 30, tzinfo=UTC), datetime(2026, 10, 25, 1, 30, tzinfo=UTC)
    assert business_date_at(first, BERLIN, 1) == business_date_at(second, BERLIN, 1) == date(2026, 10, 24)


def test_time_zones_are_validated() -> None:
    assert ls.parse_time_zone(" Europe/Berlin ") == BERLIN
    assert ls.parse_time_zone("UTC") == "UTC"
    for bad in ("Mars/Olympus", "", "../etc/passwd", "CET+1"):
        with pytest.raises(InputError, match="unknown time zone"):
            ls.parse_time_zone(bad)
    with pytest.raises(InputError, match="did you mean Europe/Berlin"):
        ls.parse_time_zone("europe/berlin")


def test_backfill_range_covers_whole_local_days() -> None:
    spring = ls.backfill_range(SPRING[1], SPRING[1], BERLIN)  # the night of 29 March: 23 hours
    assert round((spring.end_at - spring.start_at).total_seconds()) == 23 * 3600
    autumn = ls.backfill_range(AUTUMN[0], AUTUMN[0], BERLIN)  # the night of 25 October: 25 hours
    assert round((autumn.end_at - autumn.start_at).total_seconds()) == 25 * 3600


async def _scheduled_results(client: Client, schedule_id: str, count: int) -> list[ScheduledLedgerResult]:
    async def taken() -> bool:
        return len((await ls.describe_schedule(client, schedule_id)).recent_runs) >= count

    await wait_until(taken, within=120)
    await asyncio.sleep(1)  # a second firing of the same night would show up by now
    runs = (await ls.describe_schedule(client, schedule_id)).recent_runs
    results = []
    for run in runs:
        handle = client.get_workflow_handle(str(run.workflow_id), run_id=run.run_id, result_type=ScheduledLedgerResult)
        results.append(await asyncio.wait_for(handle.result(), timeout=120))
    return results


def test_a_time_the_clocks_skip_is_refused() -> None:
    """The server does not fire at 02:30 Berlin on the spring-forward night (measured: that night's
    run never came), so its business date would be lost: such a time is refused up front."""
    for at in ("02:00", "02:30", "02:59"):
        with pytest.raises(InputError, match=r"does not exist in Europe/Berlin on 2027-03-28"):
            ls.check_time_exists(ls.parse_time_of_day(at), BERLIN, today=date(2026, 12, 4))
    for at, zone in (("03:00", BERLIN), ("01:59", BERLIN), ("02:30", "UTC"), ("02:30", "Asia/Tokyo")):
        ls.check_time_exists(ls.parse_time_of_day(at), zone, today=date(2026, 12, 4))


async def test_each_night_across_daylight_saving_changes_reconciles_its_local_date_once(
    client: Client, pool: asyncpg.Pool, task_queue: str, worker: Worker
) -> None:
    """00:30 Berlin is the previous UTC day, 23:30 or 22:30: the date must come from the zone. The
    nights of 23 and 25 hours each reconcile one date, the right one."""
    at = "00:30"
    dates = SPRING + AUTUMN
    for d in dates:
        await seed_day(pool, d, payments=40, shards=1)
    schedule_id = f"ledger-tz-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=1, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(
        client,
        task_queue,
        at=ls.parse_time_of_day(at),
        options=options,
        paused=True,
        schedule_id=schedule_id,
        time_zone=BERLIN,
    )
    try:
        await ls.backfill_schedule(client, SPRING[0], SPRING[-1], schedule_id)
        spring = await _scheduled_results(client, schedule_id, len(SPRING))
        await ls.backfill_schedule(client, AUTUMN[0], AUTUMN[-1], schedule_id)
        both = await _scheduled_results(client, schedule_id, len(SPRING) + len(AUTUMN))
        runs = (await ls.describe_schedule(client, schedule_id)).recent_runs
    finally:
        await ls.delete_schedule(client, schedule_id)

    assert sorted(r.business_date for r in spring) == SPRING
    reconciled = Counter(r.business_date for r in both if r.outcome == "reconciled")
    assert reconciled == Counter(dates), "each local date reconciled once, none skipped"
    local_times = {r.scheduled_at.astimezone(ZoneInfo(BERLIN)).time() for r in runs}
    assert local_times == {ls.parse_time_of_day(at)}, local_times
    utc_hours = {r.scheduled_at.hour for r in runs}
    assert utc_hours == {22, 23}, "fired at 00:30 local time in winter and in summer"
    settled = [r["business_date"] for r in await pool.fetch("SELECT business_date FROM ledger_settlements ORDER BY 1")]
    assert settled == dates


async def test_update_changes_time_zone_and_note_in_place_and_list_shows_it(client: Client, task_queue: str) -> None:
    schedule_id = f"ledger-tz-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=3, id_prefix=id_prefix(task_queue))
    created = await ls.create_schedule(client, task_queue, options=options, paused=True, schedule_id=schedule_id)
    try:
        assert created.runs_at == "02:00 UTC" and created.time_zone == "UTC"
        updated = await ls.update_schedule(
            client, schedule_id, at=time(1, 15), time_zone="America/Los_Angeles", note="moved to the game's zone"
        )
        assert updated.runs_at == "01:15 America/Los_Angeles"
        assert updated.paused is True and updated.note == "moved to the game's zone"
        local = [t.isoformat() for t in updated.next_runs_local]
        assert all(t.endswith(("-08:00", "-07:00")) and "T01:15:00" in t for t in local)
        # The action's input follows the zone (which date a firing reconciles); its other options stay.
        desc = await client.get_schedule_handle(schedule_id).describe()
        (action_input,) = await client.data_converter.decode(list(desc.schedule.action.args), [ScheduledLedgerInput])  # type: ignore[attr-defined]
        assert action_input.time_zone == "America/Los_Angeles" and action_input.shards == 3

        async def listed() -> bool:
            return any(s.schedule_id == schedule_id for s in await ls.list_schedules(client))

        await wait_until(listed, within=60)  # the schedule list is eventually consistent
        (entry,) = [s for s in await ls.list_schedules(client) if s.schedule_id == schedule_id]
        assert entry.time_zone == "America/Los_Angeles" and entry.paused is True
    finally:
        await ls.delete_schedule(client, schedule_id)
    with pytest.raises(InputError, match="no schedule"):
        await ls.update_schedule(client, schedule_id, note="gone")


def test_cli_refuses_a_bad_zone_and_an_empty_update(settings: Settings) -> None:
    env = dict(os.environ, TEMPORAL_ADDRESS=str(settings.temporal_address), DATABASE_URL=str(settings.database_url))
    for argv, message in (
        (["schedule", "create", "--time-zone", "Europe/Berlinn"], "unknown time zone"),
        (["schedule", "update"], "schedule update needs"),
        (["schedule", "update", "--at", "25:00"], "not a time of day"),
        (["schedule", "create", "--at", "02:30", "--time-zone", BERLIN], "does not exist in Europe/Berlin"),
    ):
        done = subprocess.run(
            [sys.executable, str(PROJECT_ROOT / "starter.py"), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


async def test_cli_create_update_and_list_a_schedule_in_a_time_zone(
    temporal_address: str, db_url: str, task_queue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from starter import main

    base = ["--temporal-address", temporal_address, "--database-url", db_url, "--task-queue", task_queue]
    sid = ["--schedule-id", f"ledger-tz-{uuid.uuid4().hex[:8]}"]

    async def cli(*argv: str) -> Any:
        capsys.readouterr()
        assert await asyncio.to_thread(main, [*base, *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    created = await cli("schedule", "create", *sid, "--at", "01:30", "--time-zone", BERLIN, "--paused")
    try:
        assert (created["runs_at"], created["time_zone"]) == ("01:30 Europe/Berlin", BERLIN)
        assert all("T01:30:00+01:00" in t or "T01:30:00+02:00" in t for t in created["next_runs_local"])
        updated = await cli("schedule", "update", *sid, "--time-zone", "Asia/Tokyo", "--reason", "moved")
        assert (updated["runs_at"], updated["note"], updated["paused"]) == ("01:30 Asia/Tokyo", "moved", True)
        assert all(t.endswith("T16:30:00+00:00") for t in updated["next_runs"]), "01:30 in Tokyo is 16:30 UTC"

        async def listed() -> bool:
            return any(s["schedule_id"] == sid[1] for s in await cli("schedule", "list"))

        await wait_until(listed, within=60)
    finally:
        assert (await cli("schedule", "delete", *sid))["deleted"] is True
