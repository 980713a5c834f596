"""Every doc page states only what is there: the files it cites exist, the commands it shows are
commands of the CLI (or of the checkout: `./dev`, `python -m devstack`), and the environment
variables it names are read by the product."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from starter import build_parser
from tests.test_one_home import PRODUCT  # the product files, listed once

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").rglob("*.md")])
# Names a page may mention that are not ours to read: the SDK's, Postgres', the tools'.
FOREIGN_VARIABLES = {"PATH", "HOME", "CI", "PGPASSWORD", "PYTHONPATH", "TEMPORAL_CODEC_ENDPOINT"}
# Besides the product's code, what reads variables: the deployment files and the test tooling.
READERS = ["docker-compose.yml", "Dockerfile", "dev", ".ci/run", "tests/conftest.py", "tests/leftovers.py", "deploy"]

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_PATH = re.compile(
    r"`((?:core|cleanup|ledger|outbox|workflows|activities|devstack|demo|tests|harness|bench|deploy|docs)/[\w./-]+)`"
)
# A command as a page shows it: in backticks, or on a line of a fenced code block.
INLINE_COMMAND = re.compile(r"`(?:python3? )?(?:deadline-cleanup|starter\.py)[ \t]+([a-z][a-z-]*)")
BLOCK_COMMAND = re.compile(r"^[ \t]*(?:\.venv/bin/)?(?:python3? )?(?:deadline-cleanup|starter\.py)[ \t]+([a-z][a-z-]*)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def shown_commands(text: str) -> set[str]:
    shown = set(INLINE_COMMAND.findall(text))
    for block in FENCE.findall(text):
        shown |= {m for line in block.splitlines() for m in BLOCK_COMMAND.findall(line)}
    return shown


# A command of the checkout as a page shows it: `./dev X` (a case of the dev script) or
# `python -m devstack X` (a command of devstack.cli).
DEV_INLINE = re.compile(r"`(\./dev|python3? -m devstack)[ \t]+([a-z][a-z-]*)")
DEV_BLOCK = re.compile(r"^[ \t]*(\./dev|python3? -m devstack)[ \t]+([a-z][a-z-]*)")


def shown_dev_commands(text: str) -> set[tuple[str, str]]:
    shown = set(DEV_INLINE.findall(text))
    for block in FENCE.findall(text):
        shown |= {m for line in block.splitlines() for m in DEV_BLOCK.findall(line)}
    return {("./dev" if entry == "./dev" else "devstack", command) for entry, command in shown}


def dev_commands() -> set[tuple[str, str]]:
    from devstack.cli import build_parser as devstack_parser
    from tests.test_cli_shape import verbs

    cases = re.findall(r"^  ([a-z][a-z|-]*)\)", (ROOT / "dev").read_text(), re.MULTILINE)
    return {("./dev", n) for label in cases for n in label.split("|")} | {
        ("devstack", n) for n in verbs(devstack_parser())
    }


VARIABLE = re.compile(
    r"\b((?:CLEANUP|LEDGER|OUTBOX|PLANNER|DB|TEMPORAL|WORKER|LOAD_BUDGET|METRICS|CODEC|HEALTH|OTEL)_[A-Z0-9_]+|DATABASE_URL)\b"
)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _product_text() -> str:
    """The product's code, plus every variable of the settings tree (a section's variables are
    named by its prefix and the field's name) and each secret's `_FILE` form; the deprecated names
    stand in core/config.py."""
    from core.config import FILE_SUFFIX, variables

    derived = [v.name for v in variables()]
    derived += [v.name + FILE_SUFFIX for v in variables() if v.secret]
    files = [ROOT / p for p in PRODUCT + READERS if (ROOT / p).is_file()]
    for p in PRODUCT + READERS:
        if (ROOT / p).is_dir():
            files += [f for f in sorted((ROOT / p).rglob("*")) if f.suffix in (".py", ".sql", ".yaml", ".yml", ".env")]
    return "\n".join([*derived, *(f.read_text() for f in files)])


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_files_a_page_cites_exist(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    for cited in CITED_PATH.findall(text):
        path = cited.rstrip(".")
        if "*" not in path and "<" not in path and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{_page_id(page)} cites files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_commands_a_page_shows_exist(page: Path) -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    commands = set(sub.choices)  # type: ignore[arg-type]
    shown = shown_commands(page.read_text())
    unknown = sorted(shown - commands)
    assert not unknown, f"{_page_id(page)} shows commands the CLI does not have: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_checkout_commands_a_page_shows_exist(page: Path) -> None:
    unknown = sorted(shown_dev_commands(page.read_text()) - dev_commands())
    assert not unknown, f"{_page_id(page)} shows checkout commands that do not exist: {unknown}"


# The whole command as a page shows it: in backticks, or a line of a fenced block (to its comment).
INLINE_LINE = re.compile(r"`(?:python3? )?(?:deadline-cleanup|starter\.py)[ \t]+([a-z][^`]*)`")
BLOCK_LINE = re.compile(
    r"^[ \t]*(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(?:python3? )?(?:deadline-cleanup|starter\.py)[ \t]+([a-z][^#]*)"
)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")


def shown_command_lines(text: str) -> list[str]:
    lines = INLINE_LINE.findall(text)
    for block in FENCE.findall(text):
        lines += [m for line in block.splitlines() for m in BLOCK_LINE.findall(line)]
    return lines


def command_problems(line: str) -> list[str]:
    """A shown command's verbs must be verbs of the CLI and its flags flags of the verb it names
    (`a|b` shows several verbs: the flags must be each one's)."""
    from tests.test_cli_shape import PASSTHROUGH, flags, verbs

    parser = build_parser()
    words = line.split()
    while words and words[0].startswith("--"):  # the global options and their values
        words = words[2:] if "=" not in words[0] else words[1:]
    leaves = [parser]
    path: list[str] = []
    while all(verbs(p) for p in leaves):
        word = words[0] if words else ""
        if not path and word in PASSTHROUGH:
            leaves, words, path = [PASSTHROUGH[word]()], words[1:], [word]
            break
        names = word.split("|")
        known = verbs(leaves[0])
        default = getattr(leaves[0], "default_verb", None)
        if word and all(n in known for n in names):
            words = words[1:]
        elif default is not None:
            names = [default]  # `migrate --demo-game` is `migrate apply --demo-game`
        elif not all(re.fullmatch(r"[a-z][a-z-]*", n) for n in names):
            break  # a placeholder (`...`, `ID`, `<verb>`) or none: nothing more to check
        else:
            return [f"{' '.join([*path, word])}: no such command (known: {', '.join(known)})"]
        path.append("|".join(names))
        leaves = [verbs(p)[n] for p in leaves for n in names]
    own = set.intersection(*(flags(p) for p in leaves)) | flags(parser)
    return [f"{' '.join(path)} has no {flag}" for flag in FLAG.findall(" ".join(words)) if flag not in own]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_commands_a_page_shows_take_the_flags_shown(page: Path) -> None:
    problems = [p for line in shown_command_lines(page.read_text()) for p in command_problems(line)]
    assert not problems, f"{_page_id(page)} shows commands the CLI refuses: {problems}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_variables_a_page_names_are_read_by_the_product(page: Path) -> None:
    product = _product_text()
    named = set(VARIABLE.findall(page.read_text())) - FOREIGN_VARIABLES
    unknown = sorted(v for v in named if v not in product)
    assert not unknown, f"{_page_id(page)} names settings the product does not read: {unknown}"


def test_every_decision_record_is_numbered_once_in_order() -> None:
    """A newcomer reads the records in order: NNNN-name.md, numbers 1..n with no gap or repeat."""
    names = sorted(p.name for p in (ROOT / "docs" / "decisions").glob("*.md"))
    record = re.compile(r"(\d{4})-[a-z0-9-]+\.md$")
    unnumbered = [n for n in names if not record.match(n)]
    assert not unnumbered, f"unnumbered records: {unnumbered}"
    numbers = [int(m.group(1)) for n in names if (m := record.match(n))]
    assert numbers == list(range(1, len(names) + 1)), f"gaps or repeats: {numbers}"
