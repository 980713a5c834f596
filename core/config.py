"""Configuration: one tree of settings, declared here and read from the environment in one place.

`Settings.from_env()` reads every variable of every section once (a worker, a command or
`deadline_cleanup.CleanupClient` does it at start-up and passes the settings down: the jobs and
core.db take them as arguments, a call given none takes DEFAULT_SETTINGS). `Settings(...)` itself
reads nothing: it is a value, built from its arguments.

Each section is a pydantic-settings `BaseSettings` owning its prefix (`env_prefix`: CLEANUP_,
PLANNER_, LOAD_BUDGET_, ...) and its fields; a field named otherwise carries its variable as its
alias. What pydantic-settings lacks stays here: the secrets' `NAME_FILE` form, the dev env file,
the deprecated names (`environment` prepares them before the sections read), the generated
reference and the error naming the variable. Every variable's name, section, type, default and
meaning is declared on its field; the reference docs/configuration.md is generated from them
(`python -m tests.test_configuration`). Numbers are finite and in range, or the error names the
variable (ConfigError: exit 2).

The addresses (TEMPORAL_ADDRESS, DATABASE_URL) have no default: a command or worker without one
exits 2 naming it (core.addresses), never starting anything. The embedded development stack of a
checkout (devstack) starts only when asked: `./dev up` (which writes `<state dir>/dev/env`), `./dev
demo` and the tests. After `./dev up`, a variable that is unset is read from that file, if it exists,
so the commands run in that checkout find the stack; a variable that is set always wins. The
Temporal connection is read as the SDK and the `temporal` CLI read it (temporalio.envconfig).

Secrets are `SecretStr` (and the password in `database_url` is masked whenever settings are shown:
`repr`, `str`), so printing a `Settings` never leaks them. Each secret can also be
given as a file, `NAME_FILE=/path` (Docker and Kubernetes secrets): setting both is an error.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, BeforeValidator, Field, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from core.errors import InputError
from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS

PROJECT_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_TASK_QUEUE = "deadline-cleanup"
DEFAULT_NAMESPACE = "default"
DEFAULT_SCHEMA = "deadline_cleanup"
EMBEDDED_TEMPORAL_PORT = 7233
EMBEDDED_UI_PORT = 8233
FILE_SUFFIX = "_FILE"

LogFormat = Literal["text", "json"]
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)(?P<password>[^@/\s]+)(?P<tail>@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&\s]+)(?P<tail>)")


class ConfigError(InputError):
    """A variable that is malformed, out of range, or given twice (exit 2); names the variable,
    never a secret's value."""


def mask_url(url: str | None) -> str | None:
    """`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db` (also inside longer text)."""
    if url is None:
        return None
    for pattern in (_URL_PASSWORD, _QUERY_PASSWORD):
        url = pattern.sub(r"\g<head>***\g<tail>", url)
    return url


# Switches of one process that are not settings of the service (a developer's, a test's, the fault
# harness's), so they are not in the reference: read here too, as the rest of the environment.
PROCESS_SWITCHES = (
    "PROGRESS",  # 1: a progress bar even when stderr is not a terminal
    "CLEANUP_DEBUG",  # set: an unexpected error prints its traceback
    "CLEANUP_FAILPOINTS",  # core.failpoints
    "CLEANUP_FAILPOINTS_ENABLED",
    "CLEANUP_FAILPOINTS_FILE",
    "CLEANUP_FAILPOINTS_ONCE_DIR",
)


def process_switch(name: str) -> str:
    """The value of one of PROCESS_SWITCHES ('' when unset)."""
    if name not in PROCESS_SWITCHES:
        raise KeyError(f"{name} is not a process switch: declare a setting instead")
    return os.environ.get(name, "")


def switched_on(name: str) -> bool:
    return process_switch(name).strip().lower() in _ON


# What `./dev up` records for later commands, and only these (never a secret of a real deployment).
DEV_ENV_NAMES = ("TEMPORAL_ADDRESS", "DATABASE_URL", "TEMPORAL_UI_URL")


def dev_env_file(state_dir: Path) -> Path:
    """Where `./dev up` records the embedded stack's addresses."""
    return state_dir / "dev" / "env"


def read_dev_env(state_dir: Path) -> dict[str, str]:
    """`NAME=value` lines of the dev env file ({} when there is none)."""
    path = dev_env_file(state_dir)
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text(encoding="utf-8").splitlines() if "=" in line)
    return {name.strip(): value.strip() for name, value in pairs if name.strip() in DEV_ENV_NAMES}


# Before the Temporal SDK's standard names (temporalio.envconfig) were read: still accepted, with a
# deprecation line, when the standard name is unset.
DEPRECATED_TEMPORAL_NAMES = {
    "TEMPORAL_TLS_CERT": "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_KEY": "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_CA": "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
}


def temporal_profile(env: dict[str, str]) -> dict[str, object]:
    """The Temporal connection as the SDK and the `temporal` CLI configure it (temporalio.envconfig):
    a `temporal.toml` profile (TEMPORAL_CONFIG_FILE, TEMPORAL_PROFILE) overridden by the standard
    variables (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_CLIENT_CERT_PATH,
    TEMPORAL_TLS_CLIENT_KEY_PATH, TEMPORAL_TLS_SERVER_CA_CERT_PATH, TEMPORAL_TLS_SERVER_NAME, ...), as
    Settings values; unset ones are left out. Certificates given inline (not as paths) are not taken."""
    from temporalio.envconfig import ClientConfigProfile  # lazy: only when settings are read

    for old, new in DEPRECATED_TEMPORAL_NAMES.items():
        if env.get(old):
            logging.getLogger(__name__).warning("%s is deprecated: set %s (the Temporal SDK's name)", old, new)
            env.setdefault(new, env[old])
    profile = ClientConfigProfile.load(override_env_vars=env)
    tls = profile.tls
    found: dict[str, object] = {
        "temporal_address": profile.address,
        "temporal_namespace": profile.namespace,
        "temporal_api_key": _secret(profile.api_key),
    }
    if tls is not None:
        found["temporal_tls"] = None if tls.disabled is None else not tls.disabled
        found["temporal_tls_server_name"] = tls.server_name
        for key, source in (
            ("temporal_tls_cert", tls.client_cert),
            ("temporal_tls_key", tls.client_private_key),
            ("temporal_tls_ca", tls.server_root_ca_cert),
        ):
            found[key] = source if isinstance(source, Path) else None
    return {key: value for key, value in found.items() if value is not None}


def _secret(value: str | None) -> SecretStr | None:
    return SecretStr(value) if value else None


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _switch(value: object) -> object:
    """on/off, 1/0, true/false, yes/no in any case; anything else is refused by the bool type."""
    if isinstance(value, str):
        text = value.strip().lower()
        return True if text in _ON else False if text in _OFF else value
    return value


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


Switch = Annotated[bool, BeforeValidator(_switch)]


def setting(
    default: Any,
    description: str,
    *,
    env: str | None = None,
    section: str | None = None,
    secret: bool = False,
    **constraints: Any,
) -> Any:
    """A field read from the environment: variable `env` (default: the section's prefix and the
    field's name in capitals), shown in `section` of the reference."""
    extra: dict[str, Any] = {}
    if env is not None:
        constraints["validation_alias"] = env
    if section is not None:
        extra["section"] = section
    if secret:
        extra["secret"] = True
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def internal(default: Any, description: str, **constraints: Any) -> Any:
    """A field no variable sets: a constant of the deployment, set in Python by tests and benchmarks."""
    return Field(default, description=description, json_schema_extra={"internal": True}, **constraints)


# The environment Settings.from_env is reading (deprecated names, `_FILE` secrets and the dev env
# file applied: `environment`); None: a section built in Python, from its arguments alone.
_READING: ContextVar[Mapping[str, str] | None] = ContextVar("settings_reading", default=None)


class _Prepared(EnvSettingsSource):
    """pydantic-settings' environment source, over the variables from_env prepared. It matches
    names without case (a field's name is lower-case, its variable upper-case), so only the exact
    names the tree declares are handed to it, and only those set (an empty variable is unset)."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        names = {var.name for var in variables()}
        return {name.lower(): value for name, value in (_READING.get() or {}).items() if name in names and value}


class Section(BaseSettings):
    """A group of settings whose variables are named `env_prefix` + the field's name in capitals
    (unless the field names its own). Built in Python it reads nothing (workflow inputs carry
    sections); built by `_read` it reads its variables (pydantic-settings)."""

    # NaN passes any ge/le bound; a field is set by its name in Python, by its variable otherwise.
    model_config = SettingsConfigDict(
        allow_inf_nan=False, extra="forbid", validate_by_name=True, validate_by_alias=True
    )

    SECTION: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _Prepared(settings_cls))

    def __init__(self, **values: Any) -> None:
        if _READING.get() is None:  # a value built in Python or decoded from a payload: no source at all
            BaseModel.__init__(self, **values)
        else:
            super().__init__(**values)


MAX_PARTITIONS = 256


class CleanupDefaults(Section):
    """How every cleanup runs unless its caller says otherwise, the planner's and an operator's
    alike: the one home of these defaults (CLEANUP_PARTITIONS, ...). Carried in the planner's
    workflow input, so its cohorts run as the settings of whoever started the planner say."""

    model_config = SettingsConfigDict(env_prefix="CLEANUP_", frozen=True)
    SECTION: ClassVar[str] = "cleanup"

    partitions: int = setting(8, "partitions of a cohort cleanup", ge=1, le=MAX_PARTITIONS)
    max_parallel_partitions: int = setting(4, "partitions of one cleanup that run at once", ge=1, le=MAX_PARTITIONS)
    batch_size: int = setting(1000, "accounts per batch transaction of a partition", ge=1, le=20_000)
    claim_chunk_size: int = internal(10_000, "accounts per statement of a cohort's claim", ge=1, le=100_000)
    claim_streams: int = internal(
        2, "claims of one cohort of one instant running at once (at most its partitions)", ge=1, le=16
    )
    heartbeat_timeout_seconds: float = setting(
        DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
        "a partition (or chunked claim) whose worker died is retried elsewhere after this long without a heartbeat",
        gt=0,
    )
    heartbeat_interval_seconds: float | None = setting(
        None, "how often a partition heartbeats (unset: a third of the timeout)", gt=0
    )


class PlannerSettings(Section):
    """The planner's knobs (PLANNER_*), carried in its workflow's input. Lateness of a planned
    account: at most the width of its cohort (`cohort_seconds`: sparse deadlines, or
    `bucket_seconds` for dense ones) plus the time to claim and clean; an account whose deadline
    came too soon to be planned, or that a cohort missed, is swept within
    `overdue_after_seconds + max_idle_seconds`."""

    model_config = SettingsConfigDict(env_prefix="PLANNER_", frozen=True)
    SECTION: ClassVar[str] = "planner"
    # A planner run of 1.0 carries these in its input; the cleanup section owns them now
    # (CleanupDefaults), so they are dropped when such an input is read. Any other unknown key is refused.
    MOVED_TO_CLEANUP: ClassVar[tuple[str, ...]] = (
        "partitions",
        "max_parallel_partitions",
        "batch_size",
        "claim_chunk_size",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in cls.MOVED_TO_CLEANUP}
        return data

    bucket_seconds: float = setting(1.0, "width of a deadline bucket: one cohort cleanup each", ge=0.001, le=3600)
    wake_early_seconds: float = internal(
        0.5,
        "a bucket's cleanup wakes this long before the bucket ends; its claim waits for the database "
        "clock, so the timer's and the dispatch's latency come before the deadline instead of after",
        ge=0,
        le=10,
    )
    horizon_seconds: float = setting(120.0, "how far ahead the planner starts bucket cleanups", ge=1, le=86_400)
    tick_seconds: float = setting(
        5.0,
        "the shortest interval between two planning iterations (after a nudge, or while it catches up)",
        ge=0.1,
        le=30,
    )
    max_idle_seconds: float = setting(
        60.0,
        "the longest the planner sleeps between two iterations: what an overdue account or a stranded "
        "claim waits at most before it is swept (beyond the sweep grace); a registration due within the "
        "hour wakes it at once (the workers listen for it)",
        ge=0.1,
        le=3600,
    )
    lateness_objective_seconds: float = setting(
        10.0,
        "how late a cleanup may be: sparse deadlines share one cohort cleanup per window of this "
        "width less a second (the time to wake, claim and clean it); a window holding more than a "
        "batch keeps buckets of `bucket_seconds`",
        env="PLANNER_LATENESS_OBJECTIVE",
        ge=0.001,
        le=3600,
    )
    sweep_grace_seconds: float = setting(
        10.0, "an account overdue by this long without a cleanup is swept", ge=0, le=3600
    )
    max_buckets_per_tick: int = internal(1000, "bucket cleanups started per tick at most", ge=1, le=10_000)
    iterations_per_run: int = internal(50, "ticks before the planner continues as new", ge=1, le=10_000)
    step_heartbeat_seconds: float = setting(
        10.0, "the plan and sweep steps heartbeat; a worker that dies in one is noticed after this long", ge=1, le=600
    )

    # The time to wake, claim and clean a cohort that fits one batch, measured (bench.planner_events):
    # a sparse cohort is this much narrower than the objective, so its first account is on time.
    COHORT_MARGIN_SECONDS: ClassVar[float] = 1.0

    @property
    def cohort_seconds(self) -> float:
        """The width of a sparse cohort: the objective less the margin, in whole buckets (so a
        window's buckets never straddle another window), at least one."""
        buckets = (self.lateness_objective_seconds - self.COHORT_MARGIN_SECONDS) // self.bucket_seconds
        return round(max(1, buckets) * self.bucket_seconds, 3)

    @property
    def overdue_after_seconds(self) -> float:
        """How long past its deadline an active account is overdue (swept): the grace, plus the
        time a sparse cohort's first account waits for its window's end (the cohort's width beyond
        a bucket), so no account of a cohort still to wake is swept from under it."""
        return self.sweep_grace_seconds + self.cohort_seconds - self.bucket_seconds


class BudgetSettings(Section):
    """A worker's defaults (LOAD_BUDGET_*); the operator's values in the budget row take precedence."""

    model_config = SettingsConfigDict(env_prefix="LOAD_BUDGET_")
    SECTION: ClassVar[str] = "budget"

    enabled: Switch = setting(
        True, "`off`: this process takes no part (no budget statements at all)", env="LOAD_BUDGET"
    )
    # Hard caps (None: no cap; the adaptive limits alone apply). `budget set` overrides them.
    max_in_flight: int | None = setting(
        None, "hard cap: batches at once across all workers (0 pauses; unset: no cap)", ge=0, le=256
    )
    rows_per_second: float | None = setting(
        None, "hard cap: rows (accounts claimed, accounts cleaned, payment keys) per second (unset: no cap)", gt=0
    )
    latency_ms: float = setting(1000.0, "mean batch latency per 1,000 rows that means stress", gt=0)
    max_lock_waits: int = setting(4, "lock waits in this database that mean stress", ge=0)
    max_replication_lag_seconds: float = setting(10.0, "standby lag that means stress", gt=0)
    lease_seconds: float = internal(10.0, "how long the slot of a frozen holder stays taken", gt=0)
    adjust_seconds: float = internal(2.0, "how often the adaptive limits may change", gt=0)
    burst_seconds: float = internal(1.0, "bucket capacity, in seconds of the rate limit", gt=0)
    # The adaptive limits: halved on stress (never below `min_rows_per_second`, which keeps the
    # deadlines), multiplied by `grow_factor` per healthy adjustment, lifted when they no longer bind.
    min_rows_per_second: float = setting(2000.0, "the least the back-off leaves (the deadlines' share)", gt=0)
    grow_factor: float = internal(1.25, "a throttle in use grows by this per healthy adjustment", gt=1)
    max_poll_seconds: float = internal(0.5, "longest sleep of a waiting batch between tries", gt=0)
    probe_interval_seconds: float = internal(0.2, "how often a worker with budgeted work probes", gt=0)
    idle_probe_seconds: float = internal(
        5.0, "how often a worker with no budgeted work probes (its baseline: the players alone)", gt=0
    )
    # The players' objective: the busy probe's mean above its quiet baseline by more than
    # `probe_added_ms` means stress (docs/decisions/0017); so does a mean above `probe_ratio` x the
    # baseline and above `probe_max_ms`, each when set.
    probe_added_ms: float = setting(
        5.0, "the players' objective: a commit may take at most this many ms more than alone (mean per window)", gt=0
    )
    probe_ratio: float | None = setting(
        None, "optional bound: commit probe / its quiet baseline that means stress (unset: none)", gt=1
    )
    probe_max_ms: float | None = setting(None, "optional bound: the commit probe's mean in ms (unset: none)", gt=0)
    # Players are sessions doing work: present while, of the samples taken in the last
    # `presence_window_seconds`, at least `presence_busy_fraction` saw a session not this service's
    # writing: a statement in a transaction that holds an ID (docs/budget.md, Who counts as a player).
    presence_busy_fraction: float = setting(
        0.05, "players are present while at least this share of the samples saw one writing", gt=0, le=1
    )
    presence_window_seconds: float = setting(10.0, "the window of samples that decides presence", gt=0, le=3600)
    # The deadline objective: every cohort finishes within `lateness_objective_seconds` of its
    # deadline, granted up to `deadline_max_in_flight` batches whatever the players' objective says.
    lateness_objective_seconds: float = setting(
        60.0, "the deadline objective: a cohort's last account cleaned at most this long after its deadline", gt=0
    )
    deadline_max_in_flight: int = setting(
        2,
        "the hard share: batches in flight the deadline objective may hold past the players' objective (0: none)",
        ge=0,
        le=256,
    )
    probe_min_ms: float = internal(
        1.0, "a busy probe must also exceed its baseline by this many ms (sub-ms jitter is not stress)", ge=0
    )
    baseline_seconds: float = internal(30.0, "a baseline older than this is measured again", gt=0)
    quiet_seconds: float = internal(
        1.0, "a stale baseline is measured by granting nothing for this long (0: never)", ge=0
    )
    max_claim_rows: int = setting(500, "accounts per statement of a cohort's claim while a rate limit applies", ge=1)
    throttled_batch_rows: int = setting(
        250, "accounts per cleanup batch while a rate limit applies (the partition's batch size otherwise)", ge=1
    )
    blocked_after_seconds: float = internal(1.0, "a batch blocked on a lock this long stops counting", ge=0)
    off_recheck_seconds: float = internal(
        1.0,
        "with the budget switched off (`budget set --enabled off`), how long a process runs its batches "
        "without budget statements before it asks again",
        ge=0,
    )


class CleanupSettings(Section):
    model_config = SettingsConfigDict(env_prefix="CLEANUP_")
    SECTION: ClassVar[str] = "cleanup"

    defaults: CleanupDefaults = CleanupDefaults()
    targets_file: Path | None = setting(None, "the targets file (unset: cleanup/targets.toml)")
    anonymize_key: SecretStr | None = setting(
        None, "the HMAC key of the targets' hash columns (at least 16 bytes, the same on every worker)"
    )
    reminders: Switch = setting(
        True,
        "`off`: a cleanup writes no renewal reminder to the outbox (the same on every worker; the outbox"
        " still delivers what is queued)",
    )
    retention_days: int = setting(
        30,
        "the service's bookkeeping of a cleanup settled this many days ago (claims, idempotency records,"
        " receipts, delivered reminders, history of its cleaned accounts) is pruned (docs/deployment.md, Retention)",
        ge=7,
        le=36_500,
    )


class LedgerSettings(Section):
    model_config = SettingsConfigDict(env_prefix="LEDGER_")
    SECTION: ClassVar[str] = "ledger"

    heartbeat_timeout_seconds: float = setting(
        DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
        "a shard (or the settlement) whose worker died is retried elsewhere after this long without a heartbeat",
        gt=0,
    )


class OutboxSettings(Section):
    model_config = SettingsConfigDict(env_prefix="OUTBOX_")
    SECTION: ClassVar[str] = "outbox"

    heartbeat_timeout_seconds: float = setting(
        DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
        "a relay batch whose worker died is retried elsewhere after this long without a heartbeat",
        gt=0,
    )
    provider_url: str | None = setting(
        None, "the mail provider's base URL (https; unset: the relay fails clearly)", env="MAIL_PROVIDER_URL"
    )
    provider_token: SecretStr | None = setting(
        None, "the bearer token sent to the mail provider", env="MAIL_PROVIDER_TOKEN"
    )
    provider_allow_http: Switch = setting(
        False, "allow an http:// provider beyond loopback", env="MAIL_PROVIDER_ALLOW_HTTP"
    )
    provider_batch_max: int = setting(
        0,
        "events per request to the provider's batch endpoint (POST /v1/messages/batch); "
        "0 or 1: one request per event to /v1/messages, for a provider without a batch endpoint",
        env="MAIL_PROVIDER_BATCH_MAX",
        ge=0,
        le=1000,
    )


class Settings(Section):
    """Every setting of a worker or a command: where Temporal and Postgres are (`None`: unset, see
    core.addresses), the worker's knobs, and one section per job and per platform part."""

    # Temporal (read through temporalio.envconfig as well: a temporal.toml profile)
    temporal_address: str | None = setting(
        None, "Temporal's host:port (required: unset, a command exits 2)", env="TEMPORAL_ADDRESS", section="temporal"
    )
    temporal_namespace: str = setting(DEFAULT_NAMESPACE, "the namespace", env="TEMPORAL_NAMESPACE", section="temporal")
    task_queue: str = setting(
        DEFAULT_TASK_QUEUE, "the task queue of the workers", env="TEMPORAL_TASK_QUEUE", section="temporal"
    )
    temporal_ui_url: str | None = setting(
        None, "where the Temporal UI is, for links to runs", env="TEMPORAL_UI_URL", section="temporal"
    )
    temporal_tls: Switch | None = setting(
        None,
        "TLS to Temporal (unset: on when a certificate, CA or API key is configured)",
        env="TEMPORAL_TLS",
        section="temporal",
    )
    temporal_tls_cert: Path | None = setting(
        None,
        "client certificate (mTLS)",
        env="TEMPORAL_TLS_CLIENT_CERT_PATH",
        section="temporal",
    )
    temporal_tls_key: Path | None = setting(
        None,
        "client private key (mTLS)",
        env="TEMPORAL_TLS_CLIENT_KEY_PATH",
        section="temporal",
    )
    temporal_tls_ca: Path | None = setting(
        None,
        "CA of the server's certificate",
        env="TEMPORAL_TLS_SERVER_CA_CERT_PATH",
        section="temporal",
    )
    temporal_tls_server_name: str | None = setting(
        None, "the server name TLS checks", env="TEMPORAL_TLS_SERVER_NAME", section="temporal"
    )
    temporal_api_key: SecretStr | None = setting(
        None, "API key (Temporal Cloud); never sent in clear", env="TEMPORAL_API_KEY", section="temporal"
    )
    # Postgres
    database_url: str | None = setting(
        None,
        "the service's Postgres, postgresql://user:password@host/db (required: unset, a command exits 2)",
        env="DATABASE_URL",
        section="database",
        secret=True,
        repr=False,
    )
    database_schema: str = setting(
        DEFAULT_SCHEMA, "the schema of the service's tables and functions", env="CLEANUP_SCHEMA", section="database"
    )
    database_account_key_type: Literal["text", "uuid", "bigint"] = setting(
        "text",
        "the type of the game's account keys: each spelling a client sends is canonicalized to one key"
        " (recorded by migrate; text may become uuid or bigint, not back)",
        env="CLEANUP_ACCOUNT_KEY_TYPE",
        section="database",
    )
    database_role_prefix: str = setting(
        "cleanup",
        "the service's roles in this database: PREFIX_owner, _worker, _game, _compliance (one prefix per database"
        " of a cluster: roles are cluster-wide)",
        env="CLEANUP_ROLE_PREFIX",
        section="database",
        pattern=r"^[a-z_][a-z0-9_]{0,40}$",
    )
    # One bound for both services: an address that accepts and never answers costs a command (or a
    # worker starting) the same time whichever service it is, then exit 75 naming the setting.
    connect_timeout_seconds: float = setting(
        10.0,
        "seconds to wait for a connection to the database or to Temporal (an address that accepts and never "
        "answers fails with exit 75 after this long)",
        env="CONNECT_TIMEOUT_SECONDS",
        section="database",
        gt=0,
        le=3600,
    )
    pool_max_size: int = setting(
        8, "connections of a worker's pool", env="DB_POOL_MAX_SIZE", section="database", ge=1, le=200
    )
    # Connections kept apart for claims: a cohort's claim streams (a claim feeds the partitions that
    # follow it) and the outbox relay's batches. Neither may queue for a connection behind batches,
    # which can all be waiting on players' row locks while they hold the main pool.
    claim_pool_size: int = setting(
        2,
        "connections kept apart for claims: a cohort's claim streams and the outbox relay",
        env="DB_CLAIM_POOL_SIZE",
        section="database",
        ge=1,
        le=50,
    )
    # A worker's transactions are one batch each (BEGIN, a statement or two, COMMIT): never idle for
    # long. One that is (its worker frozen, or cut off after sending a statement) holds the batch's
    # row locks and the shard lock; Postgres ends it after this long, so the retry of that batch is
    # not blocked behind a zombie and the zombie's late COMMIT is refused. 0: off.
    db_idle_in_transaction_timeout_seconds: float = setting(
        10.0,
        "a worker's transaction left idle this long (its worker frozen) is ended by Postgres (0: off)",
        env="DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS",
        section="database",
        ge=0,
        le=86_400,
    )
    # Worker
    state_dir: Path = setting(
        PROJECT_ROOT / ".state",
        "where the embedded development stack and `./dev up` keep their state",
        env="CLEANUP_STATE_DIR",
        section="worker",
    )
    max_concurrent_activities: int = setting(
        16, "activities a worker runs at once", env="WORKER_MAX_CONCURRENT_ACTIVITIES", section="worker", ge=1, le=1000
    )
    # On SIGTERM a worker stops polling and gives running activities this long to finish or hand
    # their work back (cleanup partitions do at the next batch) before cancelling them.
    worker_graceful_shutdown_seconds: float = setting(
        20.0,
        "on SIGTERM, how long running activities get to finish or hand their work back",
        env="WORKER_GRACEFUL_SHUTDOWN_SECONDS",
        section="worker",
        ge=0,
        le=3600,
    )
    # Long polls a worker keeps open (None: the SDK's 5 each). A worker that freezes or loses its
    # network keeps them open on the server, which hands them tasks it can no longer run (each one
    # retried after its timeout: an activity's heartbeat timeout, a workflow task's 10 s); fewer
    # polls, fewer such tasks.
    worker_workflow_task_polls: int | None = setting(
        None,
        "workflow task long polls a worker keeps open (unset: the SDK's 5)",
        env="WORKER_WORKFLOW_TASK_POLLS",
        section="worker",
        ge=2,
        le=100,
    )
    worker_activity_task_polls: int | None = setting(
        None,
        "activity task long polls a worker keeps open (unset: the SDK's 5)",
        env="WORKER_ACTIVITY_TASK_POLLS",
        section="worker",
        ge=1,
        le=100,
    )
    # A workflow task waits this long on the sticky queue of the worker that has the workflow cached
    # before any worker may take it (Temporal's default is 10 s): what a killed worker's workflows
    # wait once before they move on (the next workflow task goes to a live worker; worker.py).
    worker_sticky_queue_timeout_seconds: float = setting(
        3.0,
        "how long a workflow task waits for the worker that has the workflow cached",
        env="WORKER_STICKY_QUEUE_TIMEOUT_SECONDS",
        section="worker",
        gt=0,
        le=300,
    )
    log_format: Annotated[LogFormat, BeforeValidator(_lower)] = setting(
        "text", "`text` or `json` (one object per line)", env="LOG_FORMAT", section="worker"
    )
    planner_enabled: Switch = setting(
        True,
        "`off`: this worker does not ensure the deadline planner (it still runs its tasks)",
        env="CLEANUP_PLANNER",
        section="planner",
    )
    planner_watchdog_seconds: float = setting(
        30.0,
        "how often a worker looks that the planner runs (and starts it again if not)",
        env="PLANNER_WATCHDOG_SECONDS",
        section="planner",
        gt=0,
        le=3600,
    )
    # Observability (docs/observability.md)
    metrics_port: int | None = setting(
        None,
        "serve Prometheus /metrics on this port (unset: off)",
        env="METRICS_PORT",
        section="observability",
        ge=1,
        le=65535,
    )
    # Loopback unless told otherwise (METRICS_HOST, HEALTH_HOST): the image sets 0.0.0.0.
    metrics_host: str = setting(
        "127.0.0.1", "the address /metrics listens on", env="METRICS_HOST", section="observability"
    )
    # /healthz and /readyz (core/health.py) on a port of their own; None: not served.
    health_port: int | None = setting(
        None,
        "serve /healthz and /readyz on this port (unset: off)",
        env="HEALTH_PORT",
        section="observability",
        ge=1,
        le=65535,
    )
    health_host: str = setting(
        "127.0.0.1", "the address /healthz and /readyz listen on", env="HEALTH_HOST", section="observability"
    )
    # OpenTelemetry (core/tracing.py): traces over OTLP, and Temporal's and the project's metrics
    # pushed over OTLP (gRPC) to this endpoint instead of served for Prometheus on metrics_port.
    otel_tracing: Switch = setting(
        False, "`on`: traces over OTLP (the tracing extra)", env="OTEL_TRACING", section="observability"
    )
    metrics_otlp_endpoint: str | None = setting(
        None,
        "push metrics over OTLP (gRPC) here instead of serving them (not with METRICS_PORT)",
        env="METRICS_OTLP_ENDPOINT",
        section="observability",
    )
    # Payload encryption (docs/security.md); key rotation (core.codec): older keys, decryption only;
    # the key of the pseudonyms in workflow IDs.
    payload_encryption_key: SecretStr | None = setting(
        None, "AES-256-GCM key of every payload (base64 of 32 bytes)", env="PAYLOAD_ENCRYPTION_KEY", section="codec"
    )
    payload_encryption_key_id: str = setting(
        "default", "the id written with each encrypted payload", env="PAYLOAD_ENCRYPTION_KEY_ID", section="codec"
    )
    payload_decryption_keys: SecretStr | None = setting(
        None, "older keys, decryption only: `id:base64,id:base64`", env="PAYLOAD_DECRYPTION_KEYS", section="codec"
    )
    payload_pseudonym_key_id: str | None = setting(
        None,
        "the key of the pseudonyms in workflow IDs (unset: the newest key)",
        env="PAYLOAD_PSEUDONYM_KEY_ID",
        section="codec",
    )
    payload_require_encryption: Switch = setting(
        False, "refuse unencrypted payloads", env="PAYLOAD_REQUIRE_ENCRYPTION", section="codec"
    )
    codec_server_token: SecretStr | None = setting(
        None,
        "bearer token the codec server requires (unset: it listens on loopback only)",
        env="CODEC_SERVER_TOKEN",
        section="codec",
    )
    # One section per job and per platform part, read from their own prefixes.
    planner: PlannerSettings = PlannerSettings()
    cleanup: CleanupSettings = CleanupSettings()
    ledger: LedgerSettings = LedgerSettings()
    outbox: OutboxSettings = OutboxSettings()
    budget: BudgetSettings = BudgetSettings()

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Every variable, read once (a secret's `NAME_FILE` and the dev env file included), and the
        Temporal connection as temporalio.envconfig reads it (a profile, the deprecated names);
        `overrides` (the command's flags) win over them. ConfigError names what is wrong."""
        env = environment(os.environ)
        values = temporal_profile(dict(env)) | {k: v for k, v in overrides.items() if v is not None}
        return _read(cls, values, env)

    def __repr_args__(self) -> Any:
        yield from super().__repr_args__()
        yield "database_url", mask_url(self.database_url)

    def secrets(self) -> list[str]:
        """The secret values themselves, so log output can be scrubbed of them (core.logs)."""
        keys = (
            self.temporal_api_key,
            self.payload_encryption_key,
            self.payload_decryption_keys,
            self.codec_server_token,
            self.cleanup.anonymize_key,
            self.outbox.provider_token,
        )
        found = [s.get_secret_value() for s in keys if s]
        if self.payload_decryption_keys:  # each key alone too, so no single one is ever printed
            for item in self.payload_decryption_keys.get_secret_value().split(","):
                found.append(item.partition(":")[2].strip())
        if self.database_url:
            for pattern in (_URL_PASSWORD, _QUERY_PASSWORD):
                found += [m.group("password") for m in pattern.finditer(self.database_url)]
        return [s for s in found if s]

    def ui_url(self) -> str | None:
        """Where a Temporal UI is known to be: TEMPORAL_UI_URL, or the embedded dev server's. A
        server given by address only may be headless, so no link is guessed for it (None)."""
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        if self.temporal_address is None:
            return f"http://127.0.0.1:{EMBEDDED_UI_PORT}"
        return None

    def workflow_url(self, workflow_id: str) -> str | None:
        ui = self.ui_url()
        return None if ui is None else f"{ui}/namespaces/{self.temporal_namespace}/workflows/{workflow_id}"


# The declared defaults, for a call given no settings (`Settings()` reads no variable): a command
# or a worker passes the settings it read at start-up (Settings.from_env) instead.
DEFAULT_SETTINGS = Settings()


@dataclass(frozen=True)
class Variable:
    """One environment variable of the tree: where its value goes (`path` of field names)."""

    name: str
    section: str
    path: tuple[str, ...]
    field: FieldInfo
    secret: bool

    @property
    def default(self) -> object:
        return self.field.default


def _section_class(annotation: object) -> type[Section] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def _is_secret(annotation: object) -> bool:
    return annotation is SecretStr or SecretStr in get_args(annotation)


def variables(model: type[BaseModel] | None = None) -> list[Variable]:
    """Every variable the tree reads (`model`: one section of it), in declaration order."""
    return list(_variables(model or Settings, ()))


@functools.cache
def _variables(model: type[BaseModel], path: tuple[str, ...]) -> tuple[Variable, ...]:
    prefix = str(model.model_config.get("env_prefix") or "")
    section: str = getattr(model, "SECTION", "")
    found: list[Variable] = []
    for name, field in model.model_fields.items():
        nested = _section_class(field.annotation)
        if nested is not None:
            found += _variables(nested, (*path, name))
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("internal"):
            continue
        found.append(
            Variable(
                name=str(field.validation_alias or f"{prefix}{name.upper()}"),
                section=str(extra.get("section") or section),
                path=(*path, name),
                field=field,
                secret=bool(extra.get("secret")) or _is_secret(field.annotation),
            )
        )
    return tuple(found)


# Old names still read, with a deprecation line, when the new name is unset (old -> new).
DEPRECATED_NAMES = {
    "DATABASE_CONNECT_TIMEOUT_SECONDS": "CONNECT_TIMEOUT_SECONDS",
    "PLANNER_PARTITIONS": "CLEANUP_PARTITIONS",
    "PLANNER_MAX_PARALLEL_PARTITIONS": "CLEANUP_MAX_PARALLEL_PARTITIONS",
    "PLANNER_BATCH_SIZE": "CLEANUP_BATCH_SIZE",
}


def environment(base: Mapping[str, str]) -> dict[str, str]:
    """The variables as the settings read them: a deprecated name's value under its new name, each
    secret's `NAME_FILE` read into NAME (both set is an error), then what `./dev up` recorded for the
    names still unset."""
    env = dict(base)
    for old, new in DEPRECATED_NAMES.items():
        if env.get(old) and not env.get(new):
            logging.getLogger(__name__).warning("%s is deprecated: set %s", old, new)
            env[new] = env[old]
    for var in variables():
        if not var.secret:
            continue
        file_name = var.name + FILE_SUFFIX
        path = env.get(file_name)
        if not path:
            continue
        if env.get(var.name):
            raise ConfigError(f"{var.name} and {file_name} are both set: set one of them")
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{file_name}: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
        if not value:
            raise ConfigError(f"{file_name}: {path} is empty")
        env[var.name] = value
    state_dir = Path(env["CLEANUP_STATE_DIR"]) if env.get("CLEANUP_STATE_DIR") else PROJECT_ROOT / ".state"
    env.update({name: value for name, value in read_dev_env(state_dir).items() if not env.get(name)})
    return env


S = TypeVar("S", bound=Section)


def _read(model: type[S], values: dict[str, Any], env: Mapping[str, str]) -> S:
    """`model` with its sections each read from `env` (as `environment` prepared it) under its own
    prefix; `values` win over the variables. ConfigError names every variable refused."""
    problems: list[str] = []
    for name, field in model.model_fields.items():
        nested = _section_class(field.annotation)
        if nested is not None and name not in values:
            try:
                values[name] = _read(nested, {}, env)
            except ConfigError as err:
                problems.append(str(err))
    token = _READING.set(env)
    try:
        built = model(**values)
    except ValidationError as err:
        problems.insert(0, str(_config_error(err, model)))
    finally:
        _READING.reset(token)
    if problems:
        raise ConfigError("; ".join(problems))
    return built


def read(section: type[S]) -> S:
    """One section from the environment, for a demo, a benchmark or a test given no settings
    (product code takes its settings as arguments: tests/test_one_home.py)."""
    return _read(section, {}, environment(os.environ))


def _explain(var: Variable | None, error: Any, where: str = "") -> str:
    message = str(error.get("msg", "invalid"))
    if var is None:
        return f"{where}: {message}" if where else message
    shown = "" if var.secret or not isinstance(error.get("input"), str) else f" (got {error['input']!r})"
    return f"{var.name}: {message}{shown}"


def _config_error(err: ValidationError, model: type[BaseModel]) -> ConfigError:
    """Each error named by its variable: an error is at a field's name, or at its variable's when
    the field names its own (its sections are read, and refused, on their own)."""
    by_key = {key: var for var in variables(model) if len(var.path) == 1 for key in (var.path[0], var.name)}
    lines = []
    for error in err.errors():
        path = tuple(str(p) for p in error.get("loc", ()))
        lines.append(_explain(by_key.get(path[0]) if len(path) == 1 else None, error, ".".join(path)))
    return ConfigError("; ".join(lines))
