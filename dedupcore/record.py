"""Dedup records: their states and their stored format.

A record is what the authority knows about one key: its state, the fencing
token, the owner and lease of a PROCESSING claim, the fingerprint of the
request that created it, the stored result and timestamps (wall clock, for
retention). Lease deadlines are not stored: they are kept on the monotonic
clock of the owning process, and a record loaded at startup gets a fresh
lease of its stored duration (a holder may still be alive and complete it).

The embedded store keeps records in the native engine (``dedupcore._engine``),
which also encodes them; the format (version 2, docs/engine.md) is a
handful of bytes next to the 16-byte digest, with the optional parts stored
only when present and a checksum over digest and value::

    u8   head: state (bits 0-1), owner (bit 2), fingerprint (bit 3),
         result (bit 4), created differs from updated (bit 5)
    u16  namespace id            u48 updated (unix ms)
    [varint zigzag(updated - created) in ms]    varint token
    [u32 lease in ms, PROCESSING only]
    [u8 length, owner]  [u8 length, fingerprint]  [varint length, result]
    u32  low half of XXH64(digest + the bytes above)

A PROCESSED record without a result is 14-15 bytes.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import dedupcore._engine as _engine
from dedupcore.errors import CorruptFileError

__all__ = ["State", "decode_stored", "encode_stored"]


class State(enum.IntEnum):
    """Life cycle of a record."""

    PROCESSING = 1
    PROCESSED = 2
    RELEASED = 3  # a tombstone: the work may run again, the token keeps growing


def encode_stored(
    digest: bytes,
    state: State,
    ns_id: int,
    token: int,
    created: float,
    updated: float,
    lease: float,
    owner: bytes | None = None,
    fingerprint: bytes | None = None,
    result: bytes | None = None,
) -> bytes:
    """The stored bytes of one record under ``digest``."""
    return _engine.encode_value(
        digest, int(state), ns_id, token, created, updated, lease, owner, fingerprint, result
    )


def decode_stored(digest: bytes, raw: bytes, where: Path | str = "") -> tuple[Any, ...]:
    """(state, ns_id, token, created, updated, lease, owner, fingerprint, result) of a
    stored record; CorruptFileError if it fails its checksum or does not parse."""
    try:
        return tuple(_engine.decode_value(digest, raw))
    except ValueError:
        raise CorruptFileError(
            f"{where}: the record of digest {digest.hex()} fails its checksum or does not "
            "parse; the store refuses to answer from damaged data"
        ) from None
