"""The settings tree (core/config.py): every variable declared once and read by one source; each
secret also from `NAME_FILE`; numbers finite and in range or an error naming the variable; the
reference page generated from the declarations and current (`python -m tests.test_configuration`
writes it). No server needed."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import SecretStr
from pydantic.fields import FieldInfo

import starter
import worker
from cleanup.targets import anonymize_key_pads
from core import config
from core.config import (
    FILE_SUFFIX,
    PROJECT_ROOT,
    BudgetSettings,
    CleanupSettings,
    ConfigError,
    LedgerSettings,
    OutboxSettings,
    PlannerSettings,
    Settings,
    Variable,
    variables,
)

PAGE = PROJECT_ROOT / "docs" / "configuration.md"
SECRETS = [v for v in variables() if v.secret]
NUMBERS = [v for v in variables() if {int, float} & {v.field.annotation, *get_args(v.field.annotation)}]


def _value(settings: Settings, var: Variable) -> Any:
    found: Any = settings
    for key in var.path:
        found = getattr(found, key)
    return found.get_secret_value() if isinstance(found, SecretStr) else found


# Variables read by others than the tree: temporalio.envconfig's profile, the OpenTelemetry SDK, and
# the development and test tooling (never needed in a deployment).
OTHER_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("TEMPORAL_CONFIG_FILE", "temporal", "a temporal.toml with connection profiles (temporalio.envconfig)"),
    ("TEMPORAL_PROFILE", "temporal", "the profile of that file to use (default: `default`)"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "observability", "where traces go (the OpenTelemetry SDK's variable)"),
    ("OTEL_SERVICE_NAME", "observability", "the service name on traces (the OpenTelemetry SDK's variable)"),
    ("CLEANUP_FAILPOINTS", "development", "failpoints to arm (tests and the fault harness: core/failpoints.py)"),
    ("CLEANUP_FAILPOINTS_ENABLED", "development", "`1`: failpoints may be armed at all"),
    ("CLEANUP_FAILPOINTS_FILE", "development", "failpoints shared by the processes of a run"),
    ("CLEANUP_FAILPOINTS_ONCE_DIR", "development", "where a failpoint armed once records that it fired"),
    ("CLEANUP_DEBUG", "development", "print the traceback of an unexpected error"),
    ("PROGRESS", "development", "`1`: progress bars even when stderr is not a terminal"),
)
SECTIONS = (
    "temporal", "database", "worker", "planner", "cleanup", "ledger", "outbox", "budget", "observability", "codec",
    "development",
)  # fmt: skip


def _type_name(annotation: object) -> str:
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        return _type_name(args[0])
    if get_origin(annotation) is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if get_origin(annotation) in (Union, getattr(__import__("types"), "UnionType", Union)):
        return " \\| ".join(_type_name(a) for a in args)
    if annotation is bool:
        return "on/off"
    if annotation is SecretStr:
        return "str"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(var: Variable) -> str:
    value = var.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`on`" if value else "`off`"
    if isinstance(value, Path):
        return f"`{value.relative_to(PROJECT_ROOT)}`" if value.is_relative_to(PROJECT_ROOT) else f"`{value}`"
    return f"`{value}`"


def _internal_fields(section: str) -> list[tuple[str, FieldInfo]]:
    """The fields of a section's model that no variable sets (`internal`)."""
    found: list[tuple[str, FieldInfo]] = []
    for model in (PlannerSettings, CleanupSettings, LedgerSettings, OutboxSettings, BudgetSettings):
        if model.SECTION != section:
            continue
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("internal"):
                found.append((name, field))
    return found


# The old names temporal_profile still reads, by the name that replaced them.
DEPRECATED_NAMES = {new: old for old, new in (config.DEPRECATED_TEMPORAL_NAMES | config.DEPRECATED_NAMES).items()}


def render() -> str:
    """docs/configuration.md: every variable of the tree by section, then those read by others."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from core/config.py by `python -m tests.test_configuration`: "
        "edit the settings, not this page. -->",
        "",
        "Every setting is an environment variable, read once at start-up (`core.config.Settings.from_env`)",
        "into one tree with a section per concern. A malformed, non-finite or out-of-range value stops the",
        "command or worker with exit 2 and a message naming the variable. An empty variable is unset.",
        "",
        "Secrets can also be given as files, the Docker and Kubernetes secrets convention: `NAME_FILE=/path`",
        "reads the secret from that file (surrounding whitespace removed). Setting both `NAME` and",
        "`NAME_FILE` is an error, and so is a file that is missing, unreadable or empty. Printed settings",
        "and logs never show a secret.",
        "",
        "After `./dev up`, TEMPORAL_ADDRESS, DATABASE_URL and TEMPORAL_UI_URL that are unset",
        "are read from the file it wrote (`<CLEANUP_STATE_DIR>/dev/env`); a variable that is set always wins.",
        "",
    ]
    others: dict[str, list[tuple[str, str]]] = {}
    for name, section, description in OTHER_VARIABLES:
        others.setdefault(section, []).append((name, description))
    tree = variables()
    for section in SECTIONS:
        rows = [v for v in tree if v.section == section]
        if not rows and section not in others:
            continue
        lines += [f"## {section}", ""]
        if rows:
            lines += ["| variable | type | default | secret | meaning |", "| --- | --- | --- | --- | --- |"]
            for var in rows:
                secret = f"yes, or `{var.name}{FILE_SUFFIX}`" if var.secret else "no"
                meaning = (var.field.description or "").replace("|", "\\|")
                if var.name in DEPRECATED_NAMES:
                    meaning += f"; deprecated name: `{DEPRECATED_NAMES[var.name]}`"
                type_name = _type_name(var.field.annotation)
                lines.append(f"| `{var.name}` | {type_name} | {_default_text(var)} | {secret} | {meaning} |")
            lines.append("")
        constants = _internal_fields(section)
        if constants:
            lines += ["Constants (no variable sets them; tests and benchmarks set them in Python):", ""]
            lines += [f"- `{n}` = `{f.default}`: {f.description}" for n, f in constants]
            lines.append("")
        if section in others:
            lines += ["Read by others than the settings:", ""]
            lines += [f"- `{name}`: {description}" for name, description in others[section]]
            lines.append("")
    lines.append(f"{len(tree)} settings, {sum(v.secret for v in tree)} of them secrets.")
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def no_dev_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state dir of its own: no `./dev up` file fills in an unset address."""
    monkeypatch.setenv("CLEANUP_STATE_DIR", str(tmp_path / "state"))


def test_the_reference_page_is_generated_from_the_settings_and_current() -> None:
    page = render()
    assert PAGE.read_text(encoding="utf-8") == page, (
        "docs/configuration.md is stale: run .venv/bin/python -m tests.test_configuration"
    )
    for var in variables():
        assert f"`{var.name}`" in page, f"{var.name} is missing from the reference"
    for var in SECRETS:
        assert f"`{var.name}{FILE_SUFFIX}`" in page


def test_names_are_unique_and_every_secret_is_masked() -> None:
    names = [v.name for v in variables()]
    assert len(names) == len(set(names)), "two settings read one variable"
    assert {"DATABASE_URL", "TEMPORAL_API_KEY", "PAYLOAD_ENCRYPTION_KEY", "CLEANUP_ANONYMIZE_KEY"} <= {
        v.name for v in SECRETS
    }
    assert {"MAIL_PROVIDER_TOKEN", "CODEC_SERVER_TOKEN", "PAYLOAD_DECRYPTION_KEYS"} <= {v.name for v in SECRETS}


def test_settings_built_in_python_read_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "from-the-environment")
    monkeypatch.setenv("PLANNER_TICK_SECONDS", "2")
    assert Settings().temporal_namespace == "default" and Settings().planner.tick_seconds == 5.0
    read = Settings.from_env()
    assert read.temporal_namespace == "from-the-environment" and read.planner.tick_seconds == 2.0


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_TASK_QUEUE", "from-the-environment")
    assert Settings.from_env(task_queue="from-the-flag").task_queue == "from-the-flag"
    assert Settings.from_env(task_queue=None).task_queue == "from-the-environment"


@pytest.mark.parametrize("var", SECRETS, ids=lambda v: v.name)
def test_every_secret_is_read_from_its_file(var: Variable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "postgresql://app:fr0m-a-file@db.internal/game" if var.name == "DATABASE_URL" else "fr0m-a-file-16bytes"
    path = tmp_path / "secret"
    path.write_text(secret + "\n")  # as `kubectl create secret --from-file` and Docker write it
    monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv(var.name + FILE_SUFFIX, str(path))
    settings = Settings.from_env()
    assert _value(settings, var) == secret
    assert "fr0m-a-file" not in repr(settings)
    assert "fr0m-a-file" in " ".join(settings.secrets()), "logs are scrubbed of it"


@pytest.mark.parametrize("var", SECRETS, ids=lambda v: v.name)
def test_a_secret_and_its_file_together_are_an_error_naming_both(
    var: Variable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret-in-a-file")
    monkeypatch.setenv(var.name, "s3cret-in-the-variable")
    monkeypatch.setenv(var.name + FILE_SUFFIX, str(path))
    with pytest.raises(ConfigError) as err:
        Settings.from_env()
    message = str(err.value)
    assert var.name in message and var.name + FILE_SUFFIX in message
    assert "s3cret" not in message


def test_a_missing_or_empty_secret_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere"
    monkeypatch.delenv("TEMPORAL_API_KEY", raising=False)
    monkeypatch.setenv("TEMPORAL_API_KEY_FILE", str(missing))
    with pytest.raises(ConfigError, match=re.escape(f"TEMPORAL_API_KEY_FILE: cannot read {missing}")):
        Settings.from_env()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    monkeypatch.setenv("TEMPORAL_API_KEY_FILE", str(empty))
    with pytest.raises(ConfigError, match=r"TEMPORAL_API_KEY_FILE: .* is empty"):
        Settings.from_env()


def test_a_bad_secret_file_exits_2_from_the_worker_and_the_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("DATABASE_URL_FILE", str(tmp_path / "nowhere"))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert worker.main([]) == 2
        assert starter.main(["failed"]) == 2
    finally:
        # The worker's main configured logging onto the stderr captured for this test: a handler
        # left there fails every later record of this process once the capture is closed.
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "DATABASE_URL_FILE" in capsys.readouterr().err


def test_a_secret_of_a_section_reads_its_file_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The anonymize key a compiled cleanup takes from `settings.cleanup` may be given as a file."""
    path = tmp_path / "key"
    path.write_text("an-anonymize-key-of-the-game\n")
    monkeypatch.delenv("CLEANUP_ANONYMIZE_KEY", raising=False)
    monkeypatch.setenv("CLEANUP_ANONYMIZE_KEY_FILE", str(path))
    key = Settings.from_env().cleanup.anonymize_key
    assert key is not None and anonymize_key_pads(key.get_secret_value()) == anonymize_key_pads(
        "an-anonymize-key-of-the-game"
    )


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "ten"])
@pytest.mark.parametrize("var", NUMBERS, ids=lambda v: v.name)
def test_every_number_refuses_what_is_not_a_finite_number(
    var: Variable, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var.name, text)
    with pytest.raises(ConfigError, match=var.name):
        Settings.from_env()


@pytest.mark.parametrize("var", [v for v in NUMBERS if v.field.metadata], ids=lambda v: v.name)
def test_every_bounded_number_refuses_what_is_out_of_range(var: Variable, monkeypatch: pytest.MonkeyPatch) -> None:
    outside = []
    for bound in var.field.metadata:
        low = getattr(bound, "ge", getattr(bound, "gt", None))
        high = getattr(bound, "le", getattr(bound, "lt", None))
        if low is not None:
            outside.append(float(low) - 1)
        if high is not None:
            outside.append(float(high) + 1)
    assert outside, f"{var.name}: bounds not found in {var.field.metadata}"
    for value in outside:
        monkeypatch.setenv(var.name, str(int(value)) if value.is_integer() else str(value))
        with pytest.raises(ConfigError, match=var.name):
            Settings.from_env()


def test_a_switch_is_on_or_off_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, expected in (("on", True), ("1", True), ("YES", True), ("off", False), ("0", False), ("no", False)):
        monkeypatch.setenv("OTEL_TRACING", text)
        assert Settings.from_env().otel_tracing is expected
    monkeypatch.setenv("OTEL_TRACING", "sometimes")
    with pytest.raises(ConfigError, match="OTEL_TRACING"):
        Settings.from_env()


def test_the_database_identity_is_read_once_with_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the database layer is given (core.db takes it as an argument): the schema, and the
    connect timeout's range, read by Settings.from_env with every other variable."""
    monkeypatch.delenv("CLEANUP_SCHEMA", raising=False)
    assert Settings.from_env().database_schema == config.DEFAULT_SCHEMA
    monkeypatch.setenv("CLEANUP_SCHEMA", "game_cleanup")
    assert Settings.from_env().database_schema == "game_cleanup"
    monkeypatch.setenv("CONNECT_TIMEOUT_SECONDS", "2.5")
    assert Settings.from_env().connect_timeout_seconds == 2.5
    for bad in ("nan", "0", "3601"):
        monkeypatch.setenv("CONNECT_TIMEOUT_SECONDS", bad)
        with pytest.raises(ConfigError, match="CONNECT_TIMEOUT_SECONDS"):
            Settings.from_env()
    monkeypatch.delenv("CONNECT_TIMEOUT_SECONDS")
    monkeypatch.setenv("DATABASE_CONNECT_TIMEOUT_SECONDS", "3")  # the deprecated name, still read
    assert Settings.from_env().connect_timeout_seconds == 3.0


def test_a_deprecated_name_is_read_under_its_new_one_which_wins(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The cleanup's defaults were the planner's (PLANNER_BATCH_SIZE, ...): still read, with a
    deprecation line, while the new name is unset."""
    for old, new in config.DEPRECATED_NAMES.items():
        var = next(v for v in variables() if v.name == new)
        wanted = 3 if isinstance(var.default, int) else 3.0
        monkeypatch.setenv(old, str(wanted))
        with caplog.at_level(logging.WARNING, logger="core.config"):
            assert _value(Settings.from_env(), var) == wanted
        assert f"{old} is deprecated: set {new}" in caplog.text
        monkeypatch.setenv(new, "2")
        assert _value(Settings.from_env(), var) == 2
        monkeypatch.delenv(old)
        monkeypatch.delenv(new)


if __name__ == "__main__":
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE}")
