"""Temporal client set-up shared by the worker, the starter and the tests."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

from core import search_attributes as sa
from core.config import Settings


async def connect(settings: Settings) -> Client:
    if settings.temporal_address is None:
        raise ValueError("no Temporal address: resolve embedded defaults first (core.embedded.resolve)")
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
    )


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
