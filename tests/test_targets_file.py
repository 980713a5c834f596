"""A mistake in the targets file, as the operator meets it: `targets check` and the worker exit 2
naming the file, the line and the key with the fix, never a traceback, in under a second (no
database is reached: the address given is refused). And what the file may hold: set_columns
constants are values, never SQL; a target set that does not use the new keys keeps its fingerprint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cleanup.targets import CleanupTargets, ColumnDefault, load_targets, sql_constant
from cleanup.targets_file import TargetsFileError, locate
from core.config import PROJECT_ROOT
from tests.game_schema import GAME_TARGETS_FILE

GOOD = """\
# the demo's targets
[[target]]
table = "demo_game.cloud_saves"
match_column = "account_id"
action = "delete"

[[target]]
table = "demo_game.users"
match_column = "id"
action = "anonymize"
hash_columns = ["username"]
"""

# (name, the broken file, its line, what the message must say)
BROKEN = [
    ("acton", GOOD.replace('action = "delete"', 'acton = "delete"'), 5, "unknown key 'acton' (did you mean `action`?)"),
    ("delte", GOOD.replace('"delete"', '"delte"'), 5, "action = 'delte' is not allowed (did you mean `delete`?)"),
    ("targets", GOOD.replace("[[target]]", "[[targets]]", 1), 2, "unknown table [[targets]] (did you mean `target`?)"),
    (
        "hash_colums",
        GOOD.replace("hash_columns", "hash_colums"),
        11,
        "target #2 (demo_game.users): unknown key 'hash_colums' (did you mean `hash_columns`?)",
    ),
    ("syntax", GOOD.replace('match_column = "id"', 'match_column "id"'), 9, "not valid TOML: Expected '='"),
    (
        "set_sql",
        GOOD + 'set_columns = { metadata = { sql = "now()" } }\n',
        12,
        "set_columns.metadata must be a constant (a string, number or boolean) or { default = true }",
    ),
]
REFUSED_DATABASE = "postgresql://nobody@127.0.0.1:1/none"


def run(argv: list[str], targets: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"DATABASE_URL": REFUSED_DATABASE, "CLEANUP_TARGETS_FILE": str(targets)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)


@pytest.mark.parametrize(("name", "text", "line", "says"), BROKEN, ids=[b[0] for b in BROKEN])
def test_targets_check_names_file_line_and_key_with_the_fix(tmp_path, name, text, line, says):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    done = run([sys.executable, "starter.py", "targets", "check", "--file", str(path)], path)
    assert done.returncode == 2, done.stderr
    assert f"{path}:{line}: " in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    # Judged before any connection: the refused database is never reached (no exit 75, no wait).
    assert "127.0.0.1:1" not in done.stderr and "DATABASE_URL" not in done.stderr


def test_the_worker_refuses_a_broken_targets_file_the_same_way(tmp_path):
    name, text, line, says = BROKEN[0]
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    done = run([sys.executable, "worker.py", "--temporal-address", "127.0.0.1:1"], path)
    assert done.returncode == 2, done.stderr
    assert f"{path}:{line}: " in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_an_unreadable_targets_file_is_named(tmp_path):
    with pytest.raises(TargetsFileError, match=r"missing\.toml: cannot read the targets file"):
        load_targets(tmp_path / "missing.toml")


def test_a_set_constant_is_quoted_as_a_literal_never_sql():
    assert sql_constant("{}") == "E'{}'"
    assert sql_constant("x'); DROP TABLE t; --") == "E'x''); DROP TABLE t; --'"
    assert sql_constant("a\\'b") == "E'a\\\\''b'"
    assert (sql_constant(True), sql_constant(0), sql_constant(ColumnDefault(default=True))) == (
        "E'true'",
        "E'0'",
        "DEFAULT",
    )
    users = {"table": "game.users", "match_column": "id", "action": "anonymize"}
    with pytest.raises(ValidationError, match="NUL"):
        CleanupTargets.model_validate({"target": [users | {"set_columns": {"bio": "a\0b"}}]})
    with pytest.raises(ValidationError, match="listed twice"):
        CleanupTargets.model_validate({"target": [users | {"null_columns": ["bio"], "set_columns": {"bio": ""}}]})
    with pytest.raises(ValidationError, match="match column 'id' cannot be anonymized"):
        CleanupTargets.model_validate({"target": [users | {"random_columns": ["id"]}]})


def test_a_target_set_without_the_new_keys_keeps_its_fingerprint():
    """Recorded fingerprints (a cleanup's, the workers') stay those of the same targets."""
    assert load_targets(GAME_TARGETS_FILE).fingerprint == "c6f164ee35cf52ad"
    assert load_targets().fingerprint == "12c113a11c2892c7"


def test_locate_finds_the_key_in_the_nth_table_else_its_header():
    assert locate(GOOD, ("target", 1, "hash_columns")) == 11
    assert locate(GOOD, ("target", 1, "archive_table")) == 7  # absent: the table's header
    assert locate(GOOD, ("target", 0)) == 2
    assert locate(GOOD, ()) == 1
