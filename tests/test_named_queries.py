"""Named query parameters: rewritten to `$n` once at load, bound by name at the call."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cleanup
from core.config import PROJECT_ROOT
from core.queries import bind_params, compile_named, load
from tests.test_layout import PACKAGES, SOURCES, _sql_file_of


def test_names_become_positions_outside_strings_comments_and_casts():
    text, params = compile_named("SELECT :a, :b::int, 'x:y', c::text -- :d\n, :a")
    assert text == "SELECT $1, $2::int, 'x:y', c::text -- :d\n, $1"
    assert params == ("a", "b")
    assert bind_params(params, {"b": 2, "a": 1}) == (1, 2)


def test_a_missing_or_unknown_name_is_an_error_at_the_call():
    _, params = compile_named("SELECT :a, :b")
    with pytest.raises(TypeError, match=r"missing \['b'\], unknown \['c'\]"):
        bind_params(params, {"a": 1, "c": 3})


def test_a_query_mixing_positions_and_names_is_refused_at_load():
    with pytest.raises(ValueError, match="mixes"):
        compile_named("SELECT $1, :a")


def test_the_claim_binds_by_name():
    sql = load(cleanup.__file__)
    params = sql.params["claim_chunk"]
    assert set(params) >= {"cleanup_id", "deadline_from", "deadline_until", "namespace"}
    assert f"${len(params)}" in sql.claim_chunk and f"${len(params) + 1}" not in sql.claim_chunk


def _query_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (PROJECT_ROOT / pkg).glob("*.sql"))


@pytest.mark.parametrize("path", _query_files(), ids=lambda p: str(p.relative_to(PROJECT_ROOT)))
def test_every_query_file_loads(path: Path) -> None:
    """The loader refuses a query mixing `$n` and `:name` (and a name defined twice): every file loads."""
    assert load(str(path), path.name), f"{path} holds no named query"


def _positions(text: str) -> set[int]:
    """The `$n` of a statement outside its string literals and comments."""
    return {int(n) for n in re.findall(r"\$(\d+)", re.sub(r"'(?:[^']|'')*'|--[^\n]*", "", text))}


# Files whose queries of three or more parameters name them (the rest stay positional only with one
# or two obvious ones).
NAMED_FILES = [
    "cleanup/queries.sql",
    "cleanup/planner.sql",
    "cleanup/retention.sql",
    "cleanup/history.sql",
    "cleanup/targets.sql",
    "cleanup/grants.sql",
    "outbox/queries.sql",
    "core/sessions.sql",
    "core/fleet.sql",
    "bench/scale.sql",
    "bench/floor.sql",
    "bench/late_data.sql",
    "bench/planner_cohort.sql",
    "bench/game_seed.sql",
    "ledger/queries.sql",
    "budget/budget.sql",
]


@pytest.mark.parametrize("relative", NAMED_FILES)
def test_a_query_of_three_or_more_parameters_names_them(relative: str) -> None:
    path = PROJECT_ROOT / relative
    queries = load(str(path), path.name)
    positional = {
        name: max(_positions(text)) for name, text in queries.items() if not queries.params[name] and _positions(text)
    }
    assert all(n <= 2 for n in positional.values()), positional


def test_a_query_with_named_parameters_is_run_with_its_bound_arguments() -> None:
    """`conn.fetch(SQL.q, *SQL.bind("q", ...))`: a query whose parameters have names never gets
    values by position at its call (a reordered query would take them in the wrong places)."""
    calls = ("execute", "fetch", "fetchrow", "fetchval", "executemany")
    wrong = []
    for module in [*SOURCES, *(PROJECT_ROOT / "tests").glob("*.py")]:
        tree = ast.parse(module.read_text())
        loaded = _loaded_names(tree, module)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls):
                continue
            if not node.args:
                continue
            query, *rest = node.args
            if not (isinstance(query, ast.Attribute) and isinstance(query.value, ast.Name)):
                continue
            file = loaded.get(query.value.id)
            if file is None or not load(str(file), file.name).params.get(query.attr):
                continue
            if not (len(rest) == 1 and isinstance(rest[0], ast.Starred)):
                wrong.append(f"{module.relative_to(PROJECT_ROOT)}:{node.lineno} {query.attr}")
    assert not wrong, "named queries called with positional values:\n" + "\n".join(wrong)


def _loaded_names(tree: ast.Module, module: Path) -> dict[str, Path]:
    """The module's names bound to a loaded `.sql` file (`SQL = load(__file__)`)."""
    loaded: dict[str, Path] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            sql = _sql_file_of(node.value, module)
            loaded |= {t.id: sql for t in node.targets if isinstance(t, ast.Name) and sql is not None}
    return loaded
