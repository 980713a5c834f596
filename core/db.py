"""Postgres access: the pool and idempotent, concurrency-safe migrations."""

from __future__ import annotations

import hashlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from core.config import DEFAULT_SETTINGS, Settings, mask_url
from core.errors import (
    ConnectionLostBeforeCommit,
    ConnectionLostInTransaction,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    InputError,
)
from core.queries import MIGRATIONS_DIR
from core.roles import ensure_roles, give_to_owner, grant, service_roles

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same for every process that migrates this database.
_MIGRATION_LOCK = 7_261_002

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# A migration file whose first line is this runs outside a transaction (CREATE INDEX CONCURRENTLY).
NO_TRANSACTION = "-- no-transaction"
# How long a migration statement waits for a lock before it fails (a live game's tables are busy:
# waiting behind a long transaction would queue every player's statement behind the migration).
MIGRATION_LOCK_TIMEOUT = "5s"


def service_schema(settings: Settings = DEFAULT_SETTINGS) -> str:
    """The schema that holds every table and function of the service (CLEANUP_SCHEMA, default
    `deadline_cleanup`): the service creates nothing outside it but what the targets declare."""
    name = settings.database_schema
    if not _IDENTIFIER.fullmatch(name):
        raise InputError(f"CLEANUP_SCHEMA is not a schema name: {name!r} (lower-case letters, digits and _)")
    return name


def service_settings(settings: Settings = DEFAULT_SETTINGS) -> dict[str, str]:
    """Session settings of every connection of the service: its schema first on the search path, so
    its SQL names tables unqualified (pg_catalog is searched implicitly)."""
    return {"search_path": service_schema(settings)}


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


def unavailable(url: str | None, err: BaseException, settings: Settings = DEFAULT_SETTINGS) -> DatabaseUnavailable:
    """The error a command reports when the database cannot be reached: names the database (no password)."""
    where = mask_url(url) if url else "(DATABASE_URL unset)"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if not detail and isinstance(err, TimeoutError):  # the connect's bound: say which and where it is set
        detail = f"no answer within {settings.connect_timeout_seconds:g} s, CONNECT_TIMEOUT_SECONDS"
    cause = f"{type(err).__name__}: {detail}" if detail else type(err).__name__
    return DatabaseUnavailable(f"database {where} is unavailable ({cause})")


# SQLSTATEs of a connection refused for good: 3D000 invalid_catalog_name (no such database), class
# 28 invalid authorization (28000 no such role or no pg_hba.conf entry, 28P01 wrong password).
_MISCONFIGURED_SQLSTATES = ("3D000", "28")
# getaddrinfo's "this name does not exist" (EAI_NONAME, EAI_NODATA); EAI_AGAIN ("temporary failure
# in name resolution") is the resolver away: unavailable, retried like a refused connection.
_UNKNOWN_HOST_ERRNOS = (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME))


_TO_FIX = {"3D000": "the database name", "28000": "the user (role) name", "28P01": "the password"}


def misconfiguration(url: str | None, err: BaseException) -> DatabaseMisconfigured | None:
    """The error a command reports when DATABASE_URL itself is wrong (exit 2: retrying cannot help),
    or None for any other failure. The server's sentence (it names the database or the role, never
    a password) and the URL without its password."""
    where = mask_url(url) if url else "(DATABASE_URL unset)"
    state = getattr(err, "sqlstate", None)
    if isinstance(state, str) and state.startswith(_MISCONFIGURED_SQLSTATES):
        what = _TO_FIX.get(state, "the user or the host")
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return DatabaseMisconfigured(f"{detail} (at {where}): fix {what} in DATABASE_URL (or --database-url)")
    if isinstance(err, socket.gaierror) and err.errno in _UNKNOWN_HOST_ERRNOS:
        host = urlsplit(url).hostname if url else None
        return DatabaseMisconfigured(
            f"the host name {host!r} of DATABASE_URL (or --database-url) does not resolve ({where}): fix the host"
        )
    return None


async def open_connection(url: str, settings: Settings = DEFAULT_SETTINGS, **options: Any) -> asyncpg.Connection:
    """`asyncpg.connect` bounded by CONNECT_TIMEOUT_SECONDS; a wrong DATABASE_URL raises
    DatabaseMisconfigured (exit 2) instead of the driver's error."""
    try:
        return await asyncpg.connect(url, timeout=settings.connect_timeout_seconds, **options)
    except Exception as err:
        wrong = misconfiguration(url, err)
        if wrong is not None:
            raise wrong from None
        raise


# Every session this service opens carries this application_name prefix (its pools: create_pool;
# the stalled-session check: core.sessions), and only those may be ended by core.sessions.
APPLICATION_NAME = "deadline-cleanup"


async def create_pool(
    url: str,
    *,
    application_name: str = APPLICATION_NAME,
    min_size: int = 1,
    max_size: int = 8,
    on_connect: Callable[[], None] | None = None,
    connect_timeout: float = 60.0,
    idle_in_transaction_timeout: float | None = None,
    settings: Settings = DEFAULT_SETTINGS,
) -> asyncpg.Pool:
    """The asyncpg pool; `on_connect` runs after each new connection (the worker notes a recovery).

    `idle_in_transaction_timeout` (seconds): the server ends a session whose transaction stays idle
    that long (Postgres' idle_in_transaction_session_timeout), so a client frozen or cut off between
    a statement and its COMMIT does not keep its row and advisory locks: see Settings.

    Every statement is planned for its own parameters (`plan_cache_mode = force_custom_plan`):
    asyncpg prepares each statement once per connection, and after five executions Postgres may
    keep one generic plan for the connection's life, planned on the statistics of that moment. A
    batch statement's generic plan made while `cleanup_applied` was small probes it with a
    sequential scan per account, and keeps doing so as the table grows: the cleanup turns quadratic
    (docs/decisions/0012-custom-plans.md). Planning per execution is small next to running a batch."""
    server_settings = {
        "plan_cache_mode": "force_custom_plan",
        "application_name": application_name,
        **service_settings(settings),
    }
    if idle_in_transaction_timeout:
        server_settings["idle_in_transaction_session_timeout"] = str(max(1, int(idle_in_transaction_timeout * 1000)))

    async def init(conn: asyncpg.Connection) -> None:
        if on_connect is not None:
            on_connect()

    try:
        pool = await asyncpg.create_pool(
            url,
            min_size=min_size,
            max_size=max_size,
            command_timeout=300,
            init=init,
            timeout=connect_timeout,
            server_settings=server_settings,
        )
    except Exception as err:
        wrong = misconfiguration(url, err)
        if wrong is not None:
            raise wrong from None
        raise
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


# The ledger of applied files, and the row each applied file adds to it (migrate, migration_script).
MIGRATION_LEDGER = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now(), checksum text)"
)
_RECORD = "INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)"


def migration_files() -> list[Path]:
    return sorted(MIGRATIONS_DIR.glob("*.sql"))


def checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class MigrationChanged(InputError):
    """An applied migration file differs from the one applied: the schema is not what the code expects."""


async def applied_migrations(
    conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS
) -> dict[str, str | None] | None:
    """Applied file -> its checksum when applied; None if there is no ledger yet (read-only)."""
    ledger = f"{service_schema(settings)}.schema_migrations"
    if await conn.fetchval("SELECT to_regclass($1)", ledger) is None:
        return None
    return {r["name"]: r["checksum"] for r in await conn.fetch(f"SELECT name, checksum FROM {ledger}")}


def changed_files(applied: dict[str, str | None]) -> list[str]:
    """Applied files whose text changed since (a file applied before checksums were kept is not judged)."""
    files = {p.name: p for p in migration_files()}
    return [n for n, c in sorted(applied.items()) if c is not None and n in files and checksum(files[n]) != c]


async def pending_migrations(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> list[str] | None:
    """Names not yet applied, read without taking locks or running DDL; None if there is no ledger yet."""
    applied = await applied_migrations(conn, settings)
    if applied is None:
        return None
    return [p.name for p in migration_files() if p.name not in applied]


async def migration_status(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> list[dict[str, Any]]:
    """Every migration file: applied or pending, its checksum, and whether an applied one changed."""
    applied = await applied_migrations(conn, settings) or {}
    rows = []
    for path in migration_files():
        now = checksum(path)
        state = "pending"
        if path.name in applied:
            state = "changed" if applied[path.name] not in (None, now) else "applied"
        rows.append({"name": path.name, "state": state, "checksum": now, "applied_checksum": applied.get(path.name)})
    return rows


def refuse_changed(applied: dict[str, str | None]) -> None:
    changed = changed_files(applied)
    if changed:
        raise MigrationChanged(
            f"applied migration files changed since they were applied: {', '.join(changed)};"
            " restore them (a change to the schema is a new migration file)"
        )


async def require_schema_current(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> None:
    """What every command but `migrate` does: the schema must be at the code's version."""
    pending = await pending_migrations(conn, settings)
    if pending is None:
        raise InputError(
            f"the database has no {service_schema(settings)} schema yet: run migrate (`starter.py migrate`)"
        )
    if pending:
        raise InputError(f"the database schema is behind ({len(pending)} pending: {pending[0]}, ...): run migrate")


async def migrate(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> list[str]:
    """Apply the migrations not yet applied; safe when several processes migrate at once.

    Each file runs in a transaction of its own with a lock_timeout (one marked `-- no-transaction`,
    e.g. CREATE INDEX CONCURRENTLY, runs as it is), with the service schema as the search path, so
    unqualified names are created there. An up-to-date database is detected read-only first, so a
    least-privileged worker role (no DDL) starts fine against a database migrated by its owner.
    """
    applied = await applied_migrations(conn, settings)
    if applied is not None:
        refuse_changed(applied)
        if all(p.name in applied for p in migration_files()) and await _key_type_recorded(conn, settings):
            return []
    schema = service_schema(settings)
    applied_now: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
    try:
        await ensure_roles(conn, service_roles(settings))
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await conn.execute(f"SET search_path TO {schema}")
        await conn.execute(MIGRATION_LEDGER)
        await conn.execute("ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS checksum text")
        applied = await applied_migrations(conn, settings) or {}
        refuse_changed(applied)
        for path in migration_files():
            if path.name not in applied:
                await _apply(conn, path)
                applied_now.append(path.name)
        await record_account_key_type(conn, settings)
        await grant_service_tables(conn, settings)
    finally:
        await conn.execute("RESET search_path")
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    return applied_now


async def _key_type_recorded(conn: asyncpg.Connection, settings: Settings) -> bool:
    recorded = await conn.fetchval(f"SELECT key_type FROM {service_schema(settings)}.account_key_type WHERE id = 1")
    return bool(recorded == settings.database_account_key_type)


async def record_account_key_type(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> None:
    """Record the configured key type; from text to uuid or bigint, canonicalize the registrations
    (renamed, or held when two spellings collide or the type cannot hold one: nothing is erased)."""
    wanted = settings.database_account_key_type
    recorded = await conn.fetchval("SELECT key_type FROM account_key_type WHERE id = 1")
    if recorded == wanted:
        return
    if recorded != "text":
        raise InputError(
            f"CLEANUP_ACCOUNT_KEY_TYPE is {wanted}, but this database's account keys are {recorded}s;"
            " a key type changes only from text"
        )
    async with transaction(conn):
        await conn.execute("UPDATE account_key_type SET key_type = $1, recorded_at = clock_timestamp()", wanted)
        done = await conn.fetchrow("SELECT * FROM canonicalize_registrations()")
    assert done is not None
    if done["held_collisions"] or done["held_invalid"]:
        log.warning(
            "account keys are now %ss: %d registration(s) renamed to their canonical key; %d held as another"
            " spelling of a registered account, %d held as not a %s (`account history ID` shows each hold's reason)",
            wanted,
            done["renamed"],
            done["held_collisions"],
            done["held_invalid"],
            wanted,
        )


async def grant_service_tables(conn: asyncpg.Connection, settings: Settings = DEFAULT_SETTINGS) -> None:
    """The owner role owns the service schema and everything in it; each role gets its privileges
    (core/roles.py). Runs after every migration run, with the service schema as the search path."""
    schema, roles = service_schema(settings), service_roles(settings)
    await give_to_owner(conn, schema, roles)
    await grant(conn, schema, roles)


def _statements(text: str) -> list[str]:
    """The statements of a no-transaction file: each ends with `;` at the end of a line."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in re.split(r";\s*$", body, flags=re.MULTILINE) if s.strip()]


def _text(path: Path) -> str:
    return path.read_text()


async def _apply(conn: asyncpg.Connection, path: Path) -> None:
    text = _text(path)
    if text.startswith(NO_TRANSACTION):
        await conn.execute(f"SET lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'")
        try:
            # One statement at a time: several in one query string run as one implicit transaction,
            # which CREATE INDEX CONCURRENTLY refuses. Such files hold no dollar-quoted bodies.
            for statement in _statements(text):
                await conn.execute(statement)
        finally:
            await conn.execute("RESET lock_timeout")
        await conn.execute(_RECORD, path.name, checksum(path))
        return
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'")
        await conn.execute(text)
        await conn.execute(_RECORD, path.name, checksum(path))


def migration_script(paths: list[Path], settings: Settings = DEFAULT_SETTINGS) -> str:
    """The DDL `migrate apply` runs for the files `paths`, as one psql script for a DBA to review
    (`migrate sql`): the service schema and the ledger, then each file as `_apply` runs it (in a
    transaction with the lock timeout, or statement by statement for a `-- no-transaction` file),
    followed by the ledger row it adds."""
    schema = service_schema(settings)
    lines = [
        f"-- {len(paths)} pending migration file(s) of schema {schema}, in the order `migrate apply` runs them.",
        "-- `migrate apply` also creates the service roles and grants their privileges (core/roles.py).",
        f"CREATE SCHEMA IF NOT EXISTS {schema};",
        f"SET search_path TO {schema};",
        f"{MIGRATION_LEDGER};",
    ]
    for path in paths:
        text = _text(path).rstrip()
        text += "" if text.endswith(";") else ";"
        record = _RECORD.replace("$1", f"'{path.name}'").replace("$2", f"'{checksum(path)}'") + ";"
        timeout = f"lock_timeout = '{MIGRATION_LOCK_TIMEOUT}';"
        if text.startswith(NO_TRANSACTION):
            lines += ["", f"-- {path.name}", f"SET {timeout}", text, "RESET lock_timeout;", record]
        else:
            lines += ["", f"-- {path.name}", "BEGIN;", f"SET LOCAL {timeout}", text, record, "COMMIT;"]
    return "\n".join(lines) + "\n"


async def pending_files_url(url: str, settings: Settings = DEFAULT_SETTINGS) -> list[Path]:
    """The migration files `migrate apply` would run on the database at `url` (all of them when it
    has no ledger yet), read without taking locks or running DDL."""
    conn = await open_connection(url, settings)
    try:
        pending = await pending_migrations(conn, settings)
    finally:
        await conn.close()
    return [p for p in migration_files() if pending is None or p.name in pending]


async def migrate_url(url: str, settings: Settings = DEFAULT_SETTINGS) -> list[str]:
    conn = await open_connection(url, settings)
    try:
        return await migrate(conn, settings)
    finally:
        await conn.close()


# A session setting that once moved the renewal rule's clock (cleanup_clock() no longer reads it):
# found anywhere a worker can see, it means a configuration that expects deletions to run early.
CLOCK_OFFSET_SETTING = "cleanup.clock_offset"
_CLOCK_OFFSETS = """
SELECT 'the connection' AS place FROM (SELECT current_setting($1, true) AS v) s WHERE coalesce(s.v, '') <> ''
UNION ALL
SELECT CASE WHEN d.setdatabase = 0 THEN 'role ' || r.rolname::text
            WHEN d.setrole = 0 THEN 'database ' || db.datname::text
            ELSE 'role ' || r.rolname::text || ' in database ' || db.datname::text END
FROM pg_db_role_setting d
LEFT JOIN pg_roles r ON r.oid = d.setrole
LEFT JOIN pg_database db ON db.oid = d.setdatabase
WHERE EXISTS (SELECT 1 FROM unnest(d.setconfig) c WHERE c LIKE $1 || '=%')
  AND (d.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database())))
"""


async def check_worker_database(url: str, settings: Settings = DEFAULT_SETTINGS) -> None:
    """A worker's start-up: the schema is current (check_schema_url), and no clock offset is set
    where the worker's sessions would see it (its DSN, its role, its database): InputError (exit 2)
    naming where. The clock that decides deletions is the database's."""
    await check_schema_url(url, settings)
    conn = await open_connection(url, settings)
    try:
        places = [r["place"] for r in await conn.fetch(_CLOCK_OFFSETS, CLOCK_OFFSET_SETTING)]
    finally:
        await conn.close()
    if places:
        raise InputError(
            f"{CLOCK_OFFSET_SETTING} is set ({', '.join(places)}): the deletion clock is the database's own;"
            f" remove it (RESET {CLOCK_OFFSET_SETTING}, or the option in DATABASE_URL)"
        )


async def check_schema_url(url: str, settings: Settings = DEFAULT_SETTINGS) -> None:
    """What every command but `migrate` (and every worker) does at start-up: never apply a
    migration (DDL on a live game database is the operator's step), only refuse to run on a schema
    behind the code or changed since applied, with what to do (InputError: exit 2)."""
    conn = await open_connection(url, settings)
    try:
        applied = await applied_migrations(conn, settings)
        if applied is not None:
            refuse_changed(applied)
        await require_schema_current(conn, settings)
    finally:
        await conn.close()


async def migration_status_url(url: str, settings: Settings = DEFAULT_SETTINGS) -> list[dict[str, Any]]:
    conn = await open_connection(url, settings)
    try:
        return await migration_status(conn, settings)
    finally:
        await conn.close()


def with_database(url: str, name: str) -> str:
    """The same server, another database (works for host:port and for socket-directory URLs)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


async def create_database(
    admin_url: str,
    name: str,
    *,
    template: str | None = None,
    replace: bool = False,
    migrate: bool = True,
    settings: Settings = DEFAULT_SETTINGS,
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
        await migrate_url(url, settings)
    return url


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


# The worker role's name with the default CLEANUP_ROLE_PREFIX (tests and the demo use the default).
WORKER_ROLE = "cleanup_worker"


async def grant_worker_role(url: str, login: str, settings: Settings = DEFAULT_SETTINGS) -> str:
    """Make `login` a member of this database's worker role: rows only, no DDL. Needs CREATEROLE or
    the worker role's ADMIN OPTION: InputError (exit 2) says which otherwise."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", login):
        raise InputError(f"not a role name: {login!r} (lower-case letters, digits and _)")
    worker = service_roles(settings).worker
    conn = await open_connection(url, settings)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", login):
            raise InputError(f"no database role named {login!r}; create the login first")
        try:
            await conn.execute(f'GRANT {worker} TO "{login}"')
        except asyncpg.InsufficientPrivilegeError:
            raise InputError(
                f"granting {worker} needs CREATEROLE or its ADMIN OPTION; as an administrator run:"
                f" GRANT {worker} TO {login}"
            ) from None
    finally:
        await conn.close()
    return login
