"""The README's "From Python" block runs as written: three lines after the import, against a real
Temporal, a real database and a worker, the environment naming them as a deployment's does."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

from cleanup.operations import cleanup_status
from core.config import Settings
from tests.helpers import deadline_in, seed

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_ACCOUNT = "6f1c2a9e-..."


def from_python_block() -> str:
    section = README.read_text().split("## From Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README has no Python block under From Python"
    return match.group(1)


def test_the_block_is_three_lines_after_the_import() -> None:
    lines = [line for line in from_python_block().splitlines() if line.strip()]
    imports = [line for line in lines if line.startswith(("from ", "import "))]
    assert len(imports) == 1 and len(lines) - len(imports) == 3, lines


async def test_the_readme_python_block_cleans_an_account(client, pool, settings: Settings, worker, monkeypatch):
    [account] = await seed(pool, deadline_in(2), 1)
    monkeypatch.setenv("TEMPORAL_ADDRESS", str(settings.temporal_address))
    monkeypatch.setenv("DATABASE_URL", str(settings.database_url))
    monkeypatch.setenv("TEMPORAL_TASK_QUEUE", settings.task_queue)
    code = from_python_block().replace(EXAMPLE_ACCOUNT, account)
    assert account in code, "the block names no account to clean"
    # Run as the body of a coroutine, which hands back the cleanup the block started.
    body = "async def readme():\n" + "".join(f"    {line}\n" for line in code.splitlines())
    body += "    return started.workflow_id\n"
    scope: dict[str, Any] = {}
    exec(compile(body, str(README), "exec"), scope)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        workflow_id = await scope["readme"]()
    assert printed.getvalue().strip(), "the block printed no phase"
    await client.get_workflow_handle(workflow_id).result()
    report = await cleanup_status(client, pool, workflow_id)
    assert report.settled and report.settlement is not None and report.settlement.cleaned == 1, report
