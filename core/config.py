"""Configuration from the environment.

The addresses (TEMPORAL_ADDRESS, DATABASE_URL) have no default: a command or worker without one
exits 2 naming it (core.embedded.resolve), never starting anything. The embedded stack starts only
when asked: `deadline-cleanup dev up` (which writes `<state dir>/dev/env`), `./dev demo` and the tests
(CLEANUP_EMBEDDED=1). After `dev up`, a variable that is unset is read from that file, if it exists,
so the commands run in that checkout find the stack; a variable that is set always wins.

Secrets (the Temporal API key, the payload encryption key) are `SecretStr`, and the password in
`database_url` is masked whenever settings are shown (`repr`, `str`, `safe_dict()`), so printing a
`Settings` never leaks them. Read the real values with `.get_secret_value()` / `database_url`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

PROJECT_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_TASK_QUEUE = "deadline-cleanup"
DEFAULT_NAMESPACE = "default"
EMBEDDED_TEMPORAL_PORT = 7233
EMBEDDED_UI_PORT = 8233

LogFormat = Literal["text", "json"]
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)(?P<password>[^@/\s]+)(?P<tail>@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&\s]+)(?P<tail>)")


def mask_url(url: str | None) -> str | None:
    """`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db` (also inside longer text)."""
    if url is None:
        return None
    for pattern in (_URL_PASSWORD, _QUERY_PASSWORD):
        url = pattern.sub(r"\g<head>***\g<tail>", url)
    return url


# What `dev up` records for later commands, and only these (never a secret of a real deployment).
DEV_ENV_NAMES = ("TEMPORAL_ADDRESS", "DATABASE_URL", "TEMPORAL_UI_URL")


def dev_env_file(state_dir: Path) -> Path:
    """Where `deadline-cleanup dev up` records the embedded stack's addresses."""
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


def _state_dir(env: os._Environ[str] | dict[str, str]) -> Path:
    return Path(env["CLEANUP_STATE_DIR"]) if env.get("CLEANUP_STATE_DIR") else PROJECT_ROOT / ".state"


def _secret(value: str | None) -> SecretStr | None:
    return SecretStr(value) if value else None


class Settings(BaseModel):
    """Where Temporal and Postgres are (`None`: unset, see core.embedded.resolve), and the worker's knobs."""

    model_config = ConfigDict(allow_inf_nan=False)  # every number finite: NaN passes any ge/le bound

    temporal_address: str | None = None
    temporal_namespace: str = DEFAULT_NAMESPACE
    task_queue: str = DEFAULT_TASK_QUEUE
    database_url: str | None = Field(default=None, repr=False)
    state_dir: Path = Field(default=PROJECT_ROOT / ".state")
    temporal_ui_url: str | None = None
    pool_max_size: int = Field(default=8, ge=1, le=200)
    # Connections kept apart for cohort claims (one per claim stream): a claim feeds the partitions
    # that follow it, so it must not queue for a connection behind their batches (it did: a claim
    # of 20,000 accounts took 2.5 s in the worker against 0.6 s on connections of its own).
    claim_pool_size: int = Field(default=2, ge=1, le=50)
    # A worker's transactions are one batch each (BEGIN, a statement or two, COMMIT): never idle for
    # long. One that is (its worker frozen, or cut off after sending a statement) holds the batch's
    # row locks and the shard lock; Postgres ends it after this long, so the retry of that batch is
    # not blocked behind a zombie and the zombie's late COMMIT is refused. 0: off.
    db_idle_in_transaction_timeout_seconds: float = Field(default=10.0, ge=0, le=86_400)
    max_concurrent_activities: int = Field(default=16, ge=1, le=1000)
    # On SIGTERM a worker stops polling and gives running activities this long to finish or hand
    # their work back (cleanup partitions do at the next batch) before cancelling them.
    worker_graceful_shutdown_seconds: float = Field(default=20.0, ge=0, le=3600)
    # Long polls a worker keeps open (None: the SDK's 5 each). A worker that freezes or loses its
    # network keeps them open on the server, which hands them tasks it can no longer run (each one
    # retried after its timeout: an activity's heartbeat timeout, a workflow task's 10 s); fewer
    # polls, fewer such tasks. And how long a workflow's next task waits on the sticky queue of the
    # worker that ran it before it goes to any worker (the SDK's 10 s).
    worker_workflow_task_polls: int | None = Field(default=None, ge=2, le=100)
    worker_activity_task_polls: int | None = Field(default=None, ge=1, le=100)
    # A workflow task waits this long on the sticky queue of the worker that has the workflow cached
    # before any worker may take it (Temporal's default is 10 s): what a killed worker's workflows
    # wait once before they move on (the next workflow task goes to a live worker; worker.py).
    worker_sticky_queue_timeout_seconds: float = Field(default=3.0, gt=0, le=300)
    # Observability (docs/observability.md)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Loopback unless told otherwise (METRICS_HOST, HEALTH_HOST): the image sets 0.0.0.0.
    metrics_host: str = "127.0.0.1"
    # /healthz and /readyz (core/health.py) on a port of their own; None: not served.
    health_port: int | None = Field(default=None, ge=1, le=65535)
    health_host: str = "127.0.0.1"
    # OpenTelemetry (core/tracing.py): traces over OTLP, and Temporal's and the project's metrics
    # pushed over OTLP (gRPC) to this endpoint instead of served for Prometheus on metrics_port.
    otel_tracing: bool = False
    metrics_otlp_endpoint: str | None = None
    log_format: LogFormat = "text"
    # Security (docs/security.md)
    temporal_tls: bool | None = None  # None: TLS when a certificate, CA or API key is configured
    temporal_tls_cert: Path | None = None
    temporal_tls_key: Path | None = None
    temporal_tls_ca: Path | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: SecretStr | None = None
    payload_encryption_key: SecretStr | None = None
    payload_encryption_key_id: str = "default"
    # Key rotation (core.codec): older keys, decryption only; the key of the pseudonyms in workflow IDs.
    payload_decryption_keys: SecretStr | None = None
    payload_pseudonym_key_id: str | None = None
    payload_require_encryption: bool = False

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env: dict[str, str] = dict(os.environ)
        dev_env = read_dev_env(_state_dir(env))
        env.update({name: value for name, value in dev_env.items() if not env.get(name)})
        values: dict[str, object] = {
            "temporal_address": env.get("TEMPORAL_ADDRESS") or None,
            "temporal_namespace": env.get("TEMPORAL_NAMESPACE") or DEFAULT_NAMESPACE,
            "task_queue": env.get("TEMPORAL_TASK_QUEUE") or DEFAULT_TASK_QUEUE,
            "database_url": env.get("DATABASE_URL") or None,
            "temporal_ui_url": env.get("TEMPORAL_UI_URL") or None,
            "temporal_tls": env.get("TEMPORAL_TLS") or None,
            "temporal_tls_cert": env.get("TEMPORAL_TLS_CERT") or None,
            "temporal_tls_key": env.get("TEMPORAL_TLS_KEY") or None,
            "temporal_tls_ca": env.get("TEMPORAL_TLS_CA") or None,
            "temporal_tls_server_name": env.get("TEMPORAL_TLS_SERVER_NAME") or None,
            "temporal_api_key": _secret(env.get("TEMPORAL_API_KEY")),
            "payload_encryption_key": _secret(env.get("PAYLOAD_ENCRYPTION_KEY")),
            "payload_encryption_key_id": env.get("PAYLOAD_ENCRYPTION_KEY_ID") or "default",
            "payload_decryption_keys": _secret(env.get("PAYLOAD_DECRYPTION_KEYS")),
            "payload_pseudonym_key_id": env.get("PAYLOAD_PSEUDONYM_KEY_ID") or None,
            "payload_require_encryption": env.get("PAYLOAD_REQUIRE_ENCRYPTION") or False,
            "log_format": (env.get("LOG_FORMAT") or "text").lower(),
        }
        values.update(temporal_profile(env))
        if env.get("CLEANUP_STATE_DIR"):
            values["state_dir"] = Path(env["CLEANUP_STATE_DIR"])
        if env.get("DB_POOL_MAX_SIZE"):
            values["pool_max_size"] = int(env["DB_POOL_MAX_SIZE"])
        if env.get("DB_CLAIM_POOL_SIZE"):
            values["claim_pool_size"] = int(env["DB_CLAIM_POOL_SIZE"])
        if env.get("DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS"):
            values["db_idle_in_transaction_timeout_seconds"] = float(env["DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS"])
        if env.get("WORKER_MAX_CONCURRENT_ACTIVITIES"):
            values["max_concurrent_activities"] = int(env["WORKER_MAX_CONCURRENT_ACTIVITIES"])
        if env.get("WORKER_GRACEFUL_SHUTDOWN_SECONDS"):
            values["worker_graceful_shutdown_seconds"] = float(env["WORKER_GRACEFUL_SHUTDOWN_SECONDS"])
        for name, key, kind in (
            ("WORKER_WORKFLOW_TASK_POLLS", "worker_workflow_task_polls", int),
            ("WORKER_ACTIVITY_TASK_POLLS", "worker_activity_task_polls", int),
            ("WORKER_STICKY_QUEUE_TIMEOUT_SECONDS", "worker_sticky_queue_timeout_seconds", float),
        ):
            if env.get(name):
                values[key] = kind(env[name])
        if env.get("METRICS_PORT"):
            values["metrics_port"] = int(env["METRICS_PORT"])
        if env.get("METRICS_HOST"):
            values["metrics_host"] = env["METRICS_HOST"]
        if env.get("HEALTH_PORT"):
            values["health_port"] = int(env["HEALTH_PORT"])
        if env.get("HEALTH_HOST"):
            values["health_host"] = env["HEALTH_HOST"]
        if env.get("OTEL_TRACING"):
            values["otel_tracing"] = env["OTEL_TRACING"].strip().lower() in ("on", "1", "true", "yes")
        if env.get("METRICS_OTLP_ENDPOINT"):
            values["metrics_otlp_endpoint"] = env["METRICS_OTLP_ENDPOINT"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    def __repr_args__(self) -> Any:
        yield from super().__repr_args__()
        yield "database_url", mask_url(self.database_url)

    def safe_dict(self) -> dict[str, Any]:
        """Everything, with secrets masked: what may be printed or logged."""
        data = self.model_dump(mode="json")
        data["database_url"] = mask_url(self.database_url)
        return data

    def secrets(self) -> list[str]:
        """The secret values themselves, so log output can be scrubbed of them (core.logs)."""
        keys = (self.temporal_api_key, self.payload_encryption_key, self.payload_decryption_keys)
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
