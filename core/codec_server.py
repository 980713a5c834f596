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
import hmac
import json
import logging
import os
import sys
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads
from temporalio.converter import PayloadCodec

from core import logs
from core.cli import bounded_int
from core.codec import EncryptionCodec, EncryptionKeyError

log = logging.getLogger("codec_server")
MAX_BODY = 8 * 1024 * 1024
DEFAULT_ORIGINS = ("http://127.0.0.1:8233", "http://localhost:8233", "http://localhost:8080")


class CodecServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        codec: PayloadCodec,
        *,
        token: str | None = None,
        allowed_origins: Sequence[str] = DEFAULT_ORIGINS,
    ) -> None:
        super().__init__(address, CodecHandler)
        self.codec = codec
        self.token = token
        self.allowed_origins = set(allowed_origins)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class CodecHandler(BaseHTTPRequestHandler):
    server: CodecServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # no request lines with headers in them
        log.debug("%s %s", self.command, self.path.split("?")[0])

    def _cors(self) -> None:
        origin = self.headers.get("Origin")
        if origin and ("*" in self.server.allowed_origins or origin in self.server.allowed_origins):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")
            self.send_header("Vary", "Origin")

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self._cors()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_OPTIONS(self) -> None:
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

    def do_POST(self) -> None:
        action = self.path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
        if action not in ("encode", "decode"):
            self._reply(404, {"error": "POST /encode or /decode"})
            return
        if not self._authorised():
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        length = int(self.headers.get("Content-Length") or 0)
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
    parser = argparse.ArgumentParser(prog="python -m core.codec_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=bounded_int(1, 65535), default=8081, help="port to listen on (default 8081)")
    parser.add_argument(
        "--allow-origin",
        action="append",
        help=f"a UI origin allowed by CORS (repeatable; '*' for any; default {', '.join(DEFAULT_ORIGINS)})",
    )
    parser.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("LOG_FORMAT") or "text")
    args = parser.parse_args(argv)
    key = os.environ.get("PAYLOAD_ENCRYPTION_KEY")
    token = os.environ.get("CODEC_SERVER_TOKEN") or None
    logs.configure(args.log_format, secrets=[s for s in (key, token) if s])
    if not key:
        log.error("PAYLOAD_ENCRYPTION_KEY is not set")
        return 2
    try:
        codec = EncryptionCodec.from_key(key, os.environ.get("PAYLOAD_ENCRYPTION_KEY_ID") or "default")
    except EncryptionKeyError as err:
        log.error("%s", err)
        return 2
    server = CodecServer(
        (args.host, args.port), codec, token=token, allowed_origins=args.allow_origin or DEFAULT_ORIGINS
    )
    log.info("codec endpoint on %s (bearer token %s)", server.url, "required" if token else "NOT required")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
