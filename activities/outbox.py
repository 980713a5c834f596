"""The outbox relay: claim a batch of due events under a lease, send them to the mail provider,
record every outcome in one statement.

At least once, never twice to the customer: an event is marked delivered only after the provider
acknowledged it, so a relay that dies between sending and recording leaves the event pending under
a lease that expires; another relay sends it again with the same `Idempotency-Key` (the event key)
and the provider acknowledges the duplicate without delivering it a second time.

The bearer token lives in this object only. It is sent in the Authorization header and nowhere
else: not in activity inputs or results (Temporal history), not in logs, not in stored errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Literal

import asyncpg
from temporalio import activity
from temporalio.exceptions import ApplicationError

import outbox
from core import failpoints, metrics
from core.http_client import HttpConnection, HttpError, HttpResponse, parse_base_url
from core.queries import load
from outbox.models import RELAY_NOT_CONFIGURED, RelayBatchInput, RelayBatchResult, RelayBatchSettings

SQL = load(outbox.__file__)
log = logging.getLogger(__name__)

SEND_PATH = "/v1/messages"
ERROR_TEXT_LIMIT = 1000
# Stop starting requests this long before the lease ends, to leave time to record the outcomes.
LEASE_MARGIN_SECONDS = 1.0

OutcomeKind = Literal["delivered", "retry", "dead"]
_JITTER = random.Random()
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]{1,500}$")


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    http_status: int | None = None
    delay_seconds: float = 0.0
    error: str | None = None


def redact(text: str, secret: str | None) -> str:
    """Belt and braces: whatever a provider echoes back, the token never reaches the database."""
    if secret:
        text = text.replace(secret, "***")
    return text


def backoff_seconds(attempts: int, settings: RelayBatchSettings, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter: initial * 2^(attempts-1), capped, times [0.8, 1.0)."""
    base = min(settings.backoff_max_seconds, settings.backoff_initial_seconds * 2.0 ** max(attempts - 1, 0))
    jitter: float = (rng or _JITTER).random()
    return float(base * (0.8 + 0.2 * jitter))


def retry_after_seconds(value: str | None, settings: RelayBatchSettings, now: datetime) -> float | None:
    """Retry-After is either delta-seconds or an HTTP-date (RFC 9110 10.2.3); None if unusable."""
    if value is None:
        return None
    value = value.strip()
    seconds: float
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    return min(max(seconds, 0.0), settings.retry_after_max_seconds)


def classify(
    response: HttpResponse | None,
    failure: str | None,
    attempts: int,
    settings: RelayBatchSettings,
    now: datetime | None = None,
) -> Outcome:
    """The retry policy, as a pure function of the provider's answer and the event's attempt count.

    2xx delivered. 429 waits Retry-After (or the backoff) and is never dead-lettered: rate limits are
    the provider's state, not the event's fault. 5xx, 408, 401/403 (credentials are configuration,
    not the event), timeouts and broken connections retry with backoff until `max_attempts`. Any
    other 4xx means the provider rejects this event: dead letter with its answer, no retry.
    """
    if response is None:
        error = failure or "no answer"
        status = None
    else:
        status = response.status
        error = f"HTTP {status}: {response.text(ERROR_TEXT_LIMIT)}"
    if status is not None and 200 <= status < 300:
        return Outcome("delivered", status)
    if status == 429:
        delay = retry_after_seconds(
            response.headers.get("retry-after") if response else None, settings, now or datetime.now(UTC)
        )
        return Outcome("retry", status, backoff_seconds(attempts, settings) if delay is None else delay, error)
    if status is not None and 400 <= status < 500 and status not in (401, 403, 408):
        return Outcome("dead", status, 0.0, error)
    if status in (401, 403):
        error = f"HTTP {status}: the provider refused the relay's credentials (check MAIL_PROVIDER_TOKEN)"
    if attempts >= settings.max_attempts:
        return Outcome("dead", status, 0.0, f"gave up after {attempts} attempts; last: {error}")
    return Outcome("retry", status, backoff_seconds(attempts, settings), error)


class OutboxRelayActivities:
    """Holds the pool and the provider's address and token; one instance per worker process."""

    def __init__(self, pool: asyncpg.Pool, provider_url: str | None, token: str | None) -> None:
        self.pool = pool
        self._base = parse_base_url(provider_url) if provider_url else None
        self._token = token or None

    @classmethod
    def from_env(cls, pool: asyncpg.Pool) -> OutboxRelayActivities:
        """MAIL_PROVIDER_URL and MAIL_PROVIDER_TOKEN; if either is unset the activity fails clearly."""
        return cls(pool, os.environ.get("MAIL_PROVIDER_URL") or None, os.environ.get("MAIL_PROVIDER_TOKEN"))

    def __repr__(self) -> str:  # never the token
        where = self._base.geturl() if self._base else "unconfigured"
        return f"OutboxRelayActivities(provider={where!r})"

    @property
    def configured(self) -> bool:
        return self._base is not None and self._token is not None

    @activity.defn
    async def relay_outbox_batch(self, input: RelayBatchInput) -> RelayBatchResult:
        """Claim up to `batch_size` due events under a lease, send them, record the outcomes."""
        if not self.configured:
            raise ApplicationError(
                "the outbox relay is not configured on this worker: set MAIL_PROVIDER_URL and "
                "MAIL_PROVIDER_TOKEN in the worker's environment",
                type=RELAY_NOT_CONFIGURED,
                non_retryable=True,
            )
        s = input.settings
        info = activity.info()
        # Unique per claim: the fencing token for recording outcomes, readable in `outbox status`.
        owner = f"{input.relay_id}/{info.activity_id}#{info.attempt}/{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        rows = await self.pool.fetch(SQL.claim_batch, owner, s.batch_size, s.lease_seconds)
        result = RelayBatchResult(claimed=len(rows))
        if rows:
            activity.heartbeat({"claimed": len(rows)})
            outcomes = await self._send_all(rows, s, send_until=started + s.lease_seconds - LEASE_MARGIN_SECONDS)
            failpoints.hit("outbox_relay.after_send")
            ids = [r["event_id"] for r in rows]
            recorded = await self.pool.fetchrow(
                SQL.record_outcomes,
                owner,
                ids,
                [outcomes[i].kind for i in ids],
                [outcomes[i].http_status for i in ids],
                [outcomes[i].delay_seconds for i in ids],
                [outcomes[i].error for i in ids],
            )
            failpoints.hit("outbox_relay.after_commit")
            assert recorded is not None
            result = result.model_copy(update=dict(recorded))
            metrics.record_outbox(result.delivered, result.dead)
            for r in rows:
                if outcomes[r["event_id"]].kind == "dead":
                    activity.logger.warning(
                        "outbox event %s dead-lettered: %s", r["event_key"], outcomes[r["event_id"]].error
                    )
        if len(rows) < s.batch_size:
            summary = await self.pool.fetchrow(SQL.pending_summary)
            assert summary is not None
            result = result.model_copy(update=dict(summary))
        activity.logger.info(
            "relay %s batch: claimed %d, delivered %d, retry %d, dead %d, fenced %d",
            input.relay_id,
            result.claimed,
            result.delivered,
            result.retried,
            result.dead,
            result.fenced,
        )
        return result

    async def _send_all(
        self, rows: list[asyncpg.Record], s: RelayBatchSettings, send_until: float
    ) -> dict[int, Outcome]:
        """Send with at most `concurrency` requests in flight, one keep-alive connection each."""
        queue: asyncio.Queue[asyncpg.Record] = asyncio.Queue()
        for row in rows:
            queue.put_nowait(row)
        outcomes: dict[int, Outcome] = {}
        assert self._base is not None

        async def sender() -> None:
            assert self._base is not None
            conn = HttpConnection(self._base)
            try:
                while not queue.empty():
                    row = queue.get_nowait()
                    if time.monotonic() + s.request_timeout_seconds > send_until:
                        # Not sent: the lease would run out before an answer could be recorded.
                        outcomes[row["event_id"]] = Outcome("retry", None, 0.0, "not sent: lease ran short")
                        continue
                    outcomes[row["event_id"]] = await self._send_one(conn, row, s)
                    activity.heartbeat({"sent": len(outcomes)})
            finally:
                await conn.close()

        await asyncio.gather(*(sender() for _ in range(min(s.concurrency, len(rows)))))
        return outcomes

    async def _send_one(self, conn: HttpConnection, row: asyncpg.Record, s: RelayBatchSettings) -> Outcome:
        if not _HEADER_SAFE.match(row["event_key"]):
            # Never put it in a header (CR/LF would inject headers); a bad event, not a provider problem.
            return Outcome("dead", None, 0.0, "event key is not a valid Idempotency-Key (printable ASCII only)")
        body = json.dumps(
            {
                "event_key": row["event_key"],
                "kind": row["kind"],
                "account_id": row["account_id"],
                "source_id": row["source_id"],
                "payload": json.loads(row["payload"]),
            }
        ).encode()
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Idempotency-Key": row["event_key"],
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        response: HttpResponse | None = None
        failure: str | None = None
        try:
            response = await conn.request("POST", SEND_PATH, headers, body, s.request_timeout_seconds)
        except TimeoutError:
            failure = f"timeout: no answer within {s.request_timeout_seconds:g}s"
        except HttpError as err:
            failure = str(err)
        outcome = classify(response, failure, row["attempts"], s)
        if outcome.error is not None:
            outcome = Outcome(
                outcome.kind, outcome.http_status, outcome.delay_seconds, redact(outcome.error, self._token)
            )
        return outcome
