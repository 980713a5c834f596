"""A worker that froze (or lost its network) in the middle of a batch must not block its retry.

The harness's zombie scenario (`./dev harness --scenarios zombie`) shows it end to end with real
worker processes; these tests pin the pieces: the worker pool's idle-in-transaction timeout, the
`stop` failpoint (fired by one process only with CLEANUP_FAILPOINTS_ONCE_DIR), the relay's heartbeat
timeout setting.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from core import db
from core.config import PROJECT_ROOT, Settings
from core.errors import is_deterministic
from core.failpoints import ONCE_DIR_ENV
from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from ledger.operations import ReconcileRequest
from outbox.models import RelayBatchSettings
from worker import open_pool


async def test_a_batch_left_open_by_a_frozen_worker_is_ended_and_its_locks_go_to_the_retry(
    db_url: str, pool: asyncpg.Pool
) -> None:
    """Without the timeout the retry waits on the zombie's row lock for as long as it stays frozen
    (107 s in the harness's first run, until the zombie was woken); with it, Postgres ends the
    zombie's transaction, the retry gets the row, and the zombie's late COMMIT is refused."""
    await pool.execute("CREATE TABLE zombie_probe (id int PRIMARY KEY, written_by text)")
    await pool.execute("INSERT INTO zombie_probe VALUES (1, 'nobody')")
    zombie_pool = await open_pool(db_url, 1, idle_in_transaction_timeout=1.0)
    try:
        conn = await zombie_pool.acquire()
        tx = conn.transaction()
        await tx.start()
        await conn.execute("UPDATE zombie_probe SET written_by = 'zombie' WHERE id = 1")  # then it freezes

        # The retry's batch takes the same row: it waits until the server ends the zombie's transaction.
        await asyncio.wait_for(pool.execute("UPDATE zombie_probe SET written_by = 'retry' WHERE id = 1"), 60)

        with pytest.raises(Exception) as refused:  # the zombie wakes and commits: too late
            await tx.commit()
        assert db.connection_lost(refused.value) or isinstance(
            refused.value, asyncpg.exceptions.IdleInTransactionSessionTimeoutError
        ), repr(refused.value)
        assert not is_deterministic(refused.value)  # retried, never taken for a bad account
        assert await pool.fetchval("SELECT written_by FROM zombie_probe WHERE id = 1") == "retry"
    finally:
        zombie_pool.terminate()


def test_the_idle_transaction_timeout_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS", raising=False)
    assert Settings.from_env().db_idle_in_transaction_timeout_seconds == 10.0
    monkeypatch.setenv("DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS", "2.5")
    monkeypatch.setenv("WORKER_ACTIVITY_TASK_POLLS", "1")
    monkeypatch.setenv("WORKER_WORKFLOW_TASK_POLLS", "2")
    monkeypatch.setenv("WORKER_STICKY_QUEUE_TIMEOUT_SECONDS", "3")
    s = Settings.from_env()
    assert s.db_idle_in_transaction_timeout_seconds == 2.5
    assert (s.worker_activity_task_polls, s.worker_workflow_task_polls, s.worker_sticky_queue_timeout_seconds) == (
        1,
        2,
        3.0,
    )


HITS_TWICE = "from core import failpoints; failpoints.hit('p'); failpoints.hit('p'); print('went on', flush=True)"


def _spawn(spec: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLEANUP_FAILPOINTS", ONCE_DIR_ENV)}
    env.update(CLEANUP_FAILPOINTS=spec, **(extra_env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", HITS_TWICE],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_stopped(proc: subprocess.Popen[str], within: float = 60) -> bool:
    deadline = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < deadline:
        if _state(proc.pid) == "T":
            return True
        time.sleep(0.02)
    return False


def test_a_stop_failpoint_freezes_the_process_until_it_is_continued() -> None:
    proc = _spawn("p=stop@2")
    try:
        assert _wait_stopped(proc), proc.communicate(timeout=30)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
    assert proc.returncode == 0, err
    assert "went on" in out
    assert "failpoint p: stopping process" in err and "continued" in err


def test_with_a_once_dir_only_the_first_process_fires(tmp_path: Path) -> None:
    once = {ONCE_DIR_ENV: str(tmp_path)}
    first = _spawn("p=stop", once)
    try:
        assert _wait_stopped(first), first.communicate(timeout=30)
        second = _spawn("p=stop", once)  # a retry on another worker passes the same place
        out, err = second.communicate(timeout=60)
        assert second.returncode == 0 and "went on" in out, err
        assert (tmp_path / "p").read_text().strip() == str(first.pid)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        first.communicate(timeout=60)
    assert first.returncode == 0


def test_an_unknown_failpoint_action_is_refused() -> None:
    proc = _spawn("p=freeze")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "unknown action 'freeze'" in err


def test_the_relay_heartbeat_timeout_is_a_setting_with_a_short_default() -> None:
    """The relay heartbeats while its requests are in flight, so its timeout need not cover one."""
    assert RelayBatchSettings().heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    assert (
        RelayBatchSettings(request_timeout_seconds=1, lease_seconds=4, heartbeat_timeout_seconds=3).heartbeat_timeout
        == 3
    )


async def test_a_shard_waiting_for_its_lock_at_the_start_keeps_heartbeating(client, pool, db_url, task_queue, worker):
    """Another attempt of the shard (a zombie, until Postgres ends its idle transaction; the night
    run beside a re-check) holds the shard lock: the new attempt waits for it before its first batch.
    Before the fix that wait did not heartbeat, so it was taken for a dead worker after the
    heartbeat timeout and retried, attempt after attempt, for as long as the lock was held."""
    from datetime import date

    from ledger.operations import start_reconciliation
    from tests.helpers import wait_until
    from tests.ledger_helpers import id_prefix, seed_day
    from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

    day = date(2026, 10, 26)
    await seed_day(pool, day, payments=200, shards=2)
    holder = await asyncpg.connect(db_url, server_settings=db.service_settings())
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT pg_advisory_xact_lock(hashtext('ledger-shard:' || $1::date::text), 0)", day)
        started = await start_reconciliation(
            client,
            pool,
            task_queue,
            ReconcileRequest(business_date=day, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue)),
        )
        handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)

        async def waited_past_three_heartbeat_timeouts() -> bool:
            waiting = await pool.fetchval(
                "SELECT max(extract(epoch FROM now() - query_start)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ledger-shard%'"
            )
            return waiting is not None and waiting > 6.0

        await wait_until(waited_past_three_heartbeat_timeouts, 60)
    finally:
        await holder.close()  # releases the lock
    result = await asyncio.wait_for(handle.result(), 90)
    assert [s.attempt for s in result.shards] == [1, 1], "the waiting shard was retried as if dead"
    assert result.settlement.balanced
