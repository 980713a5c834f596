"""A minimal asyncio HTTP/1.1 client (standard library only) for the outbox relay.

One `HttpConnection` is one keep-alive connection used by one sender at a time; the relay runs a
bounded number of them per batch. Only what the relay needs: POST/GET with a body, Content-Length
or chunked responses, http and https. Exceptions never carry request headers (the bearer token).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

MAX_RESPONSE_BYTES = 1024 * 1024


class HttpError(Exception):
    """The connection broke or the answer was not HTTP; the message names no header values."""


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def text(self, limit: int = 1000) -> str:
        return self.body[:limit].decode("utf-8", errors="replace")


def parse_base_url(url: str) -> SplitResult:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.username or parts.password:
        raise ValueError("put credentials in the token setting, not in the provider URL")
    return parts


class HttpConnection:
    def __init__(self, base: SplitResult) -> None:
        self.base = base
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @property
    def host_header(self) -> str:
        return self.base.netloc

    async def _open(self) -> None:
        https = self.base.scheme == "https"
        port = self.base.port or (443 if https else 80)
        assert self.base.hostname is not None
        self._reader, self._writer = await asyncio.open_connection(
            self.base.hostname,
            port,
            ssl=ssl.create_default_context() if https else None,
            server_hostname=self.base.hostname if https else None,
            limit=64 * 1024,
        )

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes, time_limit: float
    ) -> HttpResponse:
        """Send one request; on any failure the connection is closed and HttpError/TimeoutError raised."""
        try:
            async with asyncio.timeout(time_limit):
                reused = self._writer is not None
                try:
                    return await self._exchange(method, path, headers, body)
                except HttpError:
                    if not reused:
                        raise
                    # A kept-alive connection the server closed while idle: once more on a fresh one.
                    await self.close()
                    return await self._exchange(method, path, headers, body)
        except BaseException:
            await self.close()
            raise

    async def _exchange(self, method: str, path: str, headers: dict[str, str], body: bytes) -> HttpResponse:
        if self._writer is None:
            try:
                await self._open()
            except OSError as err:
                raise HttpError(f"cannot connect to {self.host_header}: {err.strerror or err}") from None
        assert self._reader is not None and self._writer is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host_header}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        try:
            self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await self._writer.drain()
            head = await self._reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
            raise HttpError(f"connection to {self.host_header} broke: {type(err).__name__}") from None
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            raise HttpError(f"not an HTTP answer from {self.host_header}") from None
        response_headers: dict[str, str] = {}
        for line in header_lines:
            if ":" in line:
                name, _, value = line.partition(":")
                response_headers[name.strip().lower()] = value.strip()
        try:
            data = await self._read_body(response_headers)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as err:
            raise HttpError(f"broken answer from {self.host_header}: {type(err).__name__}") from None
        if response_headers.get("connection", "").lower() == "close":
            await self.close()
        return HttpResponse(status, response_headers, data)

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        assert self._reader is not None
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            total = 0
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    await self._reader.readuntil(b"\r\n")
                    return b"".join(chunks)
                total += size
                if total > MAX_RESPONSE_BYTES:
                    raise ValueError("response too large")
                chunks.append(await self._reader.readexactly(size))
                await self._reader.readexactly(2)
        if "content-length" in headers:
            length = int(headers["content-length"])
            if length > MAX_RESPONSE_BYTES:
                raise ValueError("response too large")
            return await self._reader.readexactly(length)
        data = await self._reader.read(MAX_RESPONSE_BYTES)
        await self.close()
        return data
