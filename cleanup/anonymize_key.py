"""The anonymize key, kept where the server never logs it (docs/targets.md, "The anonymize key").

A keyed hash must not put its key in a statement: with `log_statement` or
`log_min_duration_statement` on, Postgres logs every parameter, and the key falls out of its HMAC
pads by XOR. So the pads live in the service's table `anonymize_key` (the worker's and the owner's
roles only), written over COPY, whose rows the server never logs, and every statement that hashes
reads them in a subquery (cleanup.targets.PADS). A worker stores the configured key when none is
stored and refuses to start when another is (two keys would hash one value two ways);
`deadline-cleanup targets rotate-key` replaces it (the rotation procedure, docs/targets.md).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

import asyncpg

from cleanup.target_check import TargetsRefused
from cleanup.targets import anonymize_key_pads
from core import db
from core.queries import load

SQL = load(__file__, "anonymize_key.sql")
_FINGERPRINT_LABEL = b"deadline-cleanup anonymize key fingerprint v1"


def fingerprint(key: str) -> str:
    """Tells two keys apart without revealing either (an HMAC under the key of a fixed label)."""
    return hmac.new(key.encode(), _FINGERPRINT_LABEL, hashlib.sha256).hexdigest()[:16]


async def store_key(conn: asyncpg.Connection, key: str, *, rotate: bool = False) -> Literal["kept", "stored"]:
    """Store `key`'s pads unless they are stored already: 'kept' or 'stored'. Another key stored
    raises TargetsRefused unless `rotate` (then it is replaced, in one transaction)."""
    inner, outer = anonymize_key_pads(key)
    mine = fingerprint(key)
    async with db.transaction(conn):
        await conn.execute(SQL.lock_anonymize_key)
        stored = await conn.fetchval(SQL.anonymize_key_fingerprint)
        if stored == mine:
            return "kept"
        if stored is not None and not rotate:
            raise TargetsRefused(
                [
                    f"the anonymize key differs from the one stored in the database (fingerprint {stored},"
                    f" this worker's {mine}): give every worker the stored key, or rotate to this one with"
                    " `deadline-cleanup targets rotate-key`"
                ]
            )
        await conn.execute(SQL.forget_anonymize_key)
        await conn.copy_records_to_table(
            "anonymize_key",
            columns=["inner_pad", "outer_pad", "fingerprint"],
            records=[(inner, outer, mine)],
        )
    return "stored"
