"""Postgres access: the pool and idempotent, concurrency-safe migrations."""

from __future__ import annotations

import math
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from core.config import mask_url
from core.errors import (
    ConnectionLostBeforeCommit,
    ConnectionLostInTransaction,
    DatabaseUnavailable,
    InputError,
)
from core.queries import MIGRATIONS_DIR

# Any constant works; it only has to be the same for every process that migrates this database.
_MIGRATION_LOCK = 7_261_002


# The connection went away under a statement, or the server is (re)starting: the statement did not
# run, or ran and committed without us hearing back. Either way the database may be back in seconds.
_CONNECTION_LOST: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.PostgresConnectionError,  # class 08, incl. ConnectionDoesNotExistError
    asyncpg.exceptions.AdminShutdownError,  # pg_terminate_backend, shutdown
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,  # starting up / recovering
    asyncpg.exceptions.InterfaceError,  # "connection is closed", "connection was closed in the middle of operation"
    ConnectionError,  # refused / reset while connecting
)


def connection_lost(err: BaseException) -> bool:
    """True if `err` means the database connection was lost or could not be made (worth retrying)."""
    if isinstance(err, asyncpg.exceptions.InternalClientError):
        # "cannot switch to state 15; another operation (2) is in progress": the protocol's state,
        # confused by a connection that closed between two messages of a statement.
        return "another operation" in str(err) and "in progress" in str(err)
    if isinstance(err, asyncpg.exceptions.InterfaceError):
        # A pool detaches a connection it sees closed: the next call says it was released back to the pool.
        return "closed" in str(err) or "released back to the pool" in str(err)
    return isinstance(err, _CONNECTION_LOST) or (isinstance(err, OSError) and not isinstance(err, TimeoutError))


def is_database_error(err: BaseException) -> bool:
    """A lost connection raised by asyncpg (or refused while connecting): not any OSError of any
    library, so a Temporal or HTTP failure is never reported as the database's."""
    if isinstance(err, asyncpg.exceptions.PostgresError | asyncpg.exceptions.InterfaceError):
        return connection_lost(err)
    return isinstance(err, ConnectionRefusedError | ConnectionResetError) and connection_lost(err)


def unavailable(url: str | None, err: BaseException) -> DatabaseUnavailable:
    """The error a command reports when the database cannot be reached: names the database (no password)."""
    where = mask_url(url) if url else "the embedded Postgres"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    cause = f"{type(err).__name__}: {detail}" if detail else type(err).__name__
    return DatabaseUnavailable(f"database {where} is unavailable ({cause})")


async def create_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 8,
    on_connect: Callable[[], None] | None = None,
    connect_timeout: float = 60.0,
    idle_in_transaction_timeout: float | None = None,
) -> asyncpg.Pool:
    """The asyncpg pool; `on_connect` runs after each new connection (the worker notes a recovery).

    `idle_in_transaction_timeout` (seconds): the server ends a session whose transaction stays idle
    that long (Postgres' idle_in_transaction_session_timeout), so a client frozen or cut off between
    a statement and its COMMIT does not keep its row and advisory locks: see Settings.

    Every statement is planned for its own parameters (`plan_cache_mode = force_custom_plan`):
    asyncpg prepares each statement once per connection, and after five executions Postgres may
    keep one generic plan for the connection's life, planned on the statistics of that moment. A
    batch statement's generic plan made while `cleanup_applied` was small probes it with a
    sequential scan per account, and keeps doing so as the table grows: a cohort's cleanup turned
    quadratic (BENCHMARKS.md, "A generic plan frozen on an empty table"). Planning the batch
    statement costs ~1 ms against 40-450 ms to run it."""
    server_settings = {"plan_cache_mode": "force_custom_plan"}
    if idle_in_transaction_timeout:
        server_settings["idle_in_transaction_session_timeout"] = str(max(1, int(idle_in_transaction_timeout * 1000)))

    async def init(conn: asyncpg.Connection) -> None:
        if on_connect is not None:
            on_connect()

    pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        command_timeout=300,
        init=init,
        timeout=connect_timeout,
        server_settings=server_settings,
    )
    assert pool is not None
    return pool


@asynccontextmanager
async def transaction(conn: asyncpg.Connection, **options: Any) -> AsyncIterator[Any]:
    """`conn.transaction()` that keeps the real error when the connection dies under the body.

    With a plain `async with conn.transaction()`, a body that fails because the connection closed
    ("connection was closed in the middle of operation") is followed by a rollback on that closed
    connection, whose `InterfaceError: cannot call Transaction.__aexit__(): the underlying
    connection is closed` replaces the body's error. Here the body's error is re-raised whenever the
    rollback fails (the failure is noted on it); a body that failed with a confused client state
    (InternalClientError) on a connection that closed raises ConnectionLostInTransaction. A
    connection found closed at COMMIT (the body's last statement succeeded, then the server went
    away) raises ConnectionLostBeforeCommit: nothing was committed. An error of the COMMIT itself is
    raised as it is (its outcome is unknown).
    """
    body_error: BaseException | None = None
    exit_error: BaseException | None = None
    try:
        async with conn.transaction(**options) as tx:
            try:
                yield tx
            except BaseException as err:
                body_error = err
                raise
    except BaseException as err:
        if body_error is None and _closed_before_exit(err):
            raise ConnectionLostBeforeCommit(
                "the database connection was closed before COMMIT; the server rolled the transaction back"
            ) from err
        if body_error is None or err is body_error or not isinstance(err, Exception):
            raise  # no body error to keep, or a cancellation during the rollback
        exit_error = err
    if body_error is not None:  # raised outside the handler: its own cause and context stay as they were
        body_error.add_note(f"(the rollback failed too: {type(exit_error).__name__}: {exit_error})")
        client_side = asyncpg.exceptions.InternalClientError | asyncpg.exceptions.InterfaceError
        if isinstance(body_error, client_side) and not connection_lost(body_error) and conn.is_closed():
            raise ConnectionLostInTransaction(
                f"the database connection closed during the transaction ({type(body_error).__name__}: {body_error});"
                " nothing was committed"
            ) from body_error
        raise body_error


async def ping(pool: asyncpg.Pool) -> None:
    """The cheapest statement: answers once the database is reachable again (core.outage)."""
    await pool.fetchval("SELECT 1")


def _closed_before_exit(err: BaseException) -> bool:
    """asyncpg's `cannot call Transaction.__aexit__(): the underlying connection is closed`."""
    return isinstance(err, asyncpg.exceptions.InterfaceError) and "underlying connection is closed" in str(err)


async def await_db(url: str | None, step: Awaitable[Any]) -> Any:
    """Await a step that opens the database; a lost or refused connection becomes DatabaseUnavailable."""
    try:
        return await step
    except Exception as err:
        if connection_lost(err):
            raise unavailable(url, err) from err
        raise


def migration_files() -> list[Path]:
    return sorted(MIGRATIONS_DIR.glob("*.sql"))


async def pending_migrations(conn: asyncpg.Connection) -> list[str] | None:
    """Names not yet applied, read without taking locks or running DDL; None if there is no ledger yet."""
    if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
        return None
    done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
    return [p.name for p in migration_files() if p.name not in done]


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the migrations not yet applied; safe when several workers start at once.

    An up-to-date database is detected read-only first, so a least-privileged worker role
    (004_worker_role.sql: no DDL) starts fine against a database migrated by its owner.
    """
    if await pending_migrations(conn) == []:
        return []
    applied_now: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
        for path in migration_files():
            if path.name in done:
                continue
            await conn.execute(path.read_text())
            await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", path.name)
            applied_now.append(path.name)
    return applied_now


def connect_timeout() -> float:
    """Seconds to wait for a database connection (DATABASE_CONNECT_TIMEOUT_SECONDS, default 10): a
    Postgres that accepts and never answers fails a command with a clear message, not a hang."""
    raw = os.environ.get("DATABASE_CONNECT_TIMEOUT_SECONDS") or "10"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= 3600):  # also NaN and infinity
        raise ValueError(f"DATABASE_CONNECT_TIMEOUT_SECONDS must be a number of seconds in (0, 3600], got {raw!r}")
    return value


async def migrate_url(url: str) -> list[str]:
    conn = await asyncpg.connect(url, timeout=connect_timeout())
    try:
        return await migrate(conn)
    finally:
        await conn.close()


def with_database(url: str, name: str) -> str:
    """The same server, another database (works for host:port and for socket-directory URLs)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


async def create_database(
    admin_url: str, name: str, *, template: str | None = None, replace: bool = False, migrate: bool = True
) -> str:
    """Create database `name` on the server of `admin_url` (a clone of `template` if given, else
    migrated) and return its URL. The one place the demo, tests, harness and benchmarks make one."""
    for given in (name, template or name):
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", given):
            raise InputError(f"not a database name: {given!r}")
    admin = await asyncpg.connect(admin_url)
    try:
        if replace:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    finally:
        await admin.close()
    url = with_database(admin_url, name)
    if migrate and template is None:
        await migrate_url(url)
    return url


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


WORKER_ROLE = "cleanup_worker"


async def grant_worker_role(url: str, login: str) -> str:
    """Make `login` a member of the worker role (created by migration 004): rows only, no DDL."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", login):
        raise InputError(f"not a role name: {login!r} (lower-case letters, digits and _)")
    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", login):
            raise InputError(f"no database role named {login!r}; create the login first")
        await conn.execute(f'GRANT {WORKER_ROLE} TO "{login}"')
    finally:
        await conn.close()
    return login
