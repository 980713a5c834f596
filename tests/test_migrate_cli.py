"""`starter.py migrate --grant-worker-role`: how a deployment gives its workers the least-privileged role."""

from __future__ import annotations

import uuid

from tests.test_cleanup_input import run_cli


async def test_migrate_grants_the_worker_role_to_an_existing_login(pool, settings):
    login = f"worker_login_{uuid.uuid4().hex[:8]}"
    await pool.execute(f"CREATE ROLE {login} LOGIN")
    try:
        done = run_cli(settings, "migrate", "--grant-worker-role", login, "--json")
        assert done.returncode == 0, done.stderr
        assert await pool.fetchval("SELECT pg_has_role($1, 'cleanup_worker', 'member')", login)
        assert not await pool.fetchval("SELECT has_table_privilege($1, 'accounts', 'TRUNCATE')", login), (
            "membership gives rows, not DDL"
        )

        missing = run_cli(settings, "migrate", "--grant-worker-role", "no_such_login_xyz")
        assert missing.returncode == 2 and "no database role named 'no_such_login_xyz'" in missing.stderr
        bad = run_cli(settings, "migrate", "--grant-worker-role", 'x"; DROP TABLE accounts; --')
        assert bad.returncode == 2 and "not a role name" in bad.stderr
        assert await pool.fetchval("SELECT count(*) FROM accounts") == 0
    finally:
        await pool.execute(f"REVOKE cleanup_worker FROM {login}")
        await pool.execute(f"DROP ROLE {login}")
