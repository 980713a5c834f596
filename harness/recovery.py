"""Recovery after a stopped worker, measured per stop from the workflow's Temporal history.

**Recovery** is the time from the moment a worker stopped (killed with SIGKILL, or sent SIGTERM:
the failpoint's own clock reading, `fired.at`) to the moment the work it was doing is under way
again on another worker, as the server recorded it:

- an activity (a cleanup partition, the chunked claim, a ledger shard, the ledger settlement, an
  outbox relay batch) retried after the stop: the start of its next attempt on another worker
  (the `ActivityTaskStarted` event of a retried activity carries that attempt's start time);
- work that the stopping worker finished itself during its graceful shutdown (a SIGTERM), or a
  local activity (the cleanup's settlement runs inside a workflow task): the next workflow task
  started by another worker after it, i.e. the workflow taking its next step elsewhere;
- and if the workflow had no step left, the moment it closed.

Only the stopped work counts: another partition finishing on the other worker meanwhile is not a
recovery. Stops and events share one clock (the harness, its workers and the dev server run on one
machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError

# The activity each failpoint sits in; None: a local activity (it runs inside a workflow task).
FAILPOINT_ACTIVITY: dict[str, str | None] = {
    "cleanup_partition.after_commit": "cleanup_partition",
    "claim_cleanup_in_chunks.after_commit": "claim_cleanup_in_chunks",
    "settle_cleanup.after_commit": None,
    "reconcile_shard.after_commit": "reconcile_shard",
    "settle_ledger_date.after_commit": "settle_ledger_date",
    "relay_outbox_batch.after_send": "relay_outbox_batch",
    "relay_outbox_batch.after_commit": "relay_outbox_batch",
}
# The kind of work each failpoint stops, as the recovery table names it.
WORK = {
    "cleanup_partition.after_commit": "cleanup partition",
    "claim_cleanup_in_chunks.after_commit": "claim",
    "settle_cleanup.after_commit": "settlement (cleanup)",
    "reconcile_shard.after_commit": "ledger shard",
    "settle_ledger_date.after_commit": "settlement (ledger)",
    "relay_outbox_batch.after_send": "outbox relay",
    "relay_outbox_batch.after_commit": "outbox relay",
}
# Goals: resumed elsewhere within this many seconds after the stop.
GOAL_SECONDS = {"SIGKILL": 10.0, "SIGTERM": 2.0}


@dataclass
class Recovery:
    seconds: float | None
    how: str
    # After the stop, how long the workflow's tasks waited on the stopped worker's sticky queue
    # (the worker's sticky schedule-to-start timeout, once per workflow it had cached): not part of
    # the recovery (the work was under way again), but it delays the workflow's next step.
    sticky_wait: float = 0.0


@dataclass
class _Activity:
    type: str
    started: float | None = None
    attempt: int = 0
    identity: str = ""
    closed: float | None = None


def _t(event: Any) -> float:
    return float(event.event_time.ToMicroseconds()) / 1e6


def measure(events: list[Any], point: str, stopped_at: float, pid: int) -> Recovery:
    """Recovery of the work stopped at `point` in process `pid` at `stopped_at` (epoch seconds)."""
    found, sticky_wait = _measure(events, point, stopped_at, pid)
    found.sticky_wait = round(sticky_wait, 2)
    return found


def _measure(events: list[Any], point: str, stopped_at: float, pid: int) -> tuple[Recovery, float]:
    kind = FAILPOINT_ACTIVITY[point]

    def elsewhere(identity: str) -> bool:
        return not identity.startswith(f"{pid}@")

    acts: dict[int, _Activity] = {}
    task_starts: list[tuple[float, str]] = []
    closed_at: float | None = None
    sticky_since: float | None = None
    sticky_wait = 0.0
    for e in events:
        if e.HasField("workflow_task_scheduled_event_attributes"):
            queue = e.workflow_task_scheduled_event_attributes.task_queue.name
            if _t(e) >= stopped_at and queue.startswith(f"{pid}@"):
                sticky_since = _t(e)
        elif sticky_since is not None and (
            e.HasField("workflow_task_started_event_attributes")
            or e.HasField("workflow_task_timed_out_event_attributes")
        ):
            sticky_wait += _t(e) - sticky_since
            sticky_since = None
        if e.HasField("activity_task_scheduled_event_attributes"):
            acts[e.event_id] = _Activity(e.activity_task_scheduled_event_attributes.activity_type.name)
        elif e.HasField("activity_task_started_event_attributes"):
            a = e.activity_task_started_event_attributes
            if a.scheduled_event_id in acts:
                act = acts[a.scheduled_event_id]
                act.started, act.attempt, act.identity = _t(e), a.attempt, a.identity
        elif e.HasField("workflow_task_started_event_attributes"):
            task_starts.append((_t(e), e.workflow_task_started_event_attributes.identity))
        elif closed_at is None and e.event_type in _WORKFLOW_CLOSED:
            closed_at = _t(e)
        for field in _ACTIVITY_CLOSED:
            if e.HasField(field):
                scheduled = getattr(e, field).scheduled_event_id
                if scheduled in acts:
                    acts[scheduled].closed = _t(e)

    after = stopped_at
    if kind is not None:
        mine = [a for a in acts.values() if a.type == kind]
        retried = [
            a
            for a in mine
            if a.started is not None and a.started >= stopped_at and a.attempt > 1 and elsewhere(a.identity)
        ]
        if retried:
            last = max(retried, key=lambda a: a.started or 0.0)
            assert last.started is not None
            how = f"{kind} attempt {last.attempt} started on {last.identity}"
            if len(retried) > 1:
                how += f" ({len(retried)} activities resumed)"
            return Recovery(round(last.started - stopped_at, 2), how), sticky_wait
        finished = [
            a.closed for a in mine if a.closed is not None and a.closed >= stopped_at and not elsewhere(a.identity)
        ]
        if finished:
            after = max(finished)
    nxt = next(((t, who) for t, who in task_starts if t >= after and elsewhere(who)), None)
    if nxt is not None:
        what = f"{kind} finished by the stopping worker, then" if after > stopped_at else "then"
        return Recovery(
            round(nxt[0] - stopped_at, 2), f"{what} the next workflow task started on {nxt[1]}"
        ), sticky_wait
    if closed_at is not None and closed_at >= stopped_at:
        return Recovery(round(closed_at - stopped_at, 2), "the stopping worker finished the workflow"), sticky_wait
    return Recovery(None, "no sign in the history of the work resuming"), sticky_wait


async def measure_workflows(
    client: Client, workflow_ids: list[str], point: str, stopped_at: float, pid: int
) -> Recovery:
    """`measure` over the first of these workflows whose history shows the stopped work resume."""
    found = Recovery(None, "no history")
    for workflow_id in workflow_ids:
        try:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
        except RPCError as err:
            found = Recovery(None, f"history of {workflow_id} not readable: {err.message}")
            continue
        found = measure(list(history.events), point, stopped_at, pid)
        if found.seconds is not None:
            return found
    return found


def summarize(samples: list[tuple[str, str, float | None]]) -> list[dict[str, Any]]:
    """Rows of the recovery table: per kind of work and signal, the stops and their recovery."""
    rows: list[dict[str, Any]] = []
    order = list(dict.fromkeys(WORK.values()))
    for work in order:
        for signal in GOAL_SECONDS:
            values = [s for w, sig, s in samples if w == work and sig == signal]
            if not values:
                continue
            measured = sorted(v for v in values if v is not None)
            goal = GOAL_SECONDS[signal]
            rows.append(
                {
                    "work": work,
                    "signal": signal,
                    "stops": len(values),
                    "measured": len(measured),
                    "min": measured[0] if measured else None,
                    "p50": measured[len(measured) // 2] if measured else None,
                    "max": measured[-1] if measured else None,
                    "goal": goal,
                    "met": bool(measured) and len(measured) == len(values) and measured[-1] <= goal,
                }
            )
    return rows


_ACTIVITY_CLOSED = (
    "activity_task_completed_event_attributes",
    "activity_task_failed_event_attributes",
    "activity_task_timed_out_event_attributes",
    "activity_task_canceled_event_attributes",
)


_WORKFLOW_CLOSED = frozenset(
    {
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
    }
)
