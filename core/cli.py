"""What every CLI command shares: JSON or human output (Rich tables and progress bars), the
services a command opens, and the registrar through which each job adds its own commands.

Rich is imported inside the functions that draw: `starter.py --help` and `account renew` stay fast to start."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel

from core import addresses, db
from core.config import Settings, process_switch
from core.errors import DatabaseUnavailable, InputError
from core.model import Report
from core.temporal import connect

if TYPE_CHECKING:
    import asyncpg
    from temporalio.client import Client

Handler = Callable[[argparse.Namespace, Settings], Awaitable[Any]]

JSON_HELP = "print machine-readable JSON (an error: one JSON object on stderr)"

# Exit codes of the CLI: 0 ok, 1 an unexpected error, 2 bad input or configuration (nothing was
# started), 3 a renewal that came too late, 75 (EX_TEMPFAIL) the database or Temporal unavailable:
# retry later, the input was fine.
EXIT_ERROR = 1
EXIT_INPUT = 2
EXIT_TOO_LATE = 3
EXIT_UNAVAILABLE = 75

HINTS = {
    EXIT_ERROR: "unexpected: CLEANUP_DEBUG=1 prints the traceback",
    EXIT_INPUT: "fix the input or the configuration (--help lists every option)",
    EXIT_UNAVAILABLE: "temporarily unavailable: retry later",
}
ERROR_KINDS = {EXIT_ERROR: "unexpected", EXIT_INPUT: "bad_input", EXIT_UNAVAILABLE: "unavailable"}


def report_error(code: int, message: str, *, as_json: bool) -> int:
    """Print one error: `error: message` or, under --json, one JSON object {error, message, hint}
    on stderr. Returns `code` (the exit code)."""
    if as_json:
        body = {"error": ERROR_KINDS.get(code, "error"), "message": message, "hint": HINTS.get(code, "")}
        print(json.dumps(body), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)
    return code


class CliParser(argparse.ArgumentParser):
    """Usage errors as the other errors: one line on stderr (under --json, one JSON object), exit 2,
    in nested sub-commands too (their parsers are of this class).

    No abbreviated flags: with them a verb would take a prefix of another flag it happens to have
    (`--dead` for `--dead-since`), so a flag meant for a sibling verb would parse instead of failing.
    `default_verb`: a group whose verb may be left out (`migrate` is `migrate apply`). `leaf`: a
    verb reports an argument it does not take itself, with its own usage (which lists its flags)."""

    json_errors = False  # set by the entry point from its argv, before parsing
    default_verb: str | None = None
    leaf = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.default_verb is not None:
            given = list(sys.argv[1:] if args is None else args)
            if not given or given[0] not in (*self.verbs(), "-h", "--help"):
                given.insert(0, self.default_verb)  # its flags then belong to the default verb alone
            args = given
        parsed, rest = super().parse_known_args(args, namespace)
        if self.leaf and rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        return parsed, rest

    def verbs(self) -> list[str]:
        """The names of this parser's sub-commands ([] for a leaf)."""
        return [name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]

    def error(self, message: str) -> NoReturn:
        """One line, like every other bad value (an InputError): a flag's type refusing a value
        (`--payments -5`) is bad input too, not a reason to print the whole usage."""
        as_json = CliParser.json_errors
        shown = f"{self.prog}: {message}" + ("" if as_json else f" (`{self.prog} --help` lists its options)")
        report_error(EXIT_INPUT, shown, as_json=as_json)
        sys.exit(EXIT_INPUT)


def finite_float(low: float | None = None, high: float | None = None) -> Callable[[str], float]:
    """An argparse `type`: a finite number within [low, high]. float() alone takes 'nan' and 'inf',
    and NaN passes every comparison-based bound (in Postgres it sorts above every number)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be within [{low}, {high}], got {text!r}")
        return value

    return parse


def bounded_int(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: a whole number within [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be within [{low}, {high}], got {text!r}")
        return value

    return parse


def reject_non_finite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The backstop for every float flag, also those declared with a plain `type=float`."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def count_argument(low: int, high: int = 1_000_000) -> Callable[[str], int]:
    """An argparse `type` for a count in [low, high]: anything else exits 2 naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


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
    from rich.console import Console  # lazy: keeps `starter.py --help` and `account renew` fast to start

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


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """Where Temporal and the database are, each with its environment variable. An address has no
    default: unset, it comes from `./dev up`'s env file, else the command exits 2 naming it."""
    parser.add_argument(
        "--temporal-address",
        metavar="HOST:PORT",
        help="the Temporal frontend (env: TEMPORAL_ADDRESS; unset: the `./dev up` stack's, else exit 2)",
    )
    parser.add_argument("--namespace", help="the Temporal namespace (env: TEMPORAL_NAMESPACE; default 'default')")
    parser.add_argument(
        "--task-queue", help="the workers' task queue (env: TEMPORAL_TASK_QUEUE; default 'deadline-cleanup')"
    )
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="the Postgres database (env: DATABASE_URL; unset: the `./dev up` stack's, else exit 2)",
    )


def plain(data: Any) -> Any:
    """A result as the CLI prints it: a report with the fields its sources gave (`Report.given`), any
    other model dumped, lists element by element; anything else as it is."""
    if isinstance(data, Report):
        return data.given()
    if isinstance(data, BaseModel):
        return data.model_dump()
    if isinstance(data, list):
        return [plain(item) for item in data]
    return data


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str] | None = None) -> None:
    """`--json` (or no human form): JSON; otherwise the human form, key/value lines by default. A
    model is printed as `plain` gives it."""
    data = plain(data)
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
        self.enabled = sys.stderr.isatty() or process_switch("PROGRESS") == "1"
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
    """Opens what a command needs (the addresses checked, migrated pool, client) and closes it after.

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
        self.settings = addresses.require(settings, database=database != "unused")
        self.database = database
        self.database_missing: str | None = None
        self._pool: asyncpg.Pool | None = None

    @property
    def optional_pool(self) -> asyncpg.Pool | None:
        return self._pool

    async def __aenter__(self) -> CliContext:
        url = self.settings.database_url
        if self.database != "unused":
            assert url is not None
            try:
                await db.check_schema_url(url, self.settings)  # only `migrate` changes the schema
                self._pool = await db.create_pool(
                    url, max_size=4, connect_timeout=self.settings.connect_timeout_seconds, settings=self.settings
                )
            except Exception as err:
                if not (db.connection_lost(err) or isinstance(err, TimeoutError)):
                    raise
                if self.database == "required":
                    raise db.unavailable(url, err, self.settings) from err
                self.database_missing = str(db.unavailable(url, err, self.settings))
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
            raise db.unavailable(self.settings.database_url, exc, self.settings) from exc


@asynccontextmanager
async def database_pool(settings: Settings, *, migrate: bool, max_size: int = 2) -> AsyncIterator[asyncpg.Pool]:
    """For commands that need the database only: no Temporal connection.
    An unreachable database, or one lost mid-command, raises DatabaseUnavailable. `migrate`: check
    that the schema is current (exit 2, "run migrate", when behind); nothing is ever applied here."""
    url = addresses.database_url(settings)
    try:
        if migrate:
            await db.check_schema_url(url, settings)
        pool = await db.create_pool(
            url, max_size=max_size, connect_timeout=settings.connect_timeout_seconds, settings=settings
        )
    except Exception as err:
        if db.connection_lost(err) or isinstance(err, TimeoutError):
            raise db.unavailable(url, err, settings) from err
        raise
    try:
        yield pool
    except Exception as err:
        pool.terminate()
        if db.is_database_error(err):
            raise db.unavailable(url, err, settings) from err
        raise
    else:
        await pool.close()


class Commands:
    """starter.py's sub-commands. Each job's `cli.register(commands)` adds its own; `status
    WORKFLOW_ID` is routed here, in one place, by the workflow-ID prefix each job declares.

    One shape: a command is a leaf verb (`add`) carrying only its own flags, plus `--json`; a noun
    with several verbs is a group (`group`) whose verbs are leaves or groups again. A group has no
    flags of its own, so a flag of one verb is an error (exit 2) on another."""

    def __init__(self, sub: Any, routes: list[tuple[re.Pattern[str], Handler]] | None = None) -> None:
        self.sub = sub
        self._status_routes: list[tuple[re.Pattern[str], Handler]] = [] if routes is None else routes

    def add(self, name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
        p: CliParser = self.sub.add_parser(name, help=help, description=help)
        p.leaf = True
        p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(handler=handler)
        return p

    def group(self, name: str, help: str, *, default: str | None = None) -> Commands:
        """A noun whose verbs are added to the Commands returned. `default`: the verb run when
        none is given (its flags may then follow the noun directly)."""
        p: CliParser = self.sub.add_parser(name, help=help, description=help)
        p.default_verb = default
        # dest SUPPRESS: a missing verb is reported with the verbs to choose from.
        sub = p.add_subparsers(dest=argparse.SUPPRESS, required=default is None, title="commands")
        return Commands(sub, self._status_routes)

    def route_status(self, workflow_id: str, handler: Handler) -> None:
        """`status ID` goes to `handler` when ID fully matches the regex `workflow_id`."""
        self._status_routes.append((re.compile(workflow_id), handler))

    async def status(self, args: argparse.Namespace, settings: Settings) -> Any:
        for pattern, handler in self._status_routes:
            if pattern.fullmatch(args.workflow_id):
                return await handler(args, settings)
        known = ", ".join(p.pattern for p, _ in self._status_routes)
        raise InputError(f"unknown workflow ID {args.workflow_id!r}: expected one of {known}")
