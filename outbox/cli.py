"""`starter.py outbox ...`: operate the reminder outbox and its relays.

outbox status [--dead N] [--json]        counts by state, dead letters with the provider's answer, relays
outbox redeliver EVENT_KEY [--json]      give a dead letter another chance (or send a pending one now)
outbox redeliver --dead-since T [--dead-reason TEXT] [--yes]
                                         count the dead letters a filter selects; --yes redelivers them
outbox relay start [--relays N] [...]    start the long-running relay workflows outbox-relay-1..N
outbox relay stop [--json]               ask this task queue's running relays to stop after their batch
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from core.cli import CliContext, Commands, count_argument, emit, finite_float
from core.config import Settings
from core.errors import InputError, parse_instant, validation_message
from outbox.models import RelayBatchSettings
from outbox.operations import (
    check_event_key,
    outbox_status,
    redeliver_dead,
    redeliver_event,
    start_relays,
    stop_relays,
)


def _human_status(d: dict[str, Any]) -> str:
    lines = [
        f"pending    {d['pending']} (due now {d['due_now']}, leased {d['leased']}, retrying {d['retrying']})",
        f"delivered  {d['delivered']} (last at {d['last_delivered_at'] or '-'})",
        f"dead       {d['dead']}",
        f"oldest pending since {d['oldest_pending_created_at'] or '-'}; next attempt {d['next_attempt_at'] or '-'}",
    ]
    if d["dead_letters"]:
        lines.append("dead letters (newest first):")
        lines += [f"  {r['event_key']}  attempts={r['attempts']}  {r['dead_reason']}" for r in d["dead_letters"]]
    relays = d.get("relays")
    if relays is not None:
        lines.append(f"running relays: {', '.join(r['workflow_id'] for r in relays) or 'none'}")
    return "\n".join(lines)


async def cmd_outbox_status(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings) as ctx:
        data = (await outbox_status(ctx.pool, ctx.client, dead_limit=args.dead)).model_dump(mode="json")
    emit(args, data, _human_status)


def _human_redelivery(d: dict[str, Any]) -> str:
    span = f" (dead {d['oldest_dead_at'].isoformat()} .. {d['newest_dead_at'].isoformat()})" if d["matching"] else ""
    if not d["confirmed"]:
        return f"{d['matching']} dead letter(s) match{span}; nothing changed: add --yes to redeliver them"
    nudged = ", ".join(d.get("nudged") or []) or "no relay"
    return f"{d['redelivered']} dead letter(s) redelivered{span}; nudged {nudged}"


async def cmd_outbox_redeliver(args: argparse.Namespace, settings: Settings) -> None:
    if args.event_key is None:
        dead_since = parse_instant(args.dead_since, "--dead-since") if args.dead_since else None
        async with CliContext(settings) as ctx:
            found = await redeliver_dead(
                ctx.pool,
                dead_since=dead_since,
                reason=args.dead_reason,
                confirmed=args.yes,
                client=ctx.client,
                task_queue=ctx.settings.task_queue,
            )
        emit(args, found.given(), _human_redelivery)
        return
    if args.dead_since or args.dead_reason:
        raise InputError("give either one EVENT_KEY or a filter (--dead-since, --dead-reason), not both")
    check_event_key(args.event_key)
    async with CliContext(settings) as ctx:
        data = (await redeliver_event(ctx.pool, args.event_key, ctx.client, ctx.settings.task_queue)).model_dump(
            mode="json"
        )
    emit(
        args,
        data,
        lambda d: (
            f"{d['event_key']}: {d['previous_status']} -> pending, due now "
            f"(redelivery #{d['redeliveries']}; nudged {', '.join(d.get('nudged') or []) or 'no relay'})"
        ),
    )


def _batch_settings(args: argparse.Namespace, settings: Settings) -> RelayBatchSettings:
    try:
        return RelayBatchSettings(
            batch_size=args.batch_size,
            claims_per_batch=args.claims_per_batch,
            concurrency=args.concurrency,
            request_timeout_seconds=args.request_timeout,
            lease_seconds=args.lease,
            heartbeat_timeout_seconds=(
                settings.outbox.heartbeat_timeout_seconds if args.heartbeat_timeout is None else args.heartbeat_timeout
            ),
        )
    except ValidationError as err:
        raise InputError(validation_message(err)) from None


async def cmd_outbox_relay_start(args: argparse.Namespace, settings: Settings) -> None:
    batch = _batch_settings(args, settings)
    async with CliContext(settings, database="unused") as ctx:  # Temporal only
        relays = await start_relays(
            ctx.client,
            ctx.settings.task_queue,
            relays=args.relays,
            settings=batch,
            idle_sleep_seconds=args.idle_sleep,
        )
        started = [r.model_dump() | {"ui": ctx.settings.workflow_url(r.workflow_id)} for r in relays]
    emit(
        args,
        started,
        lambda d: "\n".join(f"relay {s['workflow_id']} running" + (f": {s['ui']}" if s["ui"] else "") for s in d),
    )


async def cmd_outbox_relay_stop(args: argparse.Namespace, settings: Settings) -> None:
    async with CliContext(settings, database="unused") as ctx:  # Temporal only
        stopped = await stop_relays(ctx.client, ctx.settings.task_queue)
    emit(args, stopped, lambda d: f"asked to stop: {', '.join(d) or 'no running relay'}")


def register(commands: Commands) -> None:
    """Add `outbox status|redeliver|relay start|stop` to starter.py."""
    outbox = commands.group("outbox", "operate the reminder outbox and its relays")

    p = outbox.add("status", cmd_outbox_status, "counts by state, dead letters and their reasons, relays")
    p.add_argument("--dead", type=count_argument(0), default=10, help="dead letters to list (default 10)")

    p = outbox.add("redeliver", cmd_outbox_redeliver, "give a dead letter (or a waiting event) a new try")
    p.add_argument("event_key", nargs="?", help="one event, e.g. renewal-reminder:acct_123:v1")
    p.add_argument("--dead-since", metavar="TIME", help="instead of one key: every dead letter dead since TIME (ISO)")
    p.add_argument(
        "--dead-reason", metavar="TEXT", help="instead of one key: every dead letter whose reason contains TEXT"
    )
    p.add_argument("--yes", action="store_true", help="redeliver what the filter selects (without it: only count)")

    relay = outbox.group("relay", "start or stop the relay workflows")
    p = relay.add("start", cmd_outbox_relay_start, "start relays outbox-relay-1..N (idempotent)")
    p.add_argument("--relays", type=int, default=2, help="relay workflows to run (default 2)")
    p.add_argument("--batch-size", type=int, default=200, help="events per claimed batch (default 200)")
    p.add_argument(
        "--claims-per-batch",
        type=int,
        default=1,
        help="claims one relay activity makes back to back while each comes back full (default 1)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight per batch (default 16)")
    p.add_argument(
        "--request-timeout", type=finite_float(), default=10.0, help="seconds per provider request (default 10)"
    )
    p.add_argument("--lease", type=finite_float(), default=120.0, help="lease seconds per claimed batch (default 120)")
    p.add_argument(
        "--idle-sleep", type=finite_float(), default=5.0, help="seconds between polls of an empty outbox (default 5)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=finite_float(),
        metavar="SECONDS",
        help="a batch whose worker died is retried elsewhere after this long without a heartbeat "
        "(env: OUTBOX_HEARTBEAT_TIMEOUT_SECONDS; default 7)",
    )
    relay.add("stop", cmd_outbox_relay_stop, "ask this task queue's running relays to stop after their batch")
