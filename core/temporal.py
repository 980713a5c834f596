"""Temporal client set-up shared by the worker, the starter and the tests.

`connect()` applies everything security-related from `Settings` (docs/security.md): mTLS client
certificate and key (with an optional CA and server name), an API key, and payload encryption
when a key is configured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client, WorkflowExecutionDescription
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from core import search_attributes as sa
from core import tracing
from core.config import Settings
from core.errors import InputError, TemporalUnavailable

# The workflow task timeout every workflow is started with (Temporal's default is 10 s). A worker that
# dies while it holds a workflow task (say, while a local activity such as the cleanup's settlement
# runs in it) stalls that workflow this long; a live worker finishes a task in milliseconds, and one
# running a longer local activity reports progress at 80% of it, so 5 s never cuts one short.
WORKFLOW_TASK_TIMEOUT = timedelta(seconds=5)


def data_converter(settings: Settings) -> DataConverter:
    """The pydantic converter, plus AES-GCM payload encryption when a key is configured."""
    if settings.payload_encryption_key is None:
        if settings.payload_decryption_keys is not None or settings.payload_require_encryption:
            raise InputError("PAYLOAD_DECRYPTION_KEYS / PAYLOAD_REQUIRE_ENCRYPTION need PAYLOAD_ENCRYPTION_KEY")
        return pydantic_data_converter
    from core.codec import EncryptionCodec, EncryptionKeyError, with_encryption  # lazy: cryptography is slow to import

    try:
        codec = EncryptionCodec.from_config(
            settings.payload_encryption_key.get_secret_value(),
            settings.payload_encryption_key_id,
            decryption_keys=(
                settings.payload_decryption_keys.get_secret_value() if settings.payload_decryption_keys else None
            ),
            pseudonym_key_id=settings.payload_pseudonym_key_id,
            require_encryption=settings.payload_require_encryption,
        )
    except EncryptionKeyError as err:
        raise InputError(str(err)) from None
    return with_encryption(pydantic_data_converter, codec)


def _read(path: object, what: str) -> bytes:
    try:
        with open(str(path), "rb") as f:
            return f.read()
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror}") from None


def tls_config(settings: Settings) -> TLSConfig | bool:
    """mTLS when a client certificate is configured; server-only TLS when just a CA or an API key is."""
    cert, key = settings.temporal_tls_cert, settings.temporal_tls_key
    if (cert is None) != (key is None):
        raise InputError("TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH must be set together")
    if settings.temporal_tls is False:
        if cert is not None:
            raise InputError("TEMPORAL_TLS=false contradicts TEMPORAL_TLS_CERT (mTLS needs TLS)")
        return False
    if cert is None and settings.temporal_tls_ca is None and settings.temporal_tls_server_name is None:
        # An API key is a bearer credential: by default it is never sent in clear text.
        return bool(settings.temporal_tls) or settings.temporal_api_key is not None
    return TLSConfig(
        client_cert=_read(cert, "TEMPORAL_TLS_CERT") if cert else None,
        client_private_key=_read(key, "TEMPORAL_TLS_KEY") if key else None,
        server_root_ca_cert=_read(settings.temporal_tls_ca, "TEMPORAL_TLS_CA") if settings.temporal_tls_ca else None,
        domain=settings.temporal_tls_server_name,
    )


CONNECT_READY_TIMEOUT = 30.0

# What the SDK's connect error says when the address itself is wrong (a fix of the configuration,
# exit 2), not the server away (75): a host name that does not resolve (not EAI_AGAIN, "Temporary
# failure in name resolution", which is the resolver away), or credentials the server refused.
_HOST_UNKNOWN = ("Name or service not known", "No address associated with hostname", "nodename nor servname")
_REFUSED_CREDENTIALS = ("Unauthenticated", "PermissionDenied")


def server_starting_up(err: BaseException) -> bool:
    """The frontend is up but not serving yet (`Unavailable: Frontend is not healthy yet`)."""
    return "Unavailable" in str(err) or "not healthy yet" in str(err)


async def connect(settings: Settings, *, runtime: Runtime | None = None, ready_timeout: float | None = None) -> Client:
    """Connect, retrying for a bounded time while a just-started server is still becoming healthy.

    Each attempt is bounded by CONNECT_TIMEOUT_SECONDS, as a database connection is (the SDK's own
    bound, 30 s, applies to a server that accepts TCP and never answers): TemporalUnavailable (exit
    75) after that long. A wrong address or refused credentials are InputError (exit 2) naming the
    setting to fix."""
    if settings.temporal_address is None:
        raise ValueError("no Temporal address: check it first (core.addresses.require)")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (CONNECT_READY_TIMEOUT if ready_timeout is None else ready_timeout)
    attempt_timeout = settings.connect_timeout_seconds
    options: dict[str, Any] = {  # bad values here are InputError before any attempt
        "namespace": settings.temporal_namespace,
        "data_converter": data_converter(settings),
        "tls": tls_config(settings),
        "api_key": settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None,
        "runtime": runtime,
        "plugins": tracing.plugins(settings),
    }
    while True:
        try:
            return await asyncio.wait_for(Client.connect(settings.temporal_address, **options), attempt_timeout)
        except TimeoutError:
            raise TemporalUnavailable(
                f"Temporal at {settings.temporal_address} (TEMPORAL_ADDRESS / --temporal-address) accepted the "
                f"connection but did not answer within {attempt_timeout:g} s (CONNECT_TIMEOUT_SECONDS); check that "
                "a Temporal frontend runs there, and the TLS settings"
            ) from None
        except ValueError as err:  # the SDK refuses the address itself: "invalid target URL: ..."
            raise InputError(
                f"TEMPORAL_ADDRESS (--temporal-address) {settings.temporal_address!r} is not a host:port: "
                f"{_first_line(err)}"
            ) from None
        except RuntimeError as err:
            if server_starting_up(err) and loop.time() <= deadline:
                await asyncio.sleep(0.5)
                continue
            raise connect_failure(settings, err) from None


def connect_failure(settings: Settings, err: BaseException) -> InputError | TemporalUnavailable:
    """A failed connect, classified: the configuration to fix (exit 2) or the server away (exit 75)."""
    text, address = str(err), settings.temporal_address
    if "dns error" in text and any(sign in text for sign in _HOST_UNKNOWN):
        host = (address or "").rsplit(":", 1)[0]
        return InputError(
            f"the host name {host!r} of TEMPORAL_ADDRESS (--temporal-address) does not resolve: fix the address"
        )
    if any(sign in text for sign in _REFUSED_CREDENTIALS):
        return InputError(
            f"Temporal at {address} refused this client's credentials: fix TEMPORAL_API_KEY or the TLS client "
            "certificate (TEMPORAL_TLS_CLIENT_CERT_PATH / TEMPORAL_TLS_CLIENT_KEY_PATH)"
        )
    return TemporalUnavailable(
        f"cannot reach Temporal at {address} (TEMPORAL_ADDRESS / --temporal-address): "
        f"{_first_line(err)}; check that the server runs there, and the TLS and API-key settings"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:300]


async def ensure_search_attributes(client: Client, namespace: str) -> list[str]:
    """Register the project's custom search attributes where they are missing; returns those added."""
    try:
        existing = set(
            (
                await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
            ).custom_attributes
        )
    except RPCError as err:
        if err.status != RPCStatusCode.UNIMPLEMENTED:  # the time-skipping server can add but not list
            raise
        existing = set()
    missing = {
        key.name: IndexedValueType.ValueType(key.indexed_value_type) for key in sa.ALL if key.name not in existing
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
    return sorted(missing)


async def describe_or_none(client: Client, workflow_id: str) -> WorkflowExecutionDescription | None:
    """The workflow's description, or None when no workflow has this ID."""
    try:
        return await client.get_workflow_handle(workflow_id).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


# How long a status waits for a worker to answer a workflow's query: more than the sticky-queue wait
# (WORKER_STICKY_QUEUE_TIMEOUT_SECONDS, 3 s) after which a live worker takes the query of one that
# died, far less than the SDK's own bound (30 s, an operator staring at a hung command while every
# worker is down, the moment a status is most needed).
STATUS_QUERY_TIMEOUT = 5.0

T = TypeVar("T")


async def query_or_note(
    desc: WorkflowExecutionDescription, client: Client, query: str, result_type: type[T]
) -> tuple[T | None, str | None]:
    """A running workflow's live status query, bounded: (the answer, None), or (None, a sentence
    saying no worker answered) when none did within STATUS_QUERY_TIMEOUT. The caller then answers
    from what Temporal's describe and the database know. A worker's failed answer is raised."""
    handle = client.get_workflow_handle(desc.id, run_id=desc.run_id)
    timeout = timedelta(seconds=STATUS_QUERY_TIMEOUT)
    try:
        # wait_for as well: the RPC deadline bounds each call, not the SDK's retries of it.
        answer = await asyncio.wait_for(
            handle.query(query, result_type=result_type, rpc_timeout=timeout), STATUS_QUERY_TIMEOUT + 1
        )
    except TimeoutError:
        pass
    except RPCError as err:
        if err.status not in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
            raise
    else:
        return answer, None
    return None, (
        f"no worker answered the status query within {STATUS_QUERY_TIMEOUT:g} s (task queue {desc.task_queue}: "
        "are the workers running?)"
    )


class StartOutcome(NamedTuple):
    run_id: str | None
    started: bool  # True only when this call started the run
    # True: a run with this ID was already running and this call joined it (USE_EXISTING: a second
    # caller, or one that raced the first); started and joined both False: a closed run with this ID
    # exists (never repeated).
    joined: bool = False


class WorkflowStart(NamedTuple):
    """One start of `workflow` with `arg` under the business key `workflow_id`: the options of the
    single `Client.start_workflow` call of `start_idempotently`, named as there."""

    workflow: str
    arg: Any
    workflow_id: str
    task_queue: str
    summary: str
    result_type: type | None = None
    search_attributes: Sequence[SearchAttributePair[Any]] = ()
    memo: Mapping[str, Any] | None = None
    # Start again under an ID whose run closed (long-lived loops such as the planner or a relay).
    repeat_closed: bool = False


async def start_idempotently(client: Client, start: WorkflowStart) -> StartOutcome:
    """Start `start.workflow` under the business key `start.workflow_id`, once: a running run with
    that ID is joined (USE_EXISTING: a second caller, or a racing one, gets it back), and a closed one
    is never started again unless `start.repeat_closed`."""
    try:
        handle = await client.start_workflow(
            start.workflow,
            start.arg,
            result_type=start.result_type,
            id=start.workflow_id,
            task_queue=start.task_queue,
            task_timeout=WORKFLOW_TASK_TIMEOUT,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=(
                WorkflowIDReusePolicy.ALLOW_DUPLICATE if start.repeat_closed else WorkflowIDReusePolicy.REJECT_DUPLICATE
            ),
            search_attributes=TypedSearchAttributes(list(start.search_attributes)) if start.search_attributes else None,
            memo=dict(start.memo) if start.memo is not None else None,
            static_summary=start.summary,
        )
    except WorkflowAlreadyStartedError as err:
        return StartOutcome(err.run_id, False)
    created = _started_by_this_call(handle)
    return StartOutcome(handle.result_run_id, created, joined=not created)


def _started_by_this_call(handle: Any) -> bool:
    """The server's answer to the start: `started` is False when USE_EXISTING returned the run that
    was already running. The SDK keeps the response on the handle only (no public accessor), so a
    handle without it is read as started, as before; tests/test_start_races.py pins the behaviour."""
    response = getattr(handle, "_start_workflow_response", None)
    return bool(getattr(response, "started", True))
