"""The service's roles in one database, and what each may do (docs/security.md).

Four NOLOGIN roles, named `CLEANUP_ROLE_PREFIX` + a suffix (roles are cluster-wide, privileges are
per database: a second database on the same cluster takes a prefix of its own, so a login made for
one reaches nothing in the other):
- owner: owns the service schema, its tables and its functions; nobody logs in as it. The contract
  functions run with its rights (SECURITY DEFINER).
- worker: the service's rows (the audit tables append-only) and every service function.
- game: EXECUTE on `set_deadline` and `renew` only; no privilege on any table.
- compliance: EXECUTE on `hold` and `release` only.
Logins are made members by the DBA (`CREATE ROLE game_app LOGIN IN ROLE cleanup_game`).
`migrate` creates the roles (CREATEROLE) or finds them made by the DBA, and grants, object by object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import asyncpg

from core.config import DEFAULT_SETTINGS, Settings
from core.errors import InputError

GAME_FUNCTIONS = ("set_deadline", "renew")
COMPLIANCE_FUNCTIONS = ("hold", "release")
# Written once per account and never changed: the worker may read and add, not rewrite or remove.
AUDIT_TABLES = ("erasure_receipts", "account_events", "renewals")
# A failure is resolved in place (resolved_at, resolution) and its detail cleared: no DELETE.
RESOLVED_TABLES = ("cleanup_failed",)
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True)
class ServiceRoles:
    owner: str
    worker: str
    game: str
    compliance: str

    @classmethod
    def named(cls, prefix: str) -> ServiceRoles:
        if not _NAME.fullmatch(prefix + "_compliance"):
            raise InputError(f"CLEANUP_ROLE_PREFIX is not a role name prefix: {prefix!r}")
        return cls(f"{prefix}_owner", f"{prefix}_worker", f"{prefix}_game", f"{prefix}_compliance")

    def all(self) -> tuple[str, ...]:
        return (self.owner, self.worker, self.game, self.compliance)


def service_roles(settings: Settings = DEFAULT_SETTINGS) -> ServiceRoles:
    """This database's roles (CLEANUP_ROLE_PREFIX, default `cleanup`)."""
    return ServiceRoles.named(settings.database_role_prefix)


def dba_lines(roles: ServiceRoles) -> str:
    """What a DBA runs when `migrate` may not create the roles itself."""
    made = "; ".join(f"CREATE ROLE {r} NOLOGIN" for r in roles.all())
    return f"{made}; GRANT {roles.owner} TO <the login that runs migrate>"


async def ensure_roles(conn: asyncpg.Connection, roles: ServiceRoles) -> None:
    """Create the roles that are missing and make the migrating login a member of the owner role
    (it must create objects that the owner then owns). InputError (exit 2) names what is missing."""
    me = await conn.fetchrow(
        "SELECT current_user AS name, rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user"
    )
    assert me is not None
    for role in roles.all():
        if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            continue
        if not (me["rolsuper"] or me["rolcreaterole"]):
            raise InputError(
                f"role {role} does not exist and {me['name']} may not create it (needs CREATEROLE);"
                f" as an administrator run: {dba_lines(roles)}"
            )
        try:
            await conn.execute(f"CREATE ROLE {role} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT")
        except (asyncpg.DuplicateObjectError, asyncpg.UniqueViolationError):
            pass  # created meanwhile by another database's migration
    if me["rolsuper"] or await conn.fetchval("SELECT pg_has_role(current_user, $1, 'USAGE')", roles.owner):
        return
    try:
        await conn.execute(f'GRANT {roles.owner} TO "{me["name"]}"')
    except asyncpg.InsufficientPrivilegeError:
        raise InputError(
            f"{me['name']} must be a member of role {roles.owner} to migrate (it owns the service's objects):"
            f" as an administrator run: GRANT {roles.owner} TO {me['name']}"
        ) from None


_OWNED = """
SELECT format('%s %s', CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, c.oid::regclass) AS object
FROM pg_class c
WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p', 'S') AND c.relowner <> $2::regrole
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                  AND d.deptype IN ('a', 'i'))  -- a sequence owned by a column follows its table
UNION ALL
SELECT format('FUNCTION %s', p.oid::regprocedure) FROM pg_proc p
WHERE p.pronamespace = $1::regnamespace AND p.proowner <> $2::regrole
"""


async def give_to_owner(conn: asyncpg.Connection, schema: str, roles: ServiceRoles) -> None:
    """The owner role owns the schema and everything in it (objects a migration just made included),
    so the contract functions run with its rights and no login owns what it could alter."""
    await conn.execute(f"ALTER SCHEMA {schema} OWNER TO {roles.owner}")
    for row in await conn.fetch(_OWNED, schema, roles.owner):
        await conn.execute(f"ALTER {row['object']} OWNER TO {roles.owner}")


_OBJECTS = """
SELECT c.relname::text AS name, c.relkind::text AS kind FROM pg_class c
WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p', 'S')
UNION ALL
SELECT p.oid::regprocedure::text, 'f' FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
"""


async def grant(conn: asyncpg.Connection, schema: str, roles: ServiceRoles) -> None:
    """Each role's privileges, object by object (never ON ALL TABLES: a table the game adds later is
    never reachable), in one transaction so no statement of a running worker sees them half made.
    PUBLIC's EXECUTE on every function is revoked, now and for functions the owner makes later."""
    async with conn.transaction():
        await conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {roles.worker}, {roles.game}, {roles.compliance}")
        await conn.execute(
            f"ALTER DEFAULT PRIVILEGES FOR ROLE {roles.owner} IN SCHEMA {schema}"
            " REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC"
        )
        for row in await conn.fetch(_OBJECTS, schema):
            for statement in _grants(schema, row["name"], row["kind"], roles):
                await conn.execute(statement)


def _grants(schema: str, name: str, kind: str, roles: ServiceRoles) -> list[str]:
    if kind == "f":  # regprocedure prints the signature, schema-qualified where needed
        function = f"{schema}.{name}" if not name.startswith(f"{schema}.") else name
        grants = [
            f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC",
            f"GRANT EXECUTE ON FUNCTION {function} TO {roles.worker}",
        ]
        base = name.removeprefix(f"{schema}.").split("(", 1)[0]
        for role, names in ((roles.game, GAME_FUNCTIONS), (roles.compliance, COMPLIANCE_FUNCTIONS)):
            verb = "GRANT" if base in names else "REVOKE"
            grants.append(f"{verb} EXECUTE ON FUNCTION {function} {'TO' if verb == 'GRANT' else 'FROM'} {role}")
        return grants
    table = f'{schema}."{name}"'
    if kind == "S":
        return [f"GRANT USAGE, SELECT ON SEQUENCE {table} TO {roles.worker}"]
    if name in ("schema_migrations", "account_key_type", "anonymize_key"):
        rows = "SELECT, INSERT, DELETE" if name == "anonymize_key" else "SELECT"  # recorded by migrate
    elif name in AUDIT_TABLES:
        rows = "SELECT, INSERT"
    elif name in RESOLVED_TABLES:
        rows = "SELECT, INSERT, UPDATE"
    else:
        rows = "SELECT, INSERT, UPDATE, DELETE"
    return [
        f"REVOKE ALL ON TABLE {table} FROM {roles.worker}, {roles.game}, {roles.compliance}",
        f"GRANT {rows} ON TABLE {table} TO {roles.worker}",
    ]
