"""The layout holds: named SQL is all used and all there, core imports no job, no import cycles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp

from core.config import PROJECT_ROOT
from core.queries import load

PACKAGES = [
    "core",
    "budget",
    "cleanup",
    "ledger",
    "outbox",
    "deadline_cleanup",
    "devstack",
    "demo",
    "workflows",
    "activities",
    "harness",
    "bench",
]
SOURCES = [p for pkg in PACKAGES for p in (PROJECT_ROOT / pkg).rglob("*.py")] + [
    PROJECT_ROOT / "worker.py",
    PROJECT_ROOT / "starter.py",
]
SQL_FILES = [p for pkg in PACKAGES for p in (PROJECT_ROOT / pkg).glob("*.sql")]


def _sql_file_of(call: ast.Call, module: Path) -> Path | None:
    """The file a `load(...)` call reads: `load(__file__)`, `load(cleanup.__file__, "seed.sql")`."""
    if not (isinstance(call.func, ast.Name) and call.func.id == "load" and call.args):
        return None
    anchor = call.args[0]
    filename = "queries.sql"
    if len(call.args) > 1 and isinstance(call.args[1], ast.Constant):
        filename = str(call.args[1].value)
    if isinstance(anchor, ast.Name) and anchor.id == "__file__":
        return module.with_name(filename)
    if isinstance(anchor, ast.Attribute) and isinstance(anchor.value, ast.Name):
        return PROJECT_ROOT / anchor.value.id / filename
    return None


def _uses() -> list[tuple[Path, Path, str, int]]:
    """(module, sql file, query name, line) for every `SQL.name` or `load(...).name` in the code."""
    found = []
    for module in [*SOURCES, *(PROJECT_ROOT / "tests").glob("*.py")]:
        tree = ast.parse(module.read_text())
        bound: dict[str, Path] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                sql = _sql_file_of(node.value, module)
                if sql is not None:
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            bound[target.id] = sql
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            sql = None
            if isinstance(node.value, ast.Name) and node.value.id in bound:
                sql = bound[node.value.id]
            elif isinstance(node.value, ast.Call):
                sql = _sql_file_of(node.value, module)
            if sql is not None and node.attr not in QUERIES_METHODS:
                found.append((module, sql, node.attr, node.lineno))
    return found


# Attributes of core.queries.Queries that are not queries.
QUERIES_METHODS = {"bind", "params"}


def test_every_named_query_used_in_code_exists() -> None:
    missing = [
        f"{m.relative_to(PROJECT_ROOT)}:{line}: {sql.relative_to(PROJECT_ROOT)} has no query {name!r}"
        for m, sql, name, line in _uses()
        if name not in load(str(sql), sql.name)
    ]
    assert not missing, "\n".join(missing)


def test_every_named_query_is_used_by_the_code() -> None:
    used = {(sql.resolve(), name) for m, sql, name, _ in _uses() if "tests" not in m.parts}
    unused = [
        f"{sql.relative_to(PROJECT_ROOT)}: {name}"
        for sql in SQL_FILES
        for name in load(str(sql), sql.name)
        if (sql.resolve(), name) not in used
    ]
    assert SQL_FILES and not unused, "named queries no code uses:\n" + "\n".join(unused)


def test_no_inline_sql_in_the_jobs_and_the_demo() -> None:
    """Statements live in .sql files of named queries; Python code calls them by name. (The one
    exception is cleanup/targets.py, which compiles the declared targets into statements.)"""
    statement = re.compile(r"""["'](SELECT|INSERT|UPDATE|DELETE|WITH)\s""", re.IGNORECASE)
    offenders = [
        f"{p.relative_to(PROJECT_ROOT)}:{i}"
        for pkg in ("cleanup", "ledger", "outbox", "deadline_cleanup", "demo", "activities")
        for p in (PROJECT_ROOT / pkg).rglob("*.py")
        if p != PROJECT_ROOT / "cleanup" / "targets.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if statement.search(line)
    ]
    assert not offenders, offenders


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES)
    cycles = [
        chain
        for module in sorted(graph.modules)
        for imported in graph.find_modules_directly_imported_by(module)
        if (chain := graph.find_shortest_chain(importer=imported, imported=module)) is not None
    ]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_core_imports_no_job_and_no_temporal_layer() -> None:
    graph = grimp.build_graph(*PACKAGES)
    above = tuple(p for p in PACKAGES if p != "core")
    wrong = [
        f"{m} imports {i}"
        for m in graph.find_descendants("core") | {"core"}
        for i in graph.find_modules_directly_imported_by(m)
        if i.split(".")[0] in above
    ]
    assert not wrong, wrong


def test_job_packages_keep_an_empty_init() -> None:
    """So a job's models stay safe to import in the workflow sandbox."""
    for job in ("cleanup", "ledger", "outbox"):
        assert (PROJECT_ROOT / job / "__init__.py").read_text().strip() == ""


# What rots in a comment: an issue number, a benchmark run's label ("run BI", "runs AU-AX"), a
# session's relative age ("last session", "two sessions ago"), a harness finding's number, a page
# that keeps a log. Comments state the invariant and why; the history is in git.
STORY = re.compile(
    r"(?i:\bissues? #?\d+|\b(?:this|last|previous|next) session\b|sessions? ago\b|\bharness finding"
    r"|\bfinding \d+|BENCHMARKS\.md)|\bruns? (?!ID\b|N\b)[A-Z]{1,2}(?:-[A-Z]{1,2})?\b"
)
CODE_SUFFIXES = {".py", ".sql", ".sh", ".toml", ".yml", ".yaml"}


def test_no_code_tells_the_story_of_a_run_an_issue_or_a_session() -> None:
    """Docstrings and comments say why in their own words; labels of runs, issues and sessions rot."""
    roots = [*PACKAGES, "tests", "harness", "bench", "deploy", "core/sql/migrations"]
    files = {p for r in roots for p in (PROJECT_ROOT / r).rglob("*") if p.suffix in CODE_SUFFIXES}
    files |= {PROJECT_ROOT / "worker.py", PROJECT_ROOT / "starter.py", PROJECT_ROOT / "dev"}
    offenders = [
        f"{p.relative_to(PROJECT_ROOT)}:{i}: {line.strip()}"
        for p in sorted(files - {Path(__file__).resolve()})
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if STORY.search(line.replace("\\b", ""))
    ]
    assert not offenders, "\n".join(offenders)


async def test_workflows_call_only_registered_activities_by_their_name_constants(pool) -> None:
    """A misspelt activity name fails here, not in production (where it would be retried forever)."""
    import importlib

    from temporalio.activity import _Definition

    import workflows
    from worker import build_activities

    registered: set[str] = set()
    for fn in await build_activities(pool):
        definition = _Definition.from_callable(fn)  # type: ignore[arg-type]
        if definition is not None and definition.name:
            registered.add(definition.name)
    problems = []
    for path in (PROJECT_ROOT / "workflows").glob("*.py"):
        module = importlib.import_module(f"workflows.{path.stem}")
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("execute_activity", "execute_local_activity", "_bookkeeping") or not node.args:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant):
                problems.append(f"{path.name}:{node.lineno}: activity named by a string literal {first.value!r}")
            elif isinstance(first, ast.Name) and first.id != "activity":
                name = getattr(module, first.id, None)
                if name not in registered:
                    problems.append(f"{path.name}:{node.lineno}: {first.id} = {name!r} is not a registered activity")
    assert workflows.ALL_WORKFLOWS and not problems, problems


def test_entry_points_that_talk_to_temporal_leave_without_finalizing() -> None:
    """The SDK's native threads can abort a finalizing interpreter (exit -6 after the work is done,
    3 of 20 CLI runs on a loaded machine): entry points end with `core.process.exit_now`."""
    entry_points = ["starter.py", "worker.py", "devstack/__main__.py", "harness/worker.py", "bench/worker.py"]
    for name in entry_points:
        text = (PROJECT_ROOT / name).read_text()
        main_block = text[text.index('if __name__ == "__main__":') :]
        assert "exit_now(" in main_block and "sys.exit(" not in main_block, name


PRODUCT = ["core", "budget", "cleanup", "ledger", "outbox", "workflows", "activities"]
MAX_LINES, MAX_PARAMETERS = 60, 8
# The line a long function's docstring gives: "Twelve parameters on purpose: ...", "Why eleven parameters: ...".
SAYS_WHY = re.compile(r"(?i)\b\w+ (?:parameters|lines) on purpose\b|\bwhy \w+ (?:parameters|lines)\b")


def test_a_long_function_says_why_it_is_long() -> None:
    """A product function over MAX_LINES lines or MAX_PARAMETERS parameters (self and cls aside) is
    split into named steps, or its docstring says why the long shape is the honest one."""
    modules = [p for pkg in PRODUCT for p in (PROJECT_ROOT / pkg).glob("*.py")]
    modules += [PROJECT_ROOT / "worker.py", PROJECT_ROOT / "starter.py"]
    offenders = []
    for module in sorted(modules):
        for node in ast.walk(ast.parse(module.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            a = node.args
            parameters = [p for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
            if (lines > MAX_LINES or len(parameters) > MAX_PARAMETERS) and not SAYS_WHY.search(
                ast.get_docstring(node) or ""
            ):
                where = f"{module.relative_to(PROJECT_ROOT)}:{node.lineno}"
                offenders.append(f"{where} {node.name}: {lines} lines, {len(parameters)} parameters")
    assert not offenders, "\n".join(offenders)
