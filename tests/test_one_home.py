"""One front door, one home per default: every public function of the product takes at most eight
parameters (options travel in one request model, e.g. cleanup.inputs.StartCleanup), the product
reads the environment only in core/config.py, and each default of a cleanup is defined once."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from cleanup.inputs import CleanupScope, StartCleanup, cleanup_input
from core.config import CleanupDefaults, Settings

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = [  # the product (what a docs page may name as read), as tests/test_docs.py takes it too
    "core",
    "budget",
    "cleanup",
    "ledger",
    "outbox",
    "workflows",
    "activities",
    "deadline_cleanup",
    "worker.py",
    "starter.py",
]
# Every product file is checked (the load budget included, in budget/).
NOT_YET: tuple[str, ...] = ()
MAX_PARAMETERS = 8
# The one module that reads the environment (Settings.from_env), and the test-only switches.
READS_ENVIRONMENT = {"core/config.py"}


def product_files() -> Iterator[tuple[str, ast.Module]]:
    for name in PRODUCT:
        path = ROOT / name
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            relative = file.relative_to(ROOT).as_posix()
            if relative not in NOT_YET:
                yield relative, ast.parse(file.read_text(encoding="utf-8"))


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")])


def test_no_public_function_takes_more_than_eight_parameters() -> None:
    over = [
        f"{file}: {node.name} takes {parameters(node)}"
        for file, tree in product_files()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
        and parameters(node) > MAX_PARAMETERS
    ]
    assert not over, "group the options in a request model: " + "; ".join(over)


def reads_environment(tree: ast.Module) -> list[int]:
    """Lines that name os.environ, os.getenv or os.putenv (or import them from os)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            found.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "getenv", "putenv"}:
                found.append(node.lineno)
    return found


def test_only_the_settings_module_reads_the_environment() -> None:
    readers = [
        f"{file}:{line}"
        for file, tree in product_files()
        if file not in READS_ENVIRONMENT
        for line in reads_environment(tree)
    ]
    assert not readers, "read it in core/config.py and pass the settings down: " + ", ".join(readers)


def test_no_module_reads_a_setting_at_call_time() -> None:
    """Library code is given its settings (core.db, core.roles included): none imports a reader of
    the environment from core.config, whose only reader is Settings.from_env."""
    callers = [
        f"{file}:{node.lineno}"
        for file, tree in product_files()
        if file not in READS_ENVIRONMENT
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "core.config"
        and {a.name for a in node.names} & {"read", "read_value", "environment"}
    ]
    assert not callers, "take the settings as an argument: " + ", ".join(callers)


def test_a_manual_cleanup_and_the_planners_take_the_same_defaults() -> None:
    defaults = CleanupDefaults()
    manual = cleanup_input(CleanupScope("cleanup-cohort-x", _instant()), StartCleanup(deadline=_instant()), defaults)
    planned = cleanup_input(
        CleanupScope("cleanup-bucket-x", _instant(), deadline_until=_instant(1)), StartCleanup(), defaults
    )
    for input in (manual, planned):
        assert (input.partitions, input.max_parallel_partitions, input.batch_size) == (
            defaults.partitions,
            defaults.max_parallel_partitions,
            defaults.batch_size,
        )
    assert Settings().cleanup.defaults == defaults


def test_each_default_of_a_cleanup_is_written_once() -> None:
    """The numbers of CleanupDefaults appear as a literal nowhere else in the cleanup's code: the
    workflow input has no defaults of its own, the CLI's flags default to None (the settings')."""
    defaults = CleanupDefaults()
    watched = {defaults.partitions, defaults.max_parallel_partitions, defaults.batch_size, defaults.claim_chunk_size}
    elsewhere = []
    for file, tree in product_files():
        if file == "core/config.py" or not file.startswith(("cleanup/", "workflows/", "activities/")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg in ("default", "batch_size", "partitions"):
                value = node.value
                if isinstance(value, ast.Constant) and value.value in watched:
                    elsewhere.append(f"{file}:{value.lineno}")
    assert not elsewhere, "take it from core.config.CleanupDefaults: " + ", ".join(elsewhere)


def _instant(seconds: int = 0):
    from datetime import UTC, datetime, timedelta

    return datetime(2026, 12, 4, tzinfo=UTC) + timedelta(seconds=seconds)
