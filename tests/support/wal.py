"""Segments of the write-ahead log read with the documented format
(dedupcore/wal/__init__.py), for the tests that check what is on disk."""

from __future__ import annotations

import struct
from pathlib import Path

#: A segment's header (magic, version, first LSN, ...), before its first record.
HEADER_SIZE = 32
#: A record: length (u32) and LSN (u64), the payload, a checksum (u64).
_RECORD_HEAD = struct.Struct("<IQ")
_RECORD_TAIL = 8


def segment_frames(path: Path, size: int | None = None) -> list[tuple[int, int, int, bytes]]:
    """(lsn, start, end, payload) of each whole record of a segment file, or of its first
    ``size`` bytes, up to the zeros the log writes ahead of its appends (a record's LSN
    is never 0) or to a record cut short."""
    data = path.read_bytes()
    if size is not None:
        data = data[:size]
    out = []
    pos = HEADER_SIZE
    while pos + _RECORD_HEAD.size <= len(data):
        length, lsn = _RECORD_HEAD.unpack_from(data, pos)
        if lsn == 0:
            break
        start = pos + _RECORD_HEAD.size
        end = start + length + _RECORD_TAIL
        if end > len(data):
            break
        out.append((lsn, pos, end, data[start : start + length]))
        pos = end
    return out
