"""The privileges the declared targets need, granted table by table and checked at start-up.

The worker role gets exactly what the compiled statements use on each declared table, and what
each follow-up statement's plan uses on each table it names (never a whole schema, never future
tables): `migrate` grants them (`grant_targets`), and a worker refuses
to start when its role lacks one (cleanup.target_check), naming the table and the privilege,
instead of failing every batch at the deadline.
"""

from __future__ import annotations

import asyncpg

from cleanup.target_check import TargetsRefused, check_follow_ups
from cleanup.targets import CleanupTargets, q, qualified, split_name
from core.config import DEFAULT_SETTINGS, Settings
from core.db import open_connection, service_settings
from core.queries import load
from core.roles import service_roles

SQL = load(__file__, "grants.sql")
DEMO_GAME = load(__file__, "demo_game.sql")


def needed_privileges(targets: CleanupTargets) -> list[tuple[str, str]]:
    """(schema.table, privilege) pairs in declared order, each once: SELECT to find rows (and to
    return the match column), DELETE to remove them (UPDATE to anonymize them), INSERT into an archive."""
    needed: list[tuple[str, str]] = []
    for t in targets.target:
        table = ".".join(t.schema_table)
        needed += [(table, "SELECT"), (table, "UPDATE" if t.action == "anonymize" else "DELETE")]
        if t.archive_table:
            archive = ".".join(split_name(t.archive_table))
            needed += [(archive, "SELECT"), (archive, "INSERT")]
    return list(dict.fromkeys(needed))


async def grant_targets(
    conn: asyncpg.Connection, targets: CleanupTargets, settings: Settings = DEFAULT_SETTINGS
) -> dict[str, list[str]]:
    """Grant the worker role what the targets need, table by table; tables that do not exist yet
    are left out and returned under "missing" (the worker's start-up check names them too)."""
    needed = needed_privileges(targets)
    not_planned: list[str] = []
    try:  # a follow-up's tables, with what its plan does to each (planned as the owner)
        needed = list(dict.fromkeys(needed + [p for c in await check_follow_ups(conn, targets) for p in c.privileges]))
    except TargetsRefused as err:
        not_planned = err.problems
    tables = list(dict.fromkeys(t for t, _ in needed))
    existing = {r["name"] for r in await conn.fetch(SQL.existing_tables, tables)}
    granted: list[str] = []
    worker = service_roles(settings).worker
    for table in tables:
        if table not in existing:
            continue
        if "." in table:
            await conn.execute(f"GRANT USAGE ON SCHEMA {q(table.split('.')[0])} TO {worker}")
        privileges = ", ".join(p for t, p in needed if t == table)
        await conn.execute(f"GRANT {privileges} ON TABLE {qualified(table)} TO {worker}")
        granted.append(f"{privileges} on {table}")
    missing = [t for t in tables if t not in existing]
    return {"granted": granted, "missing": missing} | ({"follow_ups_not_granted": not_planned} if not_planned else {})


async def grant_targets_url(
    url: str, targets: CleanupTargets, settings: Settings = DEFAULT_SETTINGS
) -> dict[str, list[str]]:
    """`grant_targets` on a connection of its own (the owner's), if the worker role exists."""
    conn = await open_connection(url, settings, server_settings=service_settings(settings))
    try:
        if not await conn.fetchval(SQL.role_exists, service_roles(settings).worker):
            return {"granted": [], "missing": []}
        return await grant_targets(conn, targets, settings)
    finally:
        await conn.close()


async def create_demo_game(url: str, settings: Settings = DEFAULT_SETTINGS) -> None:
    """Create the demo game's schema and tables, the ones the built-in targets file declares, in the
    database at `url` (idempotent), and let the worker role reach them table by table, as a game's
    administrator does for its declared targets (`migrate --demo-game`, the demo, the tests)."""
    conn = await open_connection(url, settings, server_settings=service_settings(settings))
    try:
        await conn.execute(DEMO_GAME.create_game_schema)
    finally:
        await conn.close()
