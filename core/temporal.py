"""Temporal client set-up shared by the worker, the starter and the tests."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from core.config import Settings


async def connect(settings: Settings) -> Client:
    if settings.temporal_address is None:
        raise ValueError("no Temporal address: resolve embedded defaults first (core.embedded.resolve)")
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
    )
