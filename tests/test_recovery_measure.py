"""How the harness measures recovery after a stopped worker (harness/recovery.py), on histories
built event by event: the stopped work's next attempt elsewhere counts, other work does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from core import failpoints
from core.config import PROJECT_ROOT
from harness.recovery import measure, summarize

STOP = 1_000.0
DEAD, ALIVE = 111, 222


class History:
    def __init__(self) -> None:
        self.events: list[HistoryEvent] = []

    def add(self, at: float, event_type: EventType.ValueType, **attributes: object) -> int:
        event = HistoryEvent(event_id=len(self.events) + 1, event_type=event_type)
        event.event_time.CopyFrom(Timestamp(seconds=int(at), nanos=round(at % 1 * 1e9)))
        for name, values in attributes.items():
            getattr(event, name).MergeFrom(getattr(event, name).__class__(**values))  # type: ignore[arg-type]
        self.events.append(event)
        return event.event_id

    def activity(self, at: float, kind: str) -> int:
        return self.add(
            at,
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            activity_task_scheduled_event_attributes={"activity_type": {"name": kind}},
        )

    def started(self, at: float, scheduled: int, attempt: int, pid: int) -> None:
        self.add(
            at,
            EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED,
            activity_task_started_event_attributes={
                "scheduled_event_id": scheduled,
                "attempt": attempt,
                "identity": f"{pid}@host",
            },
        )

    def completed(self, at: float, scheduled: int) -> None:
        self.add(
            at,
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            activity_task_completed_event_attributes={"scheduled_event_id": scheduled},
        )

    def task(self, at: float, pid: int) -> None:
        self.add(
            at,
            EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            workflow_task_started_event_attributes={"identity": f"{pid}@host"},
        )


def test_a_killed_partition_recovers_when_its_retry_starts_elsewhere_not_when_other_work_moves():
    h = History()
    p0, p1 = h.activity(STOP - 5, "cleanup_partition"), h.activity(STOP - 5, "cleanup_partition")
    h.started(STOP - 4, p1, 1, ALIVE)
    h.completed(STOP + 2, p1)
    h.task(STOP + 2.1, ALIVE)  # the other partition reported: not a recovery of p0
    h.started(STOP + 8.4, p0, 2, ALIVE)  # the killed one, retried after its heartbeat timeout
    h.completed(STOP + 9, p0)
    # The workflow's next task goes to the dead worker's sticky queue first, until it times out.
    h.add(
        STOP + 9,
        EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
        workflow_task_scheduled_event_attributes={"task_queue": {"name": f"{DEAD}@host-sticky"}},
    )
    h.add(STOP + 12, EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT, workflow_task_timed_out_event_attributes={})

    found = measure(h.events, "cleanup_partition.after_commit", STOP, DEAD)
    assert found.seconds == 8.4, found
    assert "attempt 2" in found.how
    assert found.sticky_wait == 3.0


def test_work_finished_by_a_stopping_worker_recovers_when_the_next_step_starts_elsewhere():
    h = History()
    batch = h.activity(STOP - 1, "relay_outbox_batch")
    h.started(STOP - 0.5, batch, 1, DEAD)
    h.completed(STOP + 1.0, batch)  # held during the shutdown, then reported
    h.task(STOP + 1.05, ALIVE)
    later = h.activity(STOP + 1.1, "relay_outbox_batch")
    h.started(STOP + 1.2, later, 1, ALIVE)
    h.completed(STOP + 3, later)

    found = measure(h.events, "relay_outbox_batch.after_commit", STOP, DEAD)
    assert found.seconds == 1.05, found


def test_a_local_activity_killed_in_its_workflow_task_recovers_with_the_next_task_elsewhere():
    h = History()
    h.task(STOP - 0.2, DEAD)  # the settlement runs inside this task
    h.task(STOP + 5.1, ALIVE)  # after the workflow task timeout

    assert measure(h.events, "settle_cleanup.after_commit", STOP, DEAD).seconds == 5.1
    assert measure(History().events, "settle_cleanup.after_commit", STOP, DEAD).seconds is None


def test_the_summary_says_whether_each_goal_was_met():
    rows = summarize(
        [
            ("claim", "SIGKILL", 8.1),
            ("claim", "SIGKILL", 9.0),
            ("claim", "SIGTERM", 2.5),
            ("outbox relay", "SIGTERM", None),
        ]
    )
    by = {(r["work"], r["signal"]): r for r in rows}
    assert by["claim", "SIGKILL"]["max"] == 9.0 and by["claim", "SIGKILL"]["met"]
    assert not by["claim", "SIGTERM"]["met"], "2.5 s is over the 2 s goal"
    assert not by["outbox relay", "SIGTERM"]["met"], "a stop whose recovery was not seen never meets it"


def test_a_shared_failpoint_acts_once_at_the_nth_hit_across_processes(tmp_path: Path):
    shared = tmp_path / "failpoints.json"
    failpoints.arm_shared(shared, "x.after_commit=exit@3")
    hit_twice = "from core import failpoints\nfor _ in range(2):\n    failpoints.hit('x.after_commit')\n"

    def process() -> subprocess.CompletedProcess[str]:
        env = {"CLEANUP_FAILPOINTS_FILE": str(shared), "CLEANUP_FAILPOINTS_ENABLED": "1", "PATH": ""}
        return subprocess.run(
            [sys.executable, "-c", hit_twice], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60
        )

    first, second, third = process(), process(), process()
    assert first.returncode == 0, first.stderr
    assert second.returncode == failpoints.EXIT_CODE, "its first hit is the third in all"
    assert third.returncode == 0, "fired once: later hits do nothing"
    state = failpoints.shared_state(shared)
    assert state["fired"]["point"] == "x.after_commit" and state["fired"]["action"] == "exit"
    assert state["hits"] == {"x.after_commit": 3}
