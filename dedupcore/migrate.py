"""Migration of a data directory written with record format 1.

Format 1 stored every record with fixed 8-byte timestamps, a 4-byte lease
and length bytes for absent parts (about 40 bytes before owner, fingerprint
and result), and no checksum; its log payloads held format-1 records.
Opening such a directory read-write converts it in one durable LMDB
transaction: every record of the single format-1 tree and every record of
the log past the last checkpoint is written in format 2 (docs/engine.md)
into the first warm-tier slice, the checkpoint moves to the end of the log
and the format becomes b"2"; then the old tree and its expiry index are
deleted. A crash before that commit
leaves the directory in format 1, untouched; after it, the old log records
precede the checkpoint and are never read again. A read-only open of a
format-1 directory is refused with what to do.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from dedupcore.decision import Rec
from dedupcore.errors import CorruptFileError, UnsupportedFormatError
from dedupcore.record import State, encode_stored
from dedupcore.tiers.lmdb import FORMAT, LmdbTier
from dedupcore.wal import WriteAheadLog

__all__ = ["decode_v1", "encode_v2", "migrate_v1", "unpack_v1_batch"]

log = logging.getLogger("dedupcore.store")

_HEAD = struct.Struct("<BBHQddf")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_BATCH_COUNT = struct.Struct("<I")


def encode_v2(rec: Rec, digest: bytes) -> bytes:
    """The format-2 bytes of a record read from format 1."""
    return encode_stored(
        digest,
        rec.state,
        rec.ns_id,
        rec.token,
        rec.created,
        rec.updated,
        rec.lease,
        rec.owner,
        rec.fingerprint,
        rec.result,
    )


def decode_v1(data: bytes | memoryview) -> Rec:
    """A format-1 record (it kept no lease deadline); CorruptFileError if its bytes do
    not parse."""
    try:
        version, packed, ns_id, token, created, updated, lease = _HEAD.unpack_from(data)
        if version != 1:
            raise CorruptFileError(f"record version {version} is not 1")
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
        raise CorruptFileError(f"damaged format-1 record: {exc}") from exc
    return Rec(
        state,
        ns_id,
        token,
        created,
        updated,
        lease,
        owner=owner if flags & 1 else None,
        fingerprint=fp if flags & 2 else None,
        result=result if flags & 4 else None,
    )


def unpack_v1_batch(payload: bytes) -> Iterator[tuple[bytes, Rec]]:
    """The (digest, record) entries of a format-1 log payload."""
    try:
        (count,) = _BATCH_COUNT.unpack_from(payload)
        pos = _BATCH_COUNT.size
        view = memoryview(payload)
        for _ in range(count):
            digest = bytes(view[pos : pos + 16])
            (n,) = _U32.unpack_from(payload, pos + 16)
            start = pos + 16 + _U32.size
            if len(digest) != 16 or start + n > len(payload):
                raise CorruptFileError("log batch entry runs past its payload")
            yield digest, decode_v1(view[start : start + n])
            pos = start + n
        if pos != len(payload):
            raise CorruptFileError("log batch has trailing bytes")
    except struct.error as exc:
        raise CorruptFileError(f"malformed format-1 log batch: {exc}") from exc


def migrate_v1(lmdb_tier: LmdbTier, wal_dir: Path, *, readonly: bool) -> int:
    """Converts a format-1 data directory to the current format; returns the records converted."""
    if readonly:
        raise UnsupportedFormatError(
            f"{lmdb_tier.path}: the data directory uses record format 1; open it once "
            "read-write (DedupStore.open(path) or `dedupcore serve --data ...`), which "
            "converts it to format 2 in one transaction, then open it read-only"
        )
    items: dict[bytes, bytes] = {}
    for digest, raw in lmdb_tier.v1_records():
        items[digest] = encode_v2(decode_v1(raw), digest)
    logged: dict[bytes, Rec] = {}
    wal = WriteAheadLog.open(wal_dir)
    try:
        for _lsn, payload in wal.replay(lmdb_tier.checkpoint_lsn()):
            for digest, rec in unpack_v1_batch(payload):
                logged[digest] = rec
        last = max(wal.last_lsn, lmdb_tier.checkpoint_lsn())
        inflight: list[bytes] = []
        settled: list[bytes] = []
        for digest, rec in logged.items():
            items[digest] = encode_v2(rec, digest)
            (inflight if rec.state is State.PROCESSING else settled).append(digest)
        lmdb_tier.checkpoint(
            sorted(items.items()), sorted(inflight), settled, last, now=time.time(), fmt=FORMAT
        )
        lmdb_tier.drop_v1_trees()
        wal.rotate()
        wal.drop_through(last)
    finally:
        wal.close()
    lmdb_tier.format = FORMAT
    log.warning(
        "%s: converted %d records from record format 1 to %s",
        lmdb_tier.path,
        len(items),
        FORMAT.decode(),
    )
    return len(items)
