"""Payload encryption: AES-256-GCM over every payload Temporal stores (inputs, results, heartbeats,
signals, queries, memos, failure messages).

Each encrypted payload has `encoding: binary/encrypted` and `encryption-key-id: <id>` in its
metadata; its data is a 12-byte random nonce followed by the ciphertext of the serialized original
payload (the key ID is the additional authenticated data). Decoding picks the key by that ID, so
keys can be rotated: encrypt with the newest key (PAYLOAD_ENCRYPTION_KEY / _ID), keep the older ones
for decryption (PAYLOAD_DECRYPTION_KEYS, `id:base64,id:base64`), so open workflows, the relays and
the schedules' stored arguments still decode. Workflow IDs and search attributes carry keyed
pseudonyms (`pseudonymize`): their key is PAYLOAD_PSEUDONYM_KEY_ID's (default: the newest key), so
a rotation keeps it on the old key's ID and the same account keeps the same workflow ID.

A payload without the encrypted encoding passes through unchanged (histories written before
encryption was turned on), unless plaintext is refused (PAYLOAD_REQUIRE_ENCRYPTION=1): then it is an
error, so nothing unencrypted written by another client is ever taken as input.

Search attributes and workflow IDs are never encoded by Temporal: keep identifiers out of them
(see docs/security.md).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes, PayloadCodec

ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
NONCE_BYTES = 12
# 32 random bytes hold about 30 distinct values; fewer than 8 (an all-zero key, "AAAA...=", a pattern
# typed by hand) is a placeholder, never a drawn key (the odds of drawing one are below 1e-30).
MIN_DISTINCT_KEY_BYTES = 8


class EncryptionKeyError(ValueError):
    """A key that is missing or malformed; the message never contains key material."""


class PlaintextPayloadError(ValueError):
    """A payload that is not encrypted, where plaintext is refused."""


def parse_key(text: str, *, name: str = "PAYLOAD_ENCRYPTION_KEY") -> bytes:
    """Base64 (standard or URL-safe) of exactly 32 bytes, random ones (a placeholder is refused)."""
    cleaned = text.strip()
    try:
        raw = base64.b64decode(cleaned, altchars=b"-_" if ("-" in cleaned or "_" in cleaned) else None, validate=True)
    except (binascii.Error, ValueError):
        raise EncryptionKeyError(f"{name} is not valid base64 (expected base64 of 32 random bytes)") from None
    if len(raw) != 32:
        raise EncryptionKeyError(f"{name} must decode to 32 bytes for AES-256-GCM, got {len(raw)}")
    if len(set(raw)) < MIN_DISTINCT_KEY_BYTES:
        raise EncryptionKeyError(f"{name} is a placeholder (a few byte values repeated), not 32 random bytes")
    return raw


def new_key() -> str:
    """A fresh key, base64: `python -c 'from core.codec import new_key; print(new_key())'`."""
    return base64.b64encode(os.urandom(32)).decode()


def parse_keyring(text: str, *, name: str = "PAYLOAD_DECRYPTION_KEYS") -> dict[str, bytes]:
    """`id:base64,id:base64` (base64 holds neither ',' nor ':'), e.g. the keys before a rotation."""
    keys: dict[str, bytes] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key_id, sep, key_b64 = item.partition(":")
        if not sep or not key_id.strip():
            raise EncryptionKeyError(f"{name} must be ID:BASE64 pairs separated by commas")
        keys[key_id.strip()] = parse_key(key_b64, name=f"{name} key {key_id.strip()!r}")
    return keys


class EncryptionCodec(PayloadCodec):
    def __init__(
        self,
        keys: Mapping[str, bytes],
        current_key_id: str,
        *,
        pseudonym_key_id: str | None = None,
        require_encryption: bool = False,
    ) -> None:
        for key_id in (current_key_id, pseudonym_key_id or current_key_id):
            if key_id not in keys:
                raise EncryptionKeyError(f"no key with ID {key_id!r}")
        self._ciphers = {key_id: AESGCM(key) for key_id, key in keys.items()}
        self._key_id = current_key_id
        self.pseudonym_key = pseudonym_key(keys[pseudonym_key_id or current_key_id])
        self.require_encryption = require_encryption

    @classmethod
    def from_config(
        cls,
        key_b64: str,
        key_id: str = "default",
        *,
        decryption_keys: str | None = None,
        pseudonym_key_id: str | None = None,
        require_encryption: bool = False,
    ) -> EncryptionCodec:
        """The newest key encrypts; it and the older `decryption_keys` decrypt."""
        keys = parse_keyring(decryption_keys or "")
        keys[key_id] = parse_key(key_b64)
        return cls(keys, key_id, pseudonym_key_id=pseudonym_key_id, require_encryption=require_encryption)

    @property
    def key_id(self) -> str:
        return self._key_id

    def encrypt(self, payload: Payload) -> Payload:
        nonce = os.urandom(NONCE_BYTES)
        aad = self._key_id.encode()
        sealed = self._ciphers[self._key_id].encrypt(nonce, payload.SerializeToString(), aad)
        return Payload(metadata={"encoding": ENCODING, KEY_ID_METADATA: aad}, data=nonce + sealed)

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            if self.require_encryption:
                raise PlaintextPayloadError("an unencrypted payload was refused (PAYLOAD_REQUIRE_ENCRYPTION)")
            return payload
        key_id = payload.metadata.get(KEY_ID_METADATA, b"").decode()
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise EncryptionKeyError(f"payload was encrypted with key {key_id!r}, which this process does not have")
        plain = cipher.decrypt(payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:], key_id.encode())
        original = Payload()
        original.ParseFromString(plain)
        return original

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]


def with_encryption(converter: DataConverter, codec: PayloadCodec) -> DataConverter:
    """`converter` plus the codec, with failure messages and stack traces moved into encoded attributes."""
    return dataclasses.replace(
        converter, payload_codec=codec, failure_converter_class=DefaultFailureConverterWithEncodedAttributes
    )


def pseudonym_key(key: bytes) -> bytes:
    return hmac.new(key, b"deadline-cleanup pseudonym v1", hashlib.sha256).digest()


def pseudonymize(codec: object, value: str) -> str:
    """What to put where Temporal cannot encrypt (workflow IDs, search attributes, summaries).

    With an `EncryptionCodec`, a keyed hash of `value` (`anon_` + 24 hex digits, stable for one
    key); without one, `value` itself.
    """
    if not isinstance(codec, EncryptionCodec):
        return value
    digest = hmac.new(codec.pseudonym_key, value.encode(), hashlib.sha256).hexdigest()[:24]
    return f"anon_{digest}"
