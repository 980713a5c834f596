"""The 256 KiB envelope: reject oversized payloads at the edge, before they reach Temporal."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client

from core.errors import InputError

MAX_PAYLOAD_BYTES = 256 * 1024


class PayloadTooLargeError(InputError):
    pass


def ensure_within_envelope(client: Client, *values: Any, limit: int = MAX_PAYLOAD_BYTES) -> int:
    """Encode with the client's own converter and measure; returns the size in bytes."""
    payloads = client.data_converter.payload_converter.to_payloads(list(values))
    size = sum(p.ByteSize() for p in payloads)
    if size > limit:
        raise PayloadTooLargeError(
            f"input is {size / 1024:.0f} KiB, over the {limit // 1024} KiB envelope; nothing was started"
        )
    return size
