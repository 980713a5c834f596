"""Through a database outage: log lines name the right run (or none), one line per outage and per
recovery, the real error kept when a transaction's exit fails, status answering without Postgres."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import asyncpg
import pytest
from temporalio.client import Client

import starter
from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from core import db, logs, outage
from core.cli import EXIT_UNAVAILABLE
from core.errors import ConnectionLostBeforeCommit
from devstack.cli import main as devstack_main
from devstack.embedded import free_port
from tests import logging_workflow as lw
from tests.helpers import deadline_in
from worker import build_worker


class Capture(logging.Handler):
    def __init__(self, *filters: logging.Filter) -> None:
        super().__init__()
        self.setFormatter(logs.JsonFormatter())
        self.addFilter(logs.TemporalContextFilter())
        for f in filters:
            self.addFilter(f)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(self.format(record)))


async def test_a_line_logged_after_its_activity_finished_carries_none_of_its_ids(
    client: Client, task_queue: str
) -> None:
    capture = Capture()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.INFO)
    logs.ids_as_fields_only()
    text = uuid.uuid4().hex[:8]
    workflow_id = f"lingering-{text}"
    try:
        worker = build_worker(client, task_queue, [lw.spawn_lingering_task], extra_workflows=[lw.LingeringTaskWorkflow])
        async with worker:
            await client.execute_workflow(lw.LingeringTaskWorkflow.run, text, id=workflow_id, task_queue=task_queue)
            lw.release_lingering.set()  # the activity has completed: its task logs now
            await asyncio.wait_for(lw.lingering_done.wait(), 60)
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)
    during = [r for r in capture.records if r["message"] == f"plain logger in an activity: {text}"]
    assert during and during[0]["workflow_id"] == workflow_id, "a line written during the activity has its IDs"
    after = [r for r in capture.records if text in r["message"] and "lingering" in r["message"]]
    assert len(after) == 2, capture.records
    for r in after:
        for field in logs.CONTEXT_FIELDS:
            assert field not in r, f"a line written after the activity finished carries {field}: {r}"


def _record(name: str, level: int, msg: str, err: BaseException | None) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": name, "levelno": level, "levelname": logging.getLevelName(level)})
    record.msg = msg
    record.exc_info = (type(err), err, None) if err is not None else None
    return record


def test_an_outage_is_one_line_when_it_starts_and_one_when_it_ends() -> None:
    now = [100.0]
    down = outage.Outage(clock=lambda: now[0])
    retried = outage.RetriedErrorFilter(down, every_seconds=30, clock=lambda: now[0])
    lines = Capture(retried)
    outage_log = logging.getLogger("database")
    outage_log.addHandler(lines)
    old_level = outage_log.level
    outage_log.setLevel(logging.INFO)
    try:
        refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
        passed = []
        for i in range(50):  # 50 tracebacks in 5 s: the pool's reconnects and the failed attempts
            now[0] += 0.1
            rec = _record("asyncpg.pool" if i % 2 else "temporalio.activity", logging.WARNING, "failed", refused)
            if retried.filter(rec):
                passed.append(rec)
        unrelated = _record("worker", logging.WARNING, "a real problem", ValueError("bad"))
        assert retried.filter(unrelated) and unrelated.exc_info is not None, "other errors are left alone"
        now[0] += 3.4
        down.back()
        down.back()  # only once per outage
    finally:
        outage_log.removeHandler(lines)
        outage_log.setLevel(old_level)
    assert len(passed) == 2, "one line per logger per 30 s, the rest counted"
    for rec in passed:
        assert rec.levelno == logging.INFO and rec.exc_info is None
        assert "ConnectionRefusedError" in rec.getMessage()
    messages = [r["message"] for r in lines.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("database unavailable at ") and messages[0].endswith(", retrying")
    assert "ConnectionRefusedError" in messages[0]
    assert messages[1] == "database back after 8.3 s (50 retried errors logged below WARNING)"
    assert lines.records[0]["level"] == "WARNING" and lines.records[1]["level"] == "INFO"


async def test_a_transaction_whose_connection_dies_raises_the_real_error(db_url: str) -> None:
    admin = await asyncpg.connect(db_url, server_settings=db.service_settings())
    conn = await asyncpg.connect(
        db_url, server_settings=db.service_settings()
    )  # not pooled: a pool detaches a connection once it sees it closed
    try:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        with pytest.raises(Exception) as caught:
            async with db.transaction(conn):
                await conn.execute("SELECT 1")
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
                for _ in range(100):  # the server closes the socket; the next statement notices
                    await conn.execute("SELECT pg_sleep(0.05)")
    finally:
        await admin.close()
        conn.terminate()
    err = caught.value
    assert db.connection_lost(err), repr(err)
    assert "Transaction.__aexit__" not in str(err), "the rollback's error does not hide the real one"


async def test_a_connection_closed_before_commit_says_so(db_url: str) -> None:
    admin = await asyncpg.connect(db_url, server_settings=db.service_settings())
    conn = await asyncpg.connect(db_url, server_settings=db.service_settings())
    try:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        with pytest.raises(ConnectionLostBeforeCommit) as caught:
            async with db.transaction(conn):
                await conn.execute("SELECT 1")
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
                for _ in range(600):  # asyncpg notices the closed socket on its own
                    if conn.is_closed():
                        break
                    await asyncio.sleep(0.05)
                assert conn.is_closed()
    finally:
        await admin.close()
        conn.terminate()
    assert db.connection_lost(caught.value), "retried like any lost connection"
    assert "before COMMIT" in str(caught.value)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """starter.main, or devstack's for `seed`."""
    code = (devstack_main if "seed" in argv else starter.main)(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("worker")
async def test_status_and_list_answer_from_temporal_while_the_database_is_down(
    client: Client, pool: asyncpg.Pool, task_queue: str, temporal_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline_in(3600), allow_empty=True))
    dead = f"postgresql://app:pw-not-shown@127.0.0.1:{free_port()}/gone"
    common = ["--temporal-address", temporal_address, "--task-queue", task_queue, "--database-url", dead]

    def run(*argv: str) -> tuple[int, str, str]:
        return _main(capsys, *common, *argv)

    code, out, err = await asyncio.to_thread(run, "status", started.workflow_id, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["temporal_status"] == "RUNNING" and data["phase"] == "sleeping", data
    assert data["settled"] is None and "unavailable" in data["database"] and "127.0.0.1" in data["database"]
    assert "not shown" in data["database"] and "pw-not-shown" not in out

    code, out, err = await asyncio.to_thread(run, "status", started.workflow_id)
    assert code == 0, err
    assert "RUNNING" in out and "is unavailable" in out and "not shown" in out, out

    code, out, err = await asyncio.to_thread(run, "list", "--json")
    assert code == 0, err
    assert started.workflow_id in {r["workflow_id"] for r in json.loads(out)}

    code, out, err = await asyncio.to_thread(run, "planner", "status", "--json")
    assert code == 0, err
    planner = json.loads(out)
    assert "is unavailable" in planner["database"] and "next deadlines" in planner["database"], planner
    code, out, err = await asyncio.to_thread(run, "planner", "status")
    assert code == 0 and "is unavailable" in out, (out, err)

    for argv in (("failed",), ("seed", "--accounts", "3", "--deadline", "2027-01-01T09:00:00Z"), ("migrate",)):
        code, out, err = await asyncio.to_thread(run, *argv)
        assert code == EXIT_UNAVAILABLE, (argv, code, err)
        assert "database postgresql://app:***@127.0.0.1" in err and "is unavailable" in err, err
        assert "pw-not-shown" not in err and "Traceback" not in err


async def test_an_attempt_whose_database_restarts_runs_again_when_it_is_back(client: Client, task_queue: str) -> None:
    from harness.private_pg import PrivatePostgres

    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    lines = Capture()
    outage_log = logging.getLogger("database")
    outage_log.addHandler(lines)
    old_level = outage_log.level
    outage_log.setLevel(logging.INFO)
    pool = await db.create_pool(pg.admin_url, max_size=2, on_connect=outage.OUTAGE.back)
    try:
        lw.database_step_runs.clear()
        lw.database_step_started.clear()

        async def body() -> None:
            if len(lw.database_step_runs) == 1:
                await pool.fetchval("SELECT pg_sleep(60)")  # the server crashes under it
            else:
                await pool.fetchval("SELECT 1")

        lw.database_step_body = body
        worker = build_worker(
            client, task_queue, [lw.database_step], extra_workflows=[lw.DatabaseStepWorkflow], pool=pool
        )
        async with worker:
            handle = await client.start_workflow(
                lw.DatabaseStepWorkflow.run, id=f"db-step-{uuid.uuid4().hex[:8]}", task_queue=task_queue
            )
            await asyncio.wait_for(lw.database_step_started.wait(), 60)
            await asyncio.sleep(0.3)
            await asyncio.to_thread(pg.crash)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(pg.restart)
            runs = await asyncio.wait_for(handle.result(), 120)
    finally:
        lw.database_step_body = None
        outage_log.removeHandler(lines)
        outage_log.setLevel(old_level)
        pool.terminate()
        await asyncio.to_thread(pg.close)
    assert runs == [1, 1], "ran again inside attempt 1 (the retry policy allows no second attempt)"
    messages = [r["message"] for r in lines.records]
    assert any(m.startswith("database unavailable at ") for m in messages), messages
    assert any(m.startswith("database back after ") for m in messages), messages
    for r in lines.records:
        assert "workflow_id" not in r, "the outage is the process's, not the activity's"
