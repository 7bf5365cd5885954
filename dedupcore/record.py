"""Dedup records and their compact, versioned binary encoding.

A record is what the authority knows about one key: its state, the fencing
token, the owner and lease of a PROCESSING claim, the fingerprint of the
request that created it, the stored result and timestamps (wall clock, for
retention). Lease deadlines are not stored: they are kept on the monotonic
clock of the owning process, and a record loaded at startup gets a fresh
lease of its stored duration (a holder may still be alive and complete it).

Encoding (version 1), little-endian::

    u8  version (1)          u8  state
    u16 namespace id         u64 token
    f64 created (unix s)     f64 updated (unix s)
    f32 lease (s)            u8  owner length, owner bytes
    u8  fingerprint length, fingerprint bytes
    u32 result length, result bytes (msgpack)
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from dedupcore.errors import CorruptFileError

__all__ = ["Record", "State", "decode", "encode"]

VERSION = 1
_HEAD = struct.Struct("<BBHQddf")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
MAX_OWNER_BYTES = 255
MAX_FINGERPRINT_BYTES = 255


class State(enum.IntEnum):
    """Life cycle of a record."""

    PROCESSING = 1
    PROCESSED = 2
    RELEASED = 3  # a tombstone: the work may run again, the token keeps growing


@dataclass(slots=True)
class Record:
    """One key's record in the authority."""

    state: State
    ns_id: int
    token: int
    created: float
    updated: float
    lease: float
    owner: bytes | None = None
    fingerprint: bytes | None = None
    result: bytes | None = None  # msgpack-encoded result
    deadline: float = 0.0  # monotonic lease deadline (not stored)
    lsn: int = 0  # log position of the last change (not stored)


def encode(r: Record) -> bytes:
    """The record's stored bytes."""
    owner = r.owner or b""
    fp = r.fingerprint or b""
    result = r.result if r.result is not None else b""
    flags = (
        (1 if r.owner is not None else 0)
        | (2 if r.fingerprint is not None else 0)
        | (4 if r.result is not None else 0)
    )
    return b"".join(
        (
            _HEAD.pack(
                VERSION,
                int(r.state) | (flags << 4),
                r.ns_id,
                r.token,
                r.created,
                r.updated,
                r.lease,
            ),
            _U8.pack(len(owner)),
            owner,
            _U8.pack(len(fp)),
            fp,
            _U32.pack(len(result)),
            result,
        )
    )


def decode(data: bytes | memoryview) -> Record:
    """A record from its stored bytes; CorruptFileError if they are damaged."""
    try:
        version, packed, ns_id, token, created, updated, lease = _HEAD.unpack_from(data)
        if version != VERSION:
            raise CorruptFileError(f"record version {version} is not {VERSION}")
        state = State(packed & 0x0F)
        flags = packed >> 4
        pos = _HEAD.size
        (n,) = _U8.unpack_from(data, pos)
        owner = bytes(data[pos + 1 : pos + 1 + n])
        pos += 1 + n
        (n,) = _U8.unpack_from(data, pos)
        fp = bytes(data[pos + 1 : pos + 1 + n])
        pos += 1 + n
        (n,) = _U32.unpack_from(data, pos)
        result = bytes(data[pos + 4 : pos + 4 + n])
        if pos + 4 + n != len(data) or len(result) != n:
            raise CorruptFileError("record length does not match its fields")
    except (struct.error, ValueError) as exc:
        if isinstance(exc, CorruptFileError):
            raise
        raise CorruptFileError(f"damaged record: {exc}") from exc
    return Record(
        state=state,
        ns_id=ns_id,
        token=token,
        created=created,
        updated=updated,
        lease=lease,
        owner=owner if flags & 1 else None,
        fingerprint=fp if flags & 2 else None,
        result=result if flags & 4 else None,
    )
