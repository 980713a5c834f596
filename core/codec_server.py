"""A codec endpoint, so authorised operators can read encrypted payloads in the Temporal UI and CLI.

    PAYLOAD_ENCRYPTION_KEY=... CODEC_SERVER_TOKEN=... python -m core.codec_server --port 8081

Implements Temporal's remote codec protocol: `POST <prefix>/encode` and `POST <prefix>/decode` with
a JSON body `{"payloads": [{"metadata": {...base64...}, "data": "base64"}]}` (protobuf JSON of
`temporal.api.common.v1.Payloads`), answering the same shape. CORS lets the UI (an allowed origin)
call it from the browser. With a token configured every request must carry
`Authorization: Bearer <token>`; compare `temporal workflow show --codec-endpoint URL
--codec-auth "Bearer TOKEN"`. In the UI: Settings > Codec Server > endpoint URL (and "pass the
access token" when the UI's own login issues the token). See docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads
from temporalio.converter import PayloadCodec

from core import logs
from core.cli import bounded_int, finite_float
from core.codec import EncryptionCodec, EncryptionKeyError
from core.config import ConfigError, Settings

log = logging.getLogger("codec_server")
MAX_BODY = 8 * 1024 * 1024
DEFAULT_ORIGINS = ("http://127.0.0.1:8233", "http://localhost:8233", "http://localhost:8080")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# A client gets this long for each read and write; one that stalls is disconnected, not waited for.
REQUEST_TIMEOUT_SECONDS = 10.0
# Requests handled at once; beyond it a connection is answered 503 at once, never queued on a thread.
MAX_THREADS = 32


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class CodecServer(ThreadingHTTPServer):
    """Refuses to listen beyond loopback without a bearer token. Only requests whose Host header
    names an allowed host are served (a DNS-rebinding page cannot reach a loopback endpoint)."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        codec: PayloadCodec,
        *,
        token: str | None = None,
        allowed_origins: Sequence[str] = DEFAULT_ORIGINS,
        allowed_hosts: Sequence[str] = (),
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        max_threads: int = MAX_THREADS,
    ) -> None:
        if not token and not is_loopback(address[0]):
            raise ValueError(f"the codec server listens on {address[0]} only with a bearer token (CODEC_SERVER_TOKEN)")
        super().__init__(address, CodecHandler)
        self.codec = codec
        self.token = token
        self.allowed_origins = set(allowed_origins)
        bound = [] if address[0] in ("", "0.0.0.0", "::") else [address[0]]
        self.allowed_hosts = {h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *bound, *allowed_hosts)}
        self.request_timeout = request_timeout
        self._slots = threading.BoundedSemaphore(max_threads)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request (a closed socket, a timeout) is logged in one line;
        anything else keeps the standard traceback."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            log.info("client %s went away: %s", client_address, err)
            return
        super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(BUSY_RESPONSE)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


BUSY_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class CodecHandler(BaseHTTPRequestHandler):
    server: CodecServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout)  # every read and write

    def log_message(self, format: str, *args: Any) -> None:  # no request lines with headers in them
        log.debug("%s %s", self.command, self.path.split("?")[0])

    def _cors(self) -> None:
        origin = self.headers.get("Origin")
        if not origin:
            return
        if origin in self.server.allowed_origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")
            self.send_header("Vary", "Origin")
        elif "*" in self.server.allowed_origins:  # any origin, but never with credentials
            self.send_header("Access-Control-Allow-Origin", "*")

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self._cors()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _host_allowed(self) -> bool:
        host = (self.headers.get("Host") or "").strip().lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return bool(name) and name.strip("[]") in self.server.allowed_hosts

    def do_OPTIONS(self) -> None:
        if not self._host_allowed():
            self._reply(400, {"error": "Host not allowed"})
            return
        self.send_response(204)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Content-Type, X-Namespace, Authorization")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _authorised(self) -> bool:
        if not self.server.token:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode())

    def _body_length(self) -> int | str:
        """The declared body length, or why the request is refused (no length, a bad one, chunked)."""
        if self.headers.get("Transfer-Encoding"):
            return "chunked or encoded bodies are not accepted: send Content-Length"
        raw = (self.headers.get("Content-Length") or "").strip()
        if not raw.isdigit():  # missing, negative, or not a number
            return "Content-Length must be a non-negative whole number"
        return int(raw)

    def do_POST(self) -> None:
        if not self._host_allowed():
            self._reply(400, {"error": "Host not allowed"})
            return
        action = self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
        if action not in ("encode", "decode"):
            self._reply(404, {"error": "POST /encode or /decode"})
            return
        if not self._authorised():
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        length = self._body_length()
        if isinstance(length, str):
            self._reply(400, {"error": length})
            return
        if length > MAX_BODY:
            self._reply(413, {"error": "body too large"})
            return
        try:
            payloads = json_format.Parse(self.rfile.read(length), Payloads())
            codec = self.server.codec
            fn = codec.encode if action == "encode" else codec.decode
            out = asyncio.run(fn(list(payloads.payloads)))
        except Exception as err:  # never echo payload bytes or key material
            log.warning("%s failed: %s", action, type(err).__name__)
            self._reply(400, {"error": f"{action} failed: {type(err).__name__}"})
            return
        self._reply(200, json_format.MessageToDict(Payloads(payloads=out)))


def main(argv: list[str] | None = None) -> int:
    """`python -m core.codec_server`: serve until interrupted (exit 0); exit 2 on bad configuration
    (no key, no token beyond loopback, a bad key)."""
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env(log_format=args.log_format)
    except ConfigError as err:
        logs.configure("text")
        log.error("bad configuration: %s", err)
        return 2
    logs.configure(settings.log_format, secrets=settings.secrets())
    configured = _codec_and_token(settings, args.host)
    if configured is None:
        return 2
    codec, token = configured
    server = CodecServer(
        (args.host, args.port),
        codec,
        token=token,
        allowed_origins=args.allow_origin or DEFAULT_ORIGINS,
        allowed_hosts=args.allow_host,
        request_timeout=args.timeout,
        max_threads=args.max_threads,
    )
    log.info("codec endpoint on %s (bearer token %s)", server.url, "required" if token else "NOT required")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The codec server's options (its keys and token come from the environment only)."""
    parser = argparse.ArgumentParser(prog="python -m core.codec_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback: token required)")
    parser.add_argument("--port", type=bounded_int(1, 65535), default=8081, help="port to listen on (default 8081)")
    parser.add_argument(
        "--allow-origin",
        action="append",
        help=f"a UI origin allowed by CORS (repeatable; '*' for any, then without credentials; "
        f"default {', '.join(DEFAULT_ORIGINS)})",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="a host name clients reach this server by (repeatable; loopback names are always allowed)",
    )
    parser.add_argument(
        "--max-threads", type=bounded_int(1, 1024), default=MAX_THREADS, help="requests handled at once"
    )
    parser.add_argument(
        "--timeout",
        type=finite_float(0.1, 600),
        default=REQUEST_TIMEOUT_SECONDS,
        help="seconds a client may take per read or write",
    )
    parser.add_argument("--log-format", choices=["text", "json"], help="default: $LOG_FORMAT or text")
    return parser


def _codec_and_token(settings: Settings, host: str) -> tuple[EncryptionCodec, str | None] | None:
    """The codec of the configured keys and the bearer token; None (logged) without a key, without a
    token on a host beyond loopback, or with a bad key."""
    key, older, token = (
        s.get_secret_value() if s else None
        for s in (settings.payload_encryption_key, settings.payload_decryption_keys, settings.codec_server_token)
    )
    if not key:
        log.error("PAYLOAD_ENCRYPTION_KEY is not set")
        return None
    if not token and not is_loopback(host):
        log.error("CODEC_SERVER_TOKEN is not set: without a token the codec server listens on loopback only")
        return None
    try:
        codec = EncryptionCodec.from_config(
            key,
            settings.payload_encryption_key_id,
            decryption_keys=older,
            require_encryption=settings.payload_require_encryption,
        )
    except EncryptionKeyError as err:
        log.error("%s", err)
        return None
    return codec, token


if __name__ == "__main__":
    sys.exit(main())
