"""The README's "From Python" example runs as written: its block, unchanged, against the test's
Temporal and Postgres (through the environment, as `Settings.from_env()` reads it), with a worker,
for the account it names. Real Temporal, real Postgres."""

from __future__ import annotations

import ast
import contextlib
import io
import re

from temporalio.service import RPCError

from core.config import PROJECT_ROOT

BLOCK = re.compile(r"## From Python\n.*?```python\n(?P<code>.*?)```", re.S)


def readme_example() -> str:
    match = BLOCK.search((PROJECT_ROOT / "README.md").read_text())
    assert match is not None, "README.md has a '## From Python' section with a python block"
    return match["code"]


async def test_the_readme_python_example_runs_as_written(client, pool, settings, worker, monkeypatch):
    code = readme_example()
    (account,) = set(re.findall(r'"(6f1c2a9e-[^"]*)"', code))
    await pool.execute("SELECT set_deadline($1, now() + interval '1 day')", account)
    monkeypatch.setenv("TEMPORAL_ADDRESS", settings.temporal_address)
    monkeypatch.setenv("DATABASE_URL", settings.database_url)
    monkeypatch.setenv("TEMPORAL_TASK_QUEUE", settings.task_queue)
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        await eval(compile(code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), namespace)
    started = namespace["started"]
    await namespace["pool"].close()  # type: ignore[attr-defined]
    with contextlib.suppress(RPCError):
        await client.get_workflow_handle(started.workflow_id).terminate(reason="test over")  # type: ignore[attr-defined]
    assert printed.getvalue().split() == ["True", "sleeping"], printed.getvalue()
