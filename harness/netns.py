"""A worker's own test host: a network namespace whose only ways out are the harness's forwarders.

The namespace has nothing but its loopback interface. For each server the worker needs (Temporal,
Postgres, the mail provider), the harness opens a listening socket *inside* the namespace (a
thread enters it with setns(2), creates the socket and leaves) and relays every connection to
that server on the host's loopback. So the worker reaches each server only through its forwarder,
and no traffic ever leaves the machine's loopback addresses.

`cut()` blackholes one forwarder: bytes stop in both directions and connections stay open (no
reset, no FIN), new connections are accepted and get nothing, as when a host's route to a server
is lost. `reconnect()` lets the held bytes through again. Each forwarder counts the bytes it
relayed, and those it relayed from the worker while another forwarder was cut (the worker kept
working with that server while it was cut off from the other).

Needs root (CAP_SYS_ADMIN) and the `ip` command; `available()` says why not otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

CLONE_NEWNET = 0x40000000
CHUNK = 64 * 1024


def available() -> str | None:
    """None if test hosts can be made here, else why not (a note for the row, never a silent pass)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN); not root here"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def postgres_upstream(url: str) -> int | str:
    """Where a Postgres URL connects: its TCP port on the loopback, or its Unix socket's path
    (`?host=/dir`, as the embedded Postgres gives)."""
    parts = urlsplit(url)
    socket_dir = parse_qs(parts.query).get("host", [""])[0] or (
        parts.hostname if (parts.hostname or "").startswith("/") else ""
    )
    port = parts.port or 5432
    if socket_dir:
        return str(Path(socket_dir) / f".s.PGSQL.{port}")
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", None):
        raise ValueError("a test host forwards only to servers on this machine's loopback")
    return port


def via_forwarder(url: str, port: int) -> str:
    """The same database reached at 127.0.0.1:`port` (the forwarder, on the test host)."""
    parts = urlsplit(url)
    user = parts.username or "postgres"
    auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
    query = "&".join(f"{k}={v[0]}" for k, v in parse_qs(parts.query).items() if k != "host")
    return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{port}", parts.path, query, ""))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _listen_in(namespace: str) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (an ephemeral port) inside `namespace`."""
    out: dict[str, socket.socket | BaseException] = {}

    def enter_and_bind() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({namespace}): {os.strerror(err)}")
            finally:
                os.close(fd)
            # This thread is now in the namespace (and ends right after): the socket stays there.
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            s.setblocking(False)
            out["socket"] = s
        except BaseException as err:  # reported to the caller's thread
            out["error"] = err

    thread = threading.Thread(target=enter_and_bind, name=f"setns-{namespace}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    made = out["socket"]
    assert isinstance(made, socket.socket)
    return made


@dataclass
class Forwarder:
    """Relays connections from the test host to `upstream_port` on the host's loopback."""

    name: str
    upstream: int | str  # a TCP port on the host's 127.0.0.1, or a Unix socket's path
    port: int = 0  # the port inside the namespace
    latency: float = 0.0  # added before each chunk sent back to the worker (a slow link)
    bytes_up: int = 0  # from the worker to the server
    bytes_down: int = 0
    bytes_up_while_cut_elsewhere: int = 0  # from the worker while another forwarder was cut
    connections: int = 0
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    host: TestHost | None = None

    @property
    def cut_off(self) -> bool:
        return not self._open.is_set()

    async def start(self, listening: socket.socket) -> None:
        self._open.set()
        self.port = listening.getsockname()[1]
        self._server = await asyncio.start_server(self._serve, sock=listening)

    async def _serve(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(down_writer)
        try:
            await self._open.wait()  # a connection made while cut gets nothing until reconnected
            if isinstance(self.upstream, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
            else:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except (OSError, asyncio.CancelledError):
            down_writer.close()
            self._writers.discard(down_writer)
            return
        self._writers.add(up_writer)
        pumps = [
            asyncio.create_task(self._pump(down_reader, up_writer, up=True)),
            asyncio.create_task(self._pump(up_reader, down_writer, up=False)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pumps:
                t.cancel()
            for w in (up_writer, down_writer):
                w.close()
                self._writers.discard(w)
            self._tasks.difference_update(pumps)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ConnectionError):
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    return
                await self._open.wait()  # blackholed: the bytes wait here, the sender's buffers fill up
                if up:
                    self.bytes_up += len(data)
                    if self.host is not None and self.host.any_cut(besides=self):
                        self.bytes_up_while_cut_elsewhere += len(data)
                else:
                    self.bytes_down += len(data)
                    if self.latency:
                        await asyncio.sleep(self.latency)
                writer.write(data)
                await writer.drain()

    def cut(self) -> None:
        self._open.clear()

    def reconnect(self) -> None:
        self._open.set()

    async def close(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)


@dataclass
class TestHost:
    """A network namespace with forwarders; `prefix` runs a command on it."""

    name: str = field(default_factory=lambda: f"dcz-{uuid.uuid4().hex[:8]}")
    forwarders: dict[str, Forwarder] = field(default_factory=dict)
    created: bool = False

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    async def create(self) -> None:
        await asyncio.to_thread(_ip, "netns", "add", self.name)
        self.created = True
        await asyncio.to_thread(_ip, "-n", self.name, "link", "set", "lo", "up")

    async def forward(self, name: str, upstream: int | str) -> Forwarder:
        """A forwarder to the host's 127.0.0.1:`upstream` (or to a Unix socket), reachable on the
        test host at 127.0.0.1:`forwarder.port`."""
        listening = await asyncio.to_thread(_listen_in, self.name)
        fwd = Forwarder(name, upstream, host=self)
        await fwd.start(listening)
        self.forwarders[name] = fwd
        return fwd

    def any_cut(self, besides: Forwarder) -> bool:
        return any(f.cut_off for f in self.forwarders.values() if f is not besides)

    async def close(self) -> None:
        for fwd in self.forwarders.values():
            await fwd.close()
        if self.created:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                await asyncio.to_thread(_ip, "netns", "del", self.name)
            self.created = False
