"""A small local mail provider: a real HTTP/1.1 server for the demo and the tests.

    python -m demo.mail_provider --port 8025            # token from $MAIL_PROVIDER_TOKEN
    python -m demo.mail_provider --port 8025 --share-5xx 0.1 --share-429 0.05 --seed 7

Endpoints:
  POST /v1/messages   send one message. Needs `Authorization: Bearer <token>` and an
                      `Idempotency-Key`. A key seen before is acknowledged (200, "duplicate") but not
                      delivered to the customer again. 202 "accepted" for a first delivery; 422 for a
                      bad event (no template for its kind, no account); 401 for a wrong token.
  POST /v1/messages/batch
                      send up to 1,000 messages: {"messages": [{"idempotency_key": K, ...}, ...]}.
                      200 with one result per message, in order: {"results": [{"idempotency_key": K,
                      "status": 202|200|422|429|503|..., "error"?, "retry_after"?}]}: each message is
                      judged as a single send would be (dedup by its key, its own faults). The whole
                      request may be refused instead (401, 400, 413, or a scripted batch fault such
                      as 429 with a Retry-After header); a timeout among its messages delivers them
                      all and never answers.
  GET  /stats         what it received: requests, unique keys, customer deliveries, duplicates by key,
                      responses by status, injected faults.
  GET  /messages      the customer's mailbox, newest last (`?limit=N`).
  POST /admin/faults  (bearer token) change the fault shares, or script faults for given keys:
                      {"share_429": 0.1, "keys": {"KEY": {"status": 503, "times": 2}}}
  POST /admin/reset   (bearer token) forget everything received.

Faults, drawn from a seeded RNG for a configurable share of send requests (or scripted per key):
  429 with Retry-After, 5xx (503), 4xx (422), or a timeout. A timeout delivers the message and then
  never answers (the worst case for a sender: it must resend, and the key deduplicates it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from core.config import ConfigError, OutboxSettings, read

log = logging.getLogger("mail_provider")

TEMPLATES = frozenset({"renewal_reminder"})
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
# Messages one batch request may carry (a larger batch is refused whole with 413).
BATCH_MAX_MESSAGES = 1000
REASONS = {
    200: "OK",
    202: "Accepted",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    409: "Conflict",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class ScriptedFault:
    """Answer `status` (None: time out) to the next `times` sends of one key (-1: always)."""

    status: int | None
    times: int = 1
    retry_after: str | None = None
    body: str | None = None


@dataclass
class FaultShares:
    """The share of sends answered with each fault, drawn from the provider's seeded RNG; a timeout
    delivers and then hangs `hang_seconds` without an answer."""

    share_429: float = 0.0
    share_5xx: float = 0.0
    share_4xx: float = 0.0
    share_timeout: float = 0.0
    retry_after: str = "1"
    hang_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("share_429", "share_5xx", "share_4xx", "share_timeout"):
            if not 0.0 <= getattr(self, name) <= 1.0:  # NaN fails this too
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        if not 0.0 <= self.hang_seconds <= 3600.0:
            raise ValueError(f"hang_seconds must be between 0 and 3600, got {self.hang_seconds}")


@dataclass
class _Response:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False
    # The idempotency keys this answer covers (a held key holds the whole answer).
    keys: tuple[str, ...] = ()


class MailProvider:
    """The provider's state and request handling; serve it with `start()` or `ProviderThread`."""

    def __init__(
        self,
        token: str,
        faults: FaultShares | None = None,
        *,
        seed: int = 0,
        conflict_while_processing: bool = False,
    ) -> None:
        if not token:
            raise ValueError("the mail provider needs a bearer token")
        self._token = token
        self.shares = faults or FaultShares()
        self._rng = random.Random(seed)
        # Like providers that answer 409 to a key whose first request is still being processed.
        self.conflict_while_processing = conflict_while_processing
        self._lock = threading.Lock()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port: int | None = None
        self.reset()

    # -- state -------------------------------------------------------------------------------------

    def reset(self) -> None:
        with self._lock:
            self.scripted: dict[str, ScriptedFault] = {}
            # Faults for whole batch requests, the next one first (`script_batch`).
            self.batch_faults: list[ScriptedFault] = []
            self.batch_requests = 0
            self.batch_messages = 0
            self.batch_results: Counter[int] = Counter()  # each message's status inside batch answers
            self.received = 0
            self.received_by_key: Counter[str] = Counter()
            self.first_received_at: dict[str, float] = {}
            self.request_times: dict[str, list[float]] = {}
            self.mailbox: list[dict[str, Any]] = []
            self.delivered_keys: dict[str, str] = {}
            self.duplicates_by_key: Counter[str] = Counter()
            self.responses: Counter[int] = Counter()
            self.faults: Counter[str] = Counter()
            self.unauthorized = 0
            self.held: dict[str, threading.Event] = {}
            self.processing_until: dict[str, float] = {}

    def script(self, key: str, fault: ScriptedFault) -> None:
        with self._lock:
            self.scripted[key] = fault

    def script_batch(self, fault: ScriptedFault) -> None:
        """Answer the next `fault.times` batch requests as a whole with `fault` (before any message is judged)."""
        with self._lock:
            self.batch_faults.append(fault)

    def hold(self, key: str) -> None:
        """Hold the answers to sends of this key (taken, answered only after `release`, at most 120 s)."""
        with self._lock:
            self.held.setdefault(key, threading.Event())

    def release(self, key: str) -> None:
        with self._lock:
            gate = self.held.pop(key, None)
        if gate is not None:
            gate.set()

    def configure(self, **shares: Any) -> None:
        """Change some fault settings at once; a bad one changes none."""
        with self._lock:
            unknown = set(shares) - {f.name for f in fields(FaultShares)}
            if unknown:
                raise ValueError(f"unknown fault setting(s) {sorted(unknown)}")
            converted = {name: type(getattr(self.shares, name))(value) for name, value in shares.items()}
            self.shares = replace(self.shares, **converted)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "received": self.received,
                "batch_requests": self.batch_requests,
                "batch_messages": self.batch_messages,
                "batch_results": {str(k): v for k, v in sorted(self.batch_results.items())},
                "unauthorized": self.unauthorized,
                "unique_keys": len(self.received_by_key),
                "delivered": len(self.mailbox),
                "duplicates": sum(self.duplicates_by_key.values()),
                "duplicates_by_key": dict(self.duplicates_by_key),
                "responses": {str(k): v for k, v in sorted(self.responses.items())},
                "faults": dict(self.faults),
            }

    def messages(self, limit: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.mailbox[-limit:] if limit else self.mailbox)

    def times_for(self, key: str) -> list[float]:
        """Wall-clock times (time.time()) of every send request for this key."""
        with self._lock:
            return list(self.request_times.get(key, []))

    # -- handling ----------------------------------------------------------------------------------

    def _authorized(self, headers: dict[str, str]) -> bool:
        given = headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode())

    def _pick_fault(self, key: str) -> ScriptedFault | None:
        scripted = self.scripted.get(key)
        if scripted is not None and scripted.times != 0:
            scripted.times -= 1 if scripted.times > 0 else 0
            return scripted
        s = self.shares
        r = self._rng.random()
        for share, fault in (
            (s.share_429, ScriptedFault(429, retry_after=s.retry_after)),
            (s.share_5xx, ScriptedFault(503)),
            (s.share_4xx, ScriptedFault(422, body="rejected: recipient refused (fault injection)")),
            (s.share_timeout, ScriptedFault(None)),
        ):
            if r < share:
                return fault
            r -= share
        return None

    def _deliver(self, key: str, message: dict[str, Any]) -> _Response:
        """Called with the lock held: dedup by key, else put the message in the customer's mailbox."""
        kind, account_id = message.get("kind"), message.get("account_id")
        if kind not in TEMPLATES:
            return _Response(422, {"error": f"no template for kind {kind!r}"})
        if not isinstance(account_id, str) or not account_id:
            return _Response(422, {"error": "message has no account_id"})
        if key in self.delivered_keys:
            self.duplicates_by_key[key] += 1
            return _Response(200, {"status": "duplicate", "message_id": self.delivered_keys[key]})
        message_id = f"msg_{len(self.mailbox) + 1}"
        self.delivered_keys[key] = message_id
        self.mailbox.append(
            {
                "message_id": message_id,
                "idempotency_key": key,
                "kind": kind,
                "account_id": account_id,
                "delivered_at": time.time(),
            }
        )
        return _Response(202, {"status": "accepted", "message_id": message_id})

    def _send(self, headers: dict[str, str], body: bytes) -> _Response:
        with self._lock:
            if not self._authorized(headers):
                self.unauthorized += 1
                return _Response(401, {"error": "unauthorized: bad or missing bearer token"})
            key = headers.get("idempotency-key", "").strip()
            if not key:
                return _Response(400, {"error": "missing Idempotency-Key header"})
            now = time.time()
            self._count(key, now)
            try:
                message = json.loads(body or b"null")
            except ValueError:
                return _Response(400, {"error": "body is not JSON"})
            if not isinstance(message, dict):
                return _Response(400, {"error": "body must be a JSON object"})
            return self._judge(key, message, now)

    def _count(self, key: str, now: float) -> None:
        self.received += 1
        self.received_by_key[key] += 1
        self.request_times.setdefault(key, []).append(now)

    def _judge(self, key: str, message: dict[str, Any], now: float) -> _Response:
        """Called with the lock held: one message's answer (a send, or one entry of a batch)."""
        if self.processing_until.get(key, 0.0) > now:
            return _Response(409, {"error": "a request with this Idempotency-Key is still in progress"})
        fault = self._pick_fault(key)
        if fault is None:
            return self._deliver(key, message)
        if fault.status is None:
            self.faults["timeout"] += 1
            response = self._deliver(key, message)
            response.hang = True
            if self.conflict_while_processing:
                self.processing_until[key] = now + self.shares.hang_seconds
            return response
        self.faults[str(fault.status)] += 1
        headers_out = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
        return _Response(fault.status, {"error": fault.body or REASONS.get(fault.status, "error")}, headers_out)

    def _send_batch(self, headers: dict[str, str], body: bytes) -> _Response:
        """Each message judged as its own send would be, under its own key; or the whole request refused."""
        with self._lock:
            if not self._authorized(headers):
                self.unauthorized += 1
                return _Response(401, {"error": "unauthorized: bad or missing bearer token"})
            try:
                messages = json.loads(body or b"null")["messages"]
            except (ValueError, TypeError, KeyError):
                return _Response(400, {"error": 'body must be a JSON object {"messages": [...]}'})
            if not isinstance(messages, list) or not messages:
                return _Response(400, {"error": "messages must be a non-empty list"})
            if len(messages) > BATCH_MAX_MESSAGES:
                return _Response(413, {"error": f"at most {BATCH_MAX_MESSAGES} messages per batch"})
            self.batch_requests += 1
            whole = self._batch_fault()
            if whole is not None:
                self.faults[f"batch {whole.status}"] += 1
                retry = {"Retry-After": whole.retry_after} if whole.retry_after is not None else {}
                return _Response(whole.status or 503, {"error": whole.body or "batch refused"}, retry)
            now = time.time()
            results: list[dict[str, Any]] = []
            hang = False
            for message in messages:
                key = message.get("idempotency_key") if isinstance(message, dict) else None
                if not isinstance(key, str) or not key.strip():
                    results.append({"idempotency_key": key, "status": 400, "error": "missing idempotency_key"})
                    continue
                self.batch_messages += 1
                self._count(key, now)
                answer = self._judge(key, message, now)
                hang = hang or answer.hang
                self.batch_results[answer.status] += 1
                results.append(self._result(key, answer))
            keys = tuple(str(r["idempotency_key"]) for r in results)
            return _Response(200, {"results": results}, hang=hang, keys=keys)

    @staticmethod
    def _result(key: str, answer: _Response) -> dict[str, Any]:
        """One message's entry in a batch answer: `status` is the HTTP status its single send would
        have had, `result` that answer's status word, `retry_after` its Retry-After."""
        fields_out = dict(answer.body)
        word = fields_out.pop("status", None)
        entry = {"idempotency_key": key, "status": answer.status, **fields_out}
        if word is not None:
            entry["result"] = word
        if "Retry-After" in answer.headers:
            entry["retry_after"] = answer.headers["Retry-After"]
        return entry

    def _batch_fault(self) -> ScriptedFault | None:
        """Called with the lock held: the scripted fault for this whole batch request, if any."""
        while self.batch_faults and self.batch_faults[0].times == 0:
            self.batch_faults.pop(0)
        if not self.batch_faults:
            return None
        fault = self.batch_faults[0]
        fault.times -= 1 if fault.times > 0 else 0
        return fault

    def _admin(self, path: str, headers: dict[str, str], body: bytes) -> _Response:
        if not self._authorized(headers):
            with self._lock:
                self.unauthorized += 1
            return _Response(401, {"error": "unauthorized"})
        if path == "/admin/reset":
            self.reset()
            return _Response(200, {"status": "reset"})
        try:
            data = json.loads(body or b"{}")
            keys = data.pop("keys", {})
            self.configure(**data)
            for key, spec in keys.items():
                self.script(key, ScriptedFault(**spec))
        except (ValueError, TypeError) as err:
            return _Response(400, {"error": f"bad fault settings: {err}"})
        return _Response(200, {"status": "configured"})

    def _route(self, method: str, target: str, headers: dict[str, str], body: bytes) -> _Response:
        url = urlsplit(target)
        if url.path == "/v1/messages":
            return self._send(headers, body) if method == "POST" else _Response(405, {"error": "use POST"})
        if url.path == "/v1/messages/batch":
            return self._send_batch(headers, body) if method == "POST" else _Response(405, {"error": "use POST"})
        if url.path == "/stats" and method == "GET":
            return _Response(200, self.stats())
        if url.path == "/messages" and method == "GET":
            limit = parse_qs(url.query).get("limit", ["0"])[0]
            return _Response(200, {"messages": self.messages(int(limit) if limit.isdigit() else None)})
        if url.path in ("/admin/faults", "/admin/reset") and method == "POST":
            return self._admin(url.path, headers, body)
        return _Response(404, {"error": f"no route {method} {url.path}"})

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:  # keep-alive: requests one after another on the same connection
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = [*lines[0].split(" ", 2), "", ""][:3]
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY_BYTES:
                    response = _Response(413, {"error": "body too large"})
                    body = b""
                else:
                    body = await reader.readexactly(length) if length else b""
                    response = self._route(method, target, headers, body)
                with self._lock:
                    self.responses[response.status] += 1
                with self._lock:
                    keys = (headers.get("idempotency-key", "").strip(), *response.keys)
                    gates = [self.held[k] for k in keys if k in self.held] if self.held else []
                for gate in gates:
                    await asyncio.to_thread(gate.wait, 120)
                if response.hang:
                    await asyncio.sleep(self.shares.hang_seconds)
                    return  # never answer; the connection closes
                payload = json.dumps(response.body).encode()
                close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
                out = [
                    f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}",
                    "Content-Type: application/json",
                    f"Content-Length: {len(payload)}",
                    f"Connection: {'close' if close else 'keep-alive'}",
                    *(f"{k}: {v}" for k, v in response.headers.items()),
                ]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + payload)
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            return  # the server is stopping; end this connection quietly
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self._server

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class ProviderThread:
    """Runs a MailProvider on its own event loop in a daemon thread (tests, demo)."""

    def __init__(self, provider: MailProvider, host: str = "127.0.0.1", port: int = 0) -> None:
        self.provider = provider
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="mail-provider", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.provider.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stopped = asyncio.Event()
            try:
                await self.provider.start(self.host, self.port)
            except BaseException as err:
                self._error = err
                self._ready.set()
                return
            self._ready.set()
            await self._stopped.wait()
            await self.provider.stop()

        self._loop.run_until_complete(main())
        self._loop.close()

    def __enter__(self) -> ProviderThread:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the mail provider did not start listening within 60 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._stopped is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m demo.mail_provider",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8025)
    for share in ("429", "5xx", "4xx", "timeout"):
        parser.add_argument(f"--share-{share}", type=float, default=0.0, help="share of sends, 0 to 1")
    parser.add_argument("--retry-after", default="1", help="Retry-After sent with a 429 (seconds)")
    parser.add_argument("--hang-seconds", type=float, default=30.0, help="how long a timeout hangs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # The token comes from the environment (or MAIL_PROVIDER_TOKEN_FILE) only: an argument shows up in `ps`.
    try:
        secret = read(OutboxSettings).provider_token
    except ConfigError as err:
        parser.error(str(err))
    token = secret.get_secret_value() if secret else ""
    if not token:
        parser.error("set MAIL_PROVIDER_TOKEN (the bearer token the provider accepts)")
    try:
        faults = FaultShares(**{f.name: getattr(args, f.name) for f in fields(FaultShares)})
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    provider = MailProvider(token, faults, seed=args.seed)

    async def serve() -> None:
        server = await provider.start(args.host, args.port)
        log.info("mail provider listening on http://%s:%s (GET /stats)", args.host, provider.port)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
