"""What every CLI command shares: JSON or human output (Rich tables and progress bars), the
services a command opens, and the registrar through which each job adds its own commands.

Rich is imported inside the functions that draw: `starter.py --help` and `renew` stay fast to start."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import date, datetime
from typing import TYPE_CHECKING, Any

from core import db, embedded
from core.config import Settings
from core.errors import DatabaseUnavailable, InputError
from core.temporal import connect

if TYPE_CHECKING:
    import asyncpg
    from temporalio.client import Client

Handler = Callable[[argparse.Namespace, Settings], Awaitable[Any]]

# Exit codes of starter.py: 0 ok, 1 an unexpected error, 2 bad input or configuration (nothing was
# started), 3 a renewal that came too late, 75 (EX_TEMPFAIL) the database or Temporal unavailable
# (core.errors.Unavailable: try again later).
EXIT_ERROR = 1
EXIT_INPUT = 2
EXIT_TOO_LATE = 3
EXIT_UNAVAILABLE = 75


def json_default(value: object) -> object:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, dict | list):
        return json.dumps(value, default=json_default)
    return str(json_default(value))


def _render(renderable: object) -> str:
    from rich.console import Console  # lazy: keeps `starter.py --help` and `renew` fast to start

    out = io.StringIO()
    Console(file=out, width=160, color_system=None, soft_wrap=True).print(renderable)
    return out.getvalue().rstrip("\n")


def key_values(data: dict[str, Any]) -> str:
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for k, v in data.items():
        grid.add_row(k, _cell(v))
    return _render(grid)


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "(none)"
    from rich import box
    from rich.table import Table

    columns = columns or list(rows[0])
    t = Table(*columns, box=box.SIMPLE_HEAD, pad_edge=False)
    for row in rows:
        t.add_row(*(_cell(row.get(c)) for c in columns))
    return _render(t)


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str] | None = None) -> None:
    """`--json` (or no human form): JSON; otherwise the human form, key/value lines by default."""
    if getattr(args, "json", False):
        print(json.dumps(data, default=json_default, indent=2))
    elif human is not None:
        print(human(data))
    elif isinstance(data, dict):
        print(key_values(data))
    else:
        print(json.dumps(data, default=json_default, indent=2))


class Progress:
    """A Rich progress bar on stderr; silent when stderr is not a terminal (so `--json` output and
    scripts stay clean) unless forced with PROGRESS=1."""

    def __init__(self, label: str, total: int) -> None:
        self.enabled = sys.stderr.isatty() or os.environ.get("PROGRESS") == "1"
        self.done = 0
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=Console(file=sys.stderr, force_terminal=sys.stderr.isatty()),
            transient=False,
        )
        self._task = self._bar.add_task(label, total=max(total, 1), note="")
        self._bar.start()

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if self.enabled:
            self._bar.update(self._task, completed=done, note=note)

    def finish(self, note: str = "") -> None:
        if self.enabled:
            self._bar.update(self._task, completed=self.done, note=note)
            self._bar.stop()


class CliContext:
    """Opens what a command needs (embedded services, migrated pool, client) and closes it after.

    `database`: "required" (default): an unreachable database fails the command with
    DatabaseUnavailable (exit 75, naming the database); "optional" (status commands): the command
    still answers what Temporal knows, `pool` is None and `database_missing` says why; "unused": no
    connection is made. A connection lost in the middle of the command is reported the same way.
    """

    pool: asyncpg.Pool
    client: Client

    def __init__(self, settings: Settings, *, database: str = "required") -> None:
        if database not in ("required", "optional", "unused"):
            raise ValueError(f"database must be required, optional or unused, got {database!r}")
        self.settings = embedded.resolve(settings)
        self.database = database
        self.database_missing: str | None = None
        self._pool: asyncpg.Pool | None = None

    @property
    def optional_pool(self) -> asyncpg.Pool | None:
        return self._pool

    async def __aenter__(self) -> CliContext:
        url = self.settings.database_url
        assert url is not None
        if self.database != "unused":
            try:
                await db.migrate_url(url)
                self._pool = await db.create_pool(url, max_size=4, connect_timeout=db.connect_timeout())
            except Exception as err:
                if not (db.connection_lost(err) or isinstance(err, TimeoutError)):
                    raise
                if self.database == "required":
                    raise db.unavailable(url, err) from err
                self.database_missing = str(db.unavailable(url, err))
        if self._pool is not None:
            self.pool = self._pool
        self.client = await connect(self.settings)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._pool is not None:
            if exc is None:
                await self._pool.close()
            else:
                self._pool.terminate()
        if exc is not None and not isinstance(exc, DatabaseUnavailable) and db.is_database_error(exc):
            raise db.unavailable(self.settings.database_url, exc) from exc


@asynccontextmanager
async def database_pool(settings: Settings, *, migrate: bool, max_size: int = 2) -> AsyncIterator[asyncpg.Pool]:
    """For commands that need the database only: no Temporal connection (nor embedded dev server).
    An unreachable database, or one lost mid-command, raises DatabaseUnavailable."""
    url = settings.database_url or embedded.embedded_postgres_url(settings.state_dir)
    try:
        if migrate:
            await db.migrate_url(url)
        pool = await db.create_pool(url, max_size=max_size, connect_timeout=db.connect_timeout())
    except Exception as err:
        if db.connection_lost(err) or isinstance(err, TimeoutError):
            raise db.unavailable(url, err) from err
        raise
    try:
        yield pool
    except Exception as err:
        pool.terminate()
        if db.is_database_error(err):
            raise db.unavailable(url, err) from err
        raise
    else:
        await pool.close()


class Commands:
    """starter.py's sub-commands. Each job's `cli.register(commands)` adds its own; `status
    WORKFLOW_ID` is routed here, in one place, by the workflow-ID prefix each job declares."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self._status_routes: list[tuple[re.Pattern[str], Handler]] = []

    def add(self, name: str, handler: Handler, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = self.sub.add_parser(name, help=help, description=help)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.set_defaults(handler=handler)
        return p

    def route_status(self, workflow_id: str, handler: Handler) -> None:
        """`status ID` goes to `handler` when ID fully matches the regex `workflow_id`."""
        self._status_routes.append((re.compile(workflow_id), handler))

    async def status(self, args: argparse.Namespace, settings: Settings) -> Any:
        for pattern, handler in self._status_routes:
            if pattern.fullmatch(args.workflow_id):
                return await handler(args, settings)
        known = ", ".join(p.pattern for p, _ in self._status_routes)
        raise InputError(f"unknown workflow ID {args.workflow_id!r}: expected one of {known}")
