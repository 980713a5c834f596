"""Named query parameters: rewritten to `$n` once at load, bound by name at the call."""

from __future__ import annotations

import pytest

import cleanup
from core.queries import bind_params, compile_named, load


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
