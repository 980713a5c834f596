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
import functools
import ipaddress
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from json.encoder import encode_basestring_ascii as json_string  # json.dumps of one str, in C
from typing import Literal, TypeVar
from urllib.parse import SplitResult, urlsplit

import asyncpg
import httpx
from temporalio import activity

import outbox
from core import db, failpoints, metrics
from core.config import OutboxSettings
from core.heartbeat import heartbeating
from core.outage import OUTAGE
from core.queries import load
from outbox.errors import HeaderInjectionError, OutboxFailure, outbox_failure
from outbox.models import (
    FAILURE_BATCH_ANSWER,
    FAILURE_CONNECTION,
    FAILURE_TIMEOUT,
    NOT_SENT_LEASE_SHORT,
    NOT_SENT_SHUTDOWN,
    RELAY_OUTBOX_BATCH,
    RelayBatchInput,
    RelayBatchResult,
    RelayBatchSettings,
)

SQL = load(outbox.__file__)
log = logging.getLogger(__name__)

SEND_PATH = "/v1/messages"
# The provider's batch endpoint (MAIL_PROVIDER_BATCH_MAX > 1): one request, one result per event.
SEND_BATCH_PATH = "/v1/messages/batch"
# A batch answer may be read this much longer per event it carries (one result each).
BATCH_RESPONSE_BYTES_PER_EVENT = 2048
ERROR_TEXT_LIMIT = 1000
# What of a dead letter's reason (the provider's reply included) a log line shows.
LOG_REPLY_LIMIT = 200
# Read at most this much of an answer: only its first ERROR_TEXT_LIMIT characters are ever kept.
MAX_RESPONSE_BYTES = 64 * 1024
# Stop starting requests this long before the lease ends, to leave time to record the outcomes.
LEASE_MARGIN_SECONDS = 1.0
# The connection pool of the one httpx client per activity instance (requests in flight per batch
# are bounded by RelayBatchSettings.concurrency, at most 256).
HTTP_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=30)
# While the database is away: first pause, longest pause between reconnection attempts.
DB_RETRY_INITIAL_SECONDS = 0.1
DB_RETRY_MAX_SECONDS = 1.0

OutcomeKind = Literal["delivered", "retry", "dead"]
# What one event's outcome is judged from: the provider's answer for it, or why there is none
# (the failure's text and kind, as `classify` takes them).
EventAnswer = tuple["ProviderAnswer | None", str | None, str | None]
_JITTER = random.Random()
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]{1,500}$")  # an Idempotency-Key: printable ASCII, no space
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,100}$")  # RFC 9110 token
_HEADER_VALUE = re.compile(r"^[\x20-\x7e\t]{0,4000}$")  # visible ASCII, space, tab: never CR, LF, NUL
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    http_status: int | None = None
    delay_seconds: float = 0.0
    error: str | None = None
    # Set only for a real failure (counted toward dead-lettering): "503", "timeout", "connection error".
    failure_kind: str | None = None


@dataclass(frozen=True)
class ProviderAnswer:
    """The provider's answer, as much of it as the retry policy looks at (header names lower-case)."""

    status: int
    headers: Mapping[str, str]
    body: bytes = b""

    def text(self, limit: int = ERROR_TEXT_LIMIT) -> str:
        return self.body[:limit].decode("utf-8", errors="replace")


def redact(text: str, secret: str | None) -> str:
    """Belt and braces: whatever a provider echoes back, the token never reaches the database."""
    if secret:
        text = text.replace(secret, "***")
    return text


def dead_letter_log_args(row: Mapping[str, object], outcomes: Mapping[int, Outcome]) -> tuple[str, str]:
    """A dead letter as a log line may show it: the event by its number and kind, the account by the
    name workflow IDs give it (a keyed pseudonym under payload encryption), and at most
    LOG_REPLY_LIMIT characters of the reason, with the account ID and control characters removed."""
    from core.codec import pseudonymize  # lazy: cryptography is slow to import

    try:
        codec = activity.client().data_converter.payload_codec
    except RuntimeError:  # no client (a test's ActivityEnvironment): nothing to pseudonymize with
        codec = None
    account = str(row["account_id"])
    shown = pseudonymize(codec, account)
    reason = str(outcomes[int(str(row["event_id"]))].error or "")
    reason = _CONTROL.sub(" ", reason.replace(account, shown))
    if len(reason) > LOG_REPLY_LIMIT:
        reason = reason[:LOG_REPLY_LIMIT] + "..."
    return f"#{row['event_id']} ({row['kind']}, account {shown})", reason


def parse_base_url(url: str, allow_http: bool = False) -> SplitResult:
    """The provider's URL. Plain http sends the bearer token in clear: only to a loopback address,
    or where the operator says so (MAIL_PROVIDER_ALLOW_HTTP=1, e.g. a TLS-terminating sidecar)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.username or parts.password:
        raise ValueError("put credentials in the token setting, not in the provider URL")
    if parts.scheme == "http" and not allow_http and not is_loopback(parts.hostname):
        raise ValueError(
            f"refusing http:// to {parts.hostname}: the token would travel in clear; use https, "
            "or set MAIL_PROVIDER_ALLOW_HTTP=1 if the network path is protected otherwise"
        )
    return parts


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def safe_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Refuse any header whose name or value would break the request (CR/LF injection, controls).

    httpx/h11 refuse some of these too; this guard does not depend on it, and its error never
    contains the value (the Authorization value is the token).
    """
    for name, value in headers.items():
        if not _HEADER_NAME.match(name):
            raise HeaderInjectionError(f"refusing an invalid header name ({len(name)} characters)")
        if not _HEADER_VALUE.match(value):
            raise HeaderInjectionError(f"refusing header {name}: its value contains CR, LF or control characters")
    return dict(headers)


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
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    return min(max(seconds, 0.0), settings.retry_after_max_seconds)


def failure_summary(counts: Mapping[str, int]) -> str:
    """{"503": 20, "timeout": 5} -> "20\u00d7 503, 5\u00d7 timeout" (most frequent first)."""
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n}\u00d7 {kind}" for kind, n in ordered if n > 0)


def message_json(row: Mapping[str, object]) -> str:
    """One event as a message of a batch request (what json.dumps would write, field by field). The
    payload is the database's own JSON text (jsonb output), put in as it is rather than parsed and
    encoded again."""
    key = json_string(str(row["event_key"]))
    payload = row["payload"]
    return (
        f'{{"idempotency_key": {key}, "event_key": {key}, "kind": {json_string(str(row["kind"]))}, '
        f'"account_id": {json_string(str(row["account_id"]))}, "source_id": {json_string(str(row["source_id"]))}, '
        f'"payload": {payload if isinstance(payload, str) else json.dumps(payload)}}}'
    )


def batch_event_answers(
    answer: ProviderAnswer | None, failure: str | None, failure_kind: str | None, keys: list[str]
) -> dict[str, EventAnswer]:
    """Each event's answer from the answer to the batch request that carried it.

    No answer (timeout, broken connection), or a whole-batch 429, 5xx, 408, 401/403: that answer is
    every event's, and `classify` treats it as it would a single send's (so a 429's Retry-After holds
    for all). Any other 4xx for the whole request refuses the batch, not an event: a failure that is
    retried, never an event's dead letter. A 2xx carries one result per event, found by idempotency
    key: an event with no readable result counts a failure and is sent again (the key deduplicates).
    """
    if answer is None:
        return {k: (None, failure, failure_kind) for k in keys}
    if not 200 <= answer.status < 300:
        if 400 <= answer.status < 500 and answer.status not in (401, 403, 408, 429):
            refused = f"the provider refused the whole batch: HTTP {answer.status}: {answer.text()}"
            return {k: (None, refused, f"batch {answer.status}") for k in keys}
        return {k: (answer, None, None) for k in keys}
    try:
        results = json.loads(answer.body)["results"]
        found = {r["idempotency_key"]: r for r in results if isinstance(r, dict) and isinstance(r.get("status"), int)}
    except (ValueError, TypeError, KeyError):
        unreadable = f"the provider's batch answer has no readable results: {answer.text(200)}"
        return {k: (None, unreadable, FAILURE_BATCH_ANSWER) for k in keys}
    missing: EventAnswer = (None, "no result for this event in the provider's batch answer", FAILURE_BATCH_ANSWER)
    return {k: (_result_answer(found[k]), None, None) if k in found else missing for k in keys}


@functools.cache
def _accepted(status: int) -> ProviderAnswer:
    """The answer of every accepted event of a batch with this status: one object, not one per event."""
    return ProviderAnswer(status, {})


def _result_answer(result: Mapping[str, object]) -> ProviderAnswer:
    """One result of a batch answer as the answer to a single send: its status, its own Retry-After,
    and (unless accepted) its error text, which a retry or a dead letter records."""
    status = int(str(result["status"]))
    if 200 <= status < 300:
        return _accepted(status)
    retry_after = result.get("retry_after")
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    text = result.get("error") or json.dumps(result)
    return ProviderAnswer(status, headers, str(text).encode())


def classify(
    answer: ProviderAnswer | None,
    failure: str | None,
    attempts: int,
    settings: RelayBatchSettings,
    now: datetime | None = None,
    failures: Mapping[str, int] | None = None,
    failure_kind: str | None = None,
) -> Outcome:
    """The retry policy, as a pure function of the provider's answer and the event's past failures.

    `attempts` counts claims (this one included), `failures` the real failures so far by kind.
    2xx delivered. 429 waits Retry-After (or the backoff) and never counts toward dead-lettering:
    rate limits are the provider's state, not the event's fault. 5xx, 408, 401/403 (credentials are
    configuration, not the event), timeouts and broken connections are failures: they retry with
    backoff (a 503's Retry-After wins) until `max_attempts` failures, then dead-letter with the
    failures counted by kind. A 409 after one of our timeouts is the provider still processing
    that request: asked again like a 429. Any other 4xx means the provider rejects this event: dead letter with
    its answer, no retry.
    """
    now = now or datetime.now(UTC)
    if answer is None:
        error = failure or "no answer"
        status = None
        kind = failure_kind or FAILURE_CONNECTION
    else:
        status = answer.status
        error = f"HTTP {status}: {answer.text(ERROR_TEXT_LIMIT)}"
        kind = str(status)
    if status is not None and 200 <= status < 300:
        return Outcome("delivered", status)
    if status == 429:
        delay = retry_after_seconds(answer.headers.get("retry-after") if answer else None, settings, now)
        return Outcome("retry", status, backoff_seconds(attempts, settings) if delay is None else delay, error)
    if status == 409 and (failures or {}).get(FAILURE_TIMEOUT):
        # After our own timeout, a 409 is the provider still working on our earlier request with
        # this key (which it may well deliver): ask again later, as for a 429; never a dead letter.
        delay = retry_after_seconds(answer.headers.get("retry-after") if answer else None, settings, now)
        error = f"in progress at the provider (HTTP 409 after our timeout), asking again: {error}"
        return Outcome("retry", status, backoff_seconds(attempts, settings) if delay is None else delay, error)
    if status is not None and 400 <= status < 500 and status not in (401, 403, 408):
        return Outcome("dead", status, 0.0, error)
    if status in (401, 403):
        error = f"HTTP {status}: the provider refused the relay's credentials (check MAIL_PROVIDER_TOKEN)"
    counts = dict(failures or {})
    counts[kind] = counts.get(kind, 0) + 1
    total = sum(counts.values())
    if total >= settings.max_attempts:
        reason = f"gave up after {total} failures: {failure_summary(counts)}; last: {error}"
        return Outcome("dead", status, 0.0, reason, kind)
    delay = None
    if status == 503 and answer is not None:
        delay = retry_after_seconds(answer.headers.get("retry-after"), settings, now)
    return Outcome("retry", status, backoff_seconds(total, settings) if delay is None else delay, error, kind)


async def with_database(what: str, until: float, statement: Callable[[], Awaitable[T]]) -> T:
    """Run one statement; if the database connection was lost, run it again once the database is back.

    Gives up (re-raises) at `until` (time.monotonic()). Only for statements that are safe to run
    twice: the claim (its owner is unique, see release_lease) and the recording of outcomes.
    """
    pause = DB_RETRY_INITIAL_SECONDS
    while True:
        try:
            return await statement()
        except Exception as err:
            if not db.connection_lost(err) or time.monotonic() + pause > until:
                raise
            OUTAGE.lost(err)  # one WARNING per outage; each retry below it
            log.info("relay: database connection lost during %s (%s); retrying", what, type(err).__name__)
        if activity.in_activity():
            activity.heartbeat({"waiting_for_database": what})
        await asyncio.sleep(pause)
        pause = min(pause * 2, DB_RETRY_MAX_SECONDS)


def record_arguments(owner: str, ids: list[int], outcomes: Mapping[int, Outcome]) -> tuple[object, ...]:
    """record_outcomes' parameters: the delivered events as IDs and statuses, every other event's
    outcome column by column."""
    delivered = [i for i in ids if outcomes[i].kind == "delivered"]
    others = [i for i in ids if outcomes[i].kind != "delivered"] if len(delivered) < len(ids) else []
    return SQL.bind(
        "record_outcomes",
        lease_owner=owner,
        delivered_ids=delivered,
        delivered_statuses=[outcomes[i].http_status for i in delivered],
        event_ids=others,
        outcomes=[outcomes[i].kind for i in others],
        http_statuses=[outcomes[i].http_status for i in others],
        delays_seconds=[outcomes[i].delay_seconds for i in others],
        errors=[outcomes[i].error for i in others],
        failure_kinds=[outcomes[i].failure_kind for i in others],
    )


class OutboxRelayActivities:
    """Holds the pool, the provider's address and token, and one pooled httpx client; one per worker."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        provider_url: str | None,
        token: str | None,
        allow_http: bool = False,
        batch_max: int = 0,
    ) -> None:
        self.pool = pool
        # Events per request to the provider's batch endpoint; 0 or 1: one request per event.
        self.batch_max = batch_max
        self._base = parse_base_url(provider_url, allow_http) if provider_url else None
        self._token = token or None
        if self._token is not None:
            safe_headers({"Authorization": f"Bearer {self._token}"})  # a token with CR/LF is refused here
        self._http: httpx.AsyncClient | None = None

    @classmethod
    def from_settings(cls, pool: asyncpg.Pool, settings: OutboxSettings) -> OutboxRelayActivities:
        """MAIL_PROVIDER_URL and MAIL_PROVIDER_TOKEN (if either is unset the activity fails clearly);
        MAIL_PROVIDER_ALLOW_HTTP=1 allows http:// beyond loopback; MAIL_PROVIDER_BATCH_MAX > 1 sends
        that many events per request to the batch endpoint. `settings`: the worker's outbox
        section."""
        found = settings
        token = found.provider_token.get_secret_value() if found.provider_token else None
        return cls(pool, found.provider_url, token, found.provider_allow_http, found.provider_batch_max)

    def __repr__(self) -> str:  # never the token
        where = self._base.geturl() if self._base else "unconfigured"
        return f"OutboxRelayActivities(provider={where!r}, batch_max={self.batch_max})"

    @property
    def configured(self) -> bool:
        return self._base is not None and self._token is not None

    def _client(self) -> httpx.AsyncClient:
        """One client per instance (so per worker), created on first use: pooled keep-alive connections."""
        if self._http is None:
            assert self._base is not None
            self._http = httpx.AsyncClient(
                base_url=self._base.geturl(),
                limits=HTTP_LIMITS,
                timeout=httpx.Timeout(10.0),  # each request passes its own
                verify=True,  # TLS certificates and host names are checked (the system's CA bundle via certifi)
                follow_redirects=False,
                trust_env=False,  # no proxy or netrc from the environment: the Authorization header is ours
            )
        return self._http

    async def aclose(self) -> None:
        client, self._http = self._http, None
        if client is not None:
            await client.aclose()

    @activity.defn(name=RELAY_OUTBOX_BATCH)
    async def relay_outbox_batch(self, input: RelayBatchInput) -> RelayBatchResult:
        """Claim up to `batch_size` due events under a lease, send them, record the outcomes (up to
        `claims_per_batch` times)."""
        if not self.configured:
            raise outbox_failure(
                OutboxFailure.RELAY_NOT_CONFIGURED,
                "the outbox relay is not configured on this worker: set MAIL_PROVIDER_URL and "
                "MAIL_PROVIDER_TOKEN in the worker's environment",
            )
        # Heartbeat all along (the claim, requests in flight, the recording), so the heartbeat timeout
        # need not cover a slow request: a dead worker is noticed within it, a live one never judged dead.
        timeout = activity.info().heartbeat_timeout
        progress: dict[str, int] = {}
        async with heartbeating(
            lambda: activity.heartbeat(dict(progress)), timeout.total_seconds() / 3 if timeout else 10.0
        ):
            return await self._relay_batch(input, progress)

    async def _relay_batch(self, input: RelayBatchInput, progress: dict[str, int]) -> RelayBatchResult:
        """Up to `claims_per_batch` claims back to back, each under a lease of its own, while each
        comes back full: fewer Temporal round trips per event. A new claim starts only in the first
        half of the lease, and every claim stops sending by the first one's lease end, so the
        activity stays within its start-to-close timeout (the lease plus a margin)."""
        s = input.settings
        info = activity.info()
        started = time.monotonic()
        attempt = f"{info.activity_id}#{info.attempt}"
        result = RelayBatchResult(claims=0)
        while True:
            one = await self._relay_claim(input.relay_id, attempt, s, started, progress)
            result = result.add(one)
            if (
                one.claimed < s.batch_size
                or result.claims >= s.claims_per_batch
                or time.monotonic() - started >= s.lease_seconds / 2
                or activity.is_worker_shutdown()
            ):
                break
        if result.claimed < s.batch_size * result.claims:
            lease_end = started + s.lease_seconds - LEASE_MARGIN_SECONDS
            summary = await with_database("pending_summary", lease_end, lambda: self.pool.fetchrow(SQL.pending_summary))
            assert summary is not None
            result = result.model_copy(update=dict(summary))
        activity.logger.info(
            "relay %s batch: %d claims, claimed %d, delivered %d, retry %d, dead %d, fenced %d",
            input.relay_id,
            result.claims,
            result.claimed,
            result.delivered,
            result.retried,
            result.dead,
            result.fenced,
        )
        return result

    async def _relay_claim(
        self, relay_id: str, attempt: str, s: RelayBatchSettings, started: float, progress: dict[str, int]
    ) -> RelayBatchResult:
        """One claim: up to `batch_size` due events under a lease, sent, their outcomes recorded."""
        lease_end = started + s.lease_seconds - LEASE_MARGIN_SECONDS
        owner, rows = await self._claim(relay_id, attempt, s, lease_end)
        if not rows:
            return RelayBatchResult()
        progress["claimed"] = progress.get("claimed", 0) + len(rows)
        activity.heartbeat(dict(progress))
        outcomes = await self._send_all(rows, s, send_until=lease_end, progress=progress)
        failpoints.hit(f"{RELAY_OUTBOX_BATCH}.after_send")
        # A lost connection here (the database restarted, our backend was terminated) must not leave
        # the rows leased until the lease ends: the outcomes are ours to record (fenced by `owner`)
        # as soon as the database is back; running the statement twice is harmless.
        args = record_arguments(owner, [r["event_id"] for r in rows], outcomes)
        recorded = await with_database(
            "record_outcomes", started + s.lease_seconds, lambda: self.pool.fetchrow(SQL.record_outcomes, *args)
        )
        failpoints.hit(f"{RELAY_OUTBOX_BATCH}.after_commit")
        assert recorded is not None
        result = RelayBatchResult(claimed=len(rows), **dict(recorded))
        metrics.record_outbox(result.delivered, result.dead)
        if result.dead:  # else no dead letter was recorded: nothing to log
            for r in rows:
                if outcomes[r["event_id"]].kind == "dead":
                    activity.logger.warning("outbox event %s dead-lettered: %s", *dead_letter_log_args(r, outcomes))
        return result

    async def _claim(
        self, relay_id: str, attempt: str, s: RelayBatchSettings, until: float
    ) -> tuple[str, list[asyncpg.Record]]:
        """Claim under a fresh owner. If the connection is lost under the claim, it may have committed:
        once the database is back, release what that owner holds and claim again under a new one."""
        while True:
            # Unique per claim: the fencing token for recording outcomes, readable in `outbox status`.
            owner = f"{relay_id}/{attempt}/{uuid.uuid4().hex[:8]}"
            try:
                claim = SQL.bind(
                    "claim_batch", lease_owner=owner, batch_size=s.batch_size, lease_seconds=s.lease_seconds
                )
                return owner, await self.pool.fetch(SQL.claim_batch, *claim)
            except Exception as err:
                if not db.connection_lost(err) or time.monotonic() >= until:
                    raise
                OUTAGE.lost(err)
                log.info("relay %s: database connection lost during the claim; releasing it", relay_id)
            await with_database("release_lease", until, functools.partial(self.pool.fetchrow, SQL.release_lease, owner))

    async def _send_all(
        self, rows: list[asyncpg.Record], s: RelayBatchSettings, send_until: float, progress: dict[str, int]
    ) -> dict[int, Outcome]:
        """Send with at most `concurrency` requests in flight, over the instance's pooled connections:
        one request per event, or (batch_max > 1) per `batch_max` events to the batch endpoint.

        Once the worker shuts down gracefully (SIGTERM, a deploy), no new request starts: the requests
        in flight finish, and the rows not sent are released (due at once, not a failure) when the
        outcomes are recorded, so another worker's relay sends them without waiting for the lease."""
        ordered = sorted(rows, key=lambda r: int(r["event_id"]))  # oldest first (RETURNING has no order)
        size = max(self.batch_max, 1)
        queue: asyncio.Queue[list[asyncpg.Record]] = asyncio.Queue()
        for i in range(0, len(ordered), size):
            queue.put_nowait(ordered[i : i + size])
        outcomes: dict[int, Outcome] = {}
        client = self._client()
        sent_before = progress.get("sent", 0)  # by the activity's earlier claims

        async def sender() -> None:
            while not queue.empty():
                chunk = queue.get_nowait()
                unsent = self._not_sent(s, send_until)
                if unsent is not None:
                    outcomes.update((row["event_id"], unsent) for row in chunk)
                elif size == 1:
                    outcomes[chunk[0]["event_id"]] = await self._send_one(client, chunk[0], s)
                else:
                    outcomes.update(await self._send_batch(client, chunk, s))
                progress["sent"] = sent_before + len(outcomes)
                activity.heartbeat(dict(progress))

        await asyncio.gather(*(sender() for _ in range(min(s.concurrency, queue.qsize()))))
        return outcomes

    @staticmethod
    def _not_sent(s: RelayBatchSettings, send_until: float) -> Outcome | None:
        """Why no request may start now (released unsent, due at once, not a failure), or None."""
        if time.monotonic() + s.request_timeout_seconds > send_until:
            return Outcome("retry", None, 0.0, NOT_SENT_LEASE_SHORT)  # no time left to record an answer
        if activity.is_worker_shutdown():
            return Outcome("retry", None, 0.0, NOT_SENT_SHUTDOWN)
        return None

    def _headers(self, key: str | None = None) -> dict[str, str]:
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        if key is not None:
            headers["Idempotency-Key"] = key
        return safe_headers(headers)

    async def _send_one(self, client: httpx.AsyncClient, row: asyncpg.Record, s: RelayBatchSettings) -> Outcome:
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
        answer = await self._request(client, SEND_PATH, body, self._headers(row["event_key"]), s)
        return self._outcome(row, answer, s)

    async def _send_batch(
        self, client: httpx.AsyncClient, rows: list[asyncpg.Record], s: RelayBatchSettings
    ) -> dict[int, Outcome]:
        """One request to the batch endpoint; each event's outcome from its own result in the answer,
        judged by the same policy as a single send (so one event's 422 is its dead letter alone)."""
        outcomes: dict[int, Outcome] = {}
        valid = []
        for row in rows:
            if _HEADER_SAFE.match(row["event_key"]):
                valid.append(row)
            else:  # the same rule as a single send's header: the provider keys on it
                outcomes[row["event_id"]] = Outcome(
                    "dead", None, 0.0, "event key is not a valid Idempotency-Key (printable ASCII only)"
                )
        if not valid:
            return outcomes
        body = ('{"messages": [' + ", ".join(message_json(r) for r in valid) + "]}").encode()
        limit = MAX_RESPONSE_BYTES + BATCH_RESPONSE_BYTES_PER_EVENT * len(valid)
        answered = await self._request(client, SEND_BATCH_PATH, body, self._headers(), s, limit)
        each = batch_event_answers(*answered, [r["event_key"] for r in valid])
        for row in valid:
            outcomes[row["event_id"]] = self._outcome(row, each[row["event_key"]], s)
        return outcomes

    async def _request(
        self,
        client: httpx.AsyncClient,
        path: str,
        body: bytes,
        headers: dict[str, str],
        s: RelayBatchSettings,
        limit: int = MAX_RESPONSE_BYTES,
    ) -> EventAnswer:
        """POST, bounded by the request timeout: the answer, or why there is none (text, failure kind)."""
        try:
            # httpx's timeout bounds each phase (connect, write, each read); this bounds the whole request.
            async with asyncio.timeout(s.request_timeout_seconds):
                return await self._post(client, path, body, headers, s.request_timeout_seconds, limit), None, None
        except (TimeoutError, httpx.TimeoutException):
            return None, f"timeout: no answer within {s.request_timeout_seconds:g}s", FAILURE_TIMEOUT
        except httpx.HTTPError as err:  # connection refused/reset, broken answer, ...: never the headers
            return None, f"connection error: {type(err).__name__}: {err}", FAILURE_CONNECTION

    def _outcome(self, row: asyncpg.Record, answered: EventAnswer, s: RelayBatchSettings) -> Outcome:
        """The retry policy applied to one event's answer, with the token redacted from its error."""
        answer, failure, failure_kind = answered
        if answer is not None and 200 <= answer.status < 300:
            return Outcome("delivered", answer.status)  # what classify says, without reading past failures
        counted = row["failure_counts"]
        failures = json.loads(counted) if isinstance(counted, str) else dict(counted or {})
        outcome = classify(answer, failure, row["attempts"], s, failures=failures, failure_kind=failure_kind)
        if outcome.error is not None:
            outcome = Outcome(
                outcome.kind,
                outcome.http_status,
                outcome.delay_seconds,
                redact(outcome.error, self._token)[: ERROR_TEXT_LIMIT + 200],
                outcome.failure_kind,
            )
        return outcome

    @staticmethod
    async def _post(
        client: httpx.AsyncClient,
        path: str,
        body: bytes,
        headers: dict[str, str],
        phase_timeout: float,
        limit: int = MAX_RESPONSE_BYTES,
    ) -> ProviderAnswer:
        async with client.stream("POST", path, content=body, headers=headers, timeout=phase_timeout) as response:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) >= limit:
                    break
            headers = {k.lower(): v for k, v in response.headers.items()}
            return ProviderAnswer(response.status_code, headers, bytes(data))
