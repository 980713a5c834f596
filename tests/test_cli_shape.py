"""One CLI shape, checked over the whole parser tree (no server: the fast tier runs it).

A command is a leaf verb carrying only its own flags plus --json; a noun with several verbs is a
group of nested verbs with no flags of its own. So a flag meant for one verb is a usage error on
any other (exit 2), never parsed and silently ignored. Every argument and command says what it is,
and an argument read from the environment too names its variable."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import starter
import worker
from core.cli import CliParser

# Commands whose arguments their own parser reads (starter.main passes them on).
PASSTHROUGH = {"worker": worker.build_parser}
# A worker is a process, not a command with a result: its JSON is its logs (--log-format json).
NO_RESULT = {("worker",)}
GLOBAL_FLAGS = {"--temporal-address", "--namespace", "--task-queue", "--database-url"}
ENV_NAMED = re.compile(r"\(env: ([A-Z][A-Z0-9_]*)[;)]")


def verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }


def tree(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with its path of verbs, groups first; a passthrough command by
    the parser that reads its arguments."""
    yield path, parser
    for name, sub in verbs(parser).items():
        if not path and name in PASSTHROUGH:
            yield (name,), PASSTHROUGH[name]()
        else:
            yield from tree(sub, (*path, name))


def leaves(parser: argparse.ArgumentParser) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return {path: p for path, p in tree(parser) if path and not verbs(p)}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def minimal_argv(parser: argparse.ArgumentParser) -> list[str]:
    """What a leaf needs to parse: each required positional and flag, with a value its type takes."""

    def sample(action: argparse.Action) -> list[str]:
        value = [str(next(iter(action.choices)))] if action.choices else ["1"]
        return value if not action.option_strings else [action.option_strings[0], *value]

    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings and action.nargs not in ("?", "*", argparse.SUPPRESS):
            argv += sample(action)
        elif action.option_strings and action.required:
            argv += sample(action)
    for group in parser._mutually_exclusive_groups:
        if group.required:
            argv += sample(group._group_actions[0])
    return argv


def parse(argv: list[str]) -> tuple[int | str | None, str]:
    """(None, "") when argv parses; else the exit code and what was printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            PARSER.parse_args(argv)
        except SystemExit as exit:
            return exit.code, err.getvalue()
    return None, ""


PARSER = starter.build_parser()
LEAVES = leaves(PARSER)
OWN = {path: p for path, p in LEAVES.items() if not (len(path) == 1 and path[0] in PASSTHROUGH)}


NOUNS = {"migrate", "cleanup", "account", "planner", "targets", "schedule", "ledger", "outbox", "budget"}


def test_the_tree_has_groups_and_verbs() -> None:
    groups = {path for path, p in tree(PARSER) if path and verbs(p)}
    assert {(noun,) for noun in NOUNS} <= groups
    assert ("outbox", "relay", "start") in LEAVES and ("migrate", "sql") in LEAVES
    assert {("account", v) for v in ("renew", "hold", "release", "history", "dismiss")} <= set(LEAVES)
    assert {("cleanup", v) for v in ("start", "status", "list", "failed", "retry", "prune")} <= set(LEAVES)


def test_the_top_level_is_nouns_plus_status_and_worker() -> None:
    """About a dozen commands at the top: the nouns, `status` of any run, and the worker process."""
    assert set(verbs(PARSER)) == NOUNS | {"status", "worker"}


@pytest.mark.parametrize("alias", sorted(starter.ALIASES))
def test_every_alias_is_an_old_spelling_of_a_verb_and_runs_it(alias: str) -> None:
    """An alias is not a command of the tree (--help lists the nouns); main spells it as the verb it
    stands for, with whatever precedes it (the global options) and follows it (the verb's own)."""
    new = starter.ALIASES[alias]
    assert alias not in verbs(PARSER) and new in OWN
    leaf = OWN[new]
    argv = ["--temporal-address", "127.0.0.1:1", alias, *minimal_argv(leaf), "--json"]
    expanded = starter.expand_alias(PARSER, argv)
    assert expanded == ["--temporal-address", "127.0.0.1:1", *new, *minimal_argv(leaf), "--json"]
    assert PARSER.parse_args(expanded).handler is leaf.get_default("handler")
    assert starter.expand_alias(PARSER, ["--database-url=x", alias])[1:] == list(new)


def test_cleanup_alone_starts_a_cleanup_as_before() -> None:
    parsed = PARSER.parse_args(["cleanup", "--deadline", "2026-11-01T09:00:00Z", "--wait"])
    assert parsed.handler is OWN[("cleanup", "start")].get_default("handler") and parsed.wait


@pytest.mark.parametrize("path", [p for p, _ in tree(PARSER)], ids=lambda p: " ".join(p) or "(top)")
def test_every_argument_and_command_has_help(path: tuple[str, ...]) -> None:
    parser = dict(tree(PARSER))[path]
    missing = [
        action.dest
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help and action.help.strip())
    ]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            missing += [f"command {c.dest}" for c in action._choices_actions if not (c.help and c.help.strip())]
    assert not missing, f"{' '.join(path) or 'the top level'}: no help for {missing}"


@pytest.mark.parametrize("path", sorted(set(LEAVES) - NO_RESULT), ids=" ".join)
def test_every_command_takes_json(path: tuple[str, ...]) -> None:
    assert "--json" in flags(LEAVES[path]), f"{' '.join(path)} has no --json"


def test_every_option_with_an_environment_variable_names_it() -> None:
    for parser in (PARSER, worker.build_parser()):
        for action in parser._actions:
            if GLOBAL_FLAGS & set(action.option_strings):
                assert ENV_NAMED.search(action.help or ""), action.option_strings
    from tests.test_docs import _product_text

    product = _product_text()
    named = {m for _, p in tree(PARSER) for a in p._actions for m in ENV_NAMED.findall(a.help or "")}
    assert named and not sorted(n for n in named if n not in product), "help names variables nothing reads"


@pytest.mark.parametrize("path", sorted(OWN), ids=" ".join)
def test_no_verb_takes_another_verbs_flag(path: tuple[str, ...]) -> None:
    leaf = OWN[path]
    base = [*path, *minimal_argv(leaf)]
    assert parse(base) == (None, ""), f"{base} should parse"
    # Its siblings' flags, and every other verb's too: none belongs to this verb.
    siblings = [p for other, p in OWN.items() if other != path]
    foreign = {
        a.option_strings[0]: a
        for p in siblings
        for a in p._actions
        if a.option_strings and not set(a.option_strings) & flags(leaf)
    }
    for flag, action in sorted(foreign.items()):
        argv = [*base, flag] if action.nargs == 0 else [*base, flag, "1"]
        code, err = parse(argv)
        assert code == 2 and "unrecognized arguments" in err, f"{' '.join(argv)}: {code} {err}"


@pytest.mark.parametrize(
    "argv",
    [
        ["ledger", "--payments", "5", "status", "2026-10-25"],
        ["ledger", "status", "2026-10-25", "--payments", "5"],
        ["schedule", "describe", "--at", "03:00"],
        ["schedule", "list", "--schedule-id", "x"],
        ["planner", "status", "--reason", "maintenance"],
        ["planner", "resume", "--hold-scheduled"],
        ["budget", "show", "--max-in-flight", "4"],
        ["migrate", "status", "--demo-game"],
        ["migrate", "--demo-game", "status"],
        ["outbox", "redeliver", "--dead", "3"],  # no abbreviation of --dead-since
        ["planner"],  # a group needs its verb
    ],
)
def test_a_flag_of_another_verb_is_a_usage_error_one_json_object_under_json(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        starter.main(["--temporal-address", "127.0.0.1:1", *argv, "--json"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert json.loads(err)["error"] == "bad_input", err
    assert "\n" not in err


@pytest.mark.parametrize("command", ["cleanup", "renew", "status", "list", "migrate"])
def test_cli_help_exists_for_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """In-process: argparse prints the help and exits before any setting is read (the process entry
    point itself, `python starter.py`, is run by tests/test_exit_codes.py)."""
    with pytest.raises(SystemExit) as exited:
        starter.main([command, "--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_migrate_alone_applies_and_its_flags_follow_it() -> None:
    parsed = PARSER.parse_args(["migrate", "--demo-game", "--json"])
    assert parsed.handler is starter.cmd_migrate and parsed.demo_game and parsed.json
    assert PARSER.parse_args(["migrate"]).handler is starter.cmd_migrate
    assert PARSER.parse_args(["migrate", "apply"]).handler is starter.cmd_migrate
    assert PARSER.parse_args(["migrate", "status"]).handler is starter.cmd_migrate_status


def test_nested_parsers_report_errors_as_the_top_level_does() -> None:
    assert all(isinstance(p, CliParser) for path, p in tree(PARSER) if path[:1] not in {(n,) for n in PASSTHROUGH})


def test_the_commands_the_deployment_files_run_parse() -> None:
    import yaml

    root = Path(starter.__file__).resolve().parent
    documents = [yaml.safe_load((root / "docker-compose.yml").read_text())]
    documents += [
        d for f in sorted((root / "deploy" / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
    ]

    def commands(node: object) -> Iterator[list[str]]:
        if isinstance(node, dict):
            command = node.get("command")
            if isinstance(command, list) and command[:1] == ["deadline-cleanup"]:
                yield command[1:]
            for value in node.values():
                yield from commands(value)
        elif isinstance(node, list):
            for value in node:
                yield from commands(value)

    shown = [argv for d in documents for argv in commands(d)]
    assert any(argv[:1] == ["migrate"] for argv in shown) and any(argv[:1] == ["worker"] for argv in shown)
    for argv in shown:
        if argv[0] in PASSTHROUGH:
            PASSTHROUGH[argv[0]]().parse_args(argv[1:])
        else:
            assert parse(argv) == (None, ""), argv


DEVELOPMENT_SIDE = ("devstack", "demo", "harness", "bench")


@pytest.mark.parametrize(
    "argv", [["--help"], ["worker", "--help"], ["migrate", "status", "--help"], ["--database-url", "x", "migrate"]]
)
def test_the_installed_command_never_imports_the_development_side(argv: list[str]) -> None:
    """Run as `deadline-cleanup` runs (starter.console, in a fresh interpreter, whatever the command
    does after parsing): none of the checkout's development packages is ever loaded."""
    code = (
        "import sys, starter\n"
        f"try:\n    starter.main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {DEVELOPMENT_SIDE!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(starter.__file__).parent, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("command", sorted(starter.CHECKOUT_COMMANDS))
def test_the_development_commands_are_the_checkouts_and_say_so(command: str, capsys) -> None:
    """Not in the tree: exit 2 naming where the command went, which is a command there."""
    assert command not in verbs(PARSER)
    assert starter.main([command, "--help"]) == 2
    moved = starter.CHECKOUT_COMMANDS[command]
    assert f"`./dev {moved}` or `python -m devstack {moved}`" in capsys.readouterr().err
    from devstack.cli import build_parser as devstack_parser

    assert set(moved.split("|")) <= set(verbs(devstack_parser()))


def test_the_checkout_commands_have_the_operator_clis_shape() -> None:
    """`python -m devstack`'s commands: leaves with --json and help on every argument, usage errors
    as the operator CLI reports them; the harness reads its own arguments."""
    from devstack.cli import build_parser as devstack_parser
    from harness.cli import build_parser as harness_parser

    for name, leaf in verbs(devstack_parser()).items():
        parser = harness_parser() if name == "harness" else leaf
        assert "--json" in flags(parser), name
        assert all(a.help and a.help.strip() for a in parser._actions), name
        assert name == "harness" or isinstance(leaf, CliParser), name
