"""The write-ahead log's frames: the segment header, the records, the scan of a tail.

A segment file (``wal-<first_lsn:020d>.log``, dedupcore/wal/segments.py)
holds the records with consecutive LSNs from its first LSN up to the next
segment's first LSN minus one. All integers are little-endian.

Segment header (32 bytes; the frame every file header of dedupcore has,
dedupcore/_files.py)::

    offset size field
         0    8 magic b"DDCWAL01"
         8    2 format version (1)
        10    2 checksum algorithm (1 = XXH64)
        12    4 reserved, zero
        16    8 first LSN (equals the LSN in the file name)
        24    8 XXH64 (seed 0) of header bytes 0..23

Record, repeated up to the end of the file (20 bytes of framing)::

    offset size field
         0    4 payload length n, at most MAX_RECORD_BYTES (64 MiB)
         4    8 LSN: the previous record's plus 1 (the first is the header's)
        12    n payload
      12+n    8 XXH64 (seed 0) of bytes 0..12+n-1 (length, LSN and payload)

The LSN inside each record makes a stale or misplaced record invalid even
when its checksum is right, and makes a zero-filled tail invalid (LSN 0 is
never expected). A batch is framed by the native core
(``_core.frame_records``); :class:`Scan` reads records back up to the first
invalid byte, and :func:`later_record` tells a torn tail (nothing valid
after it) from damage (a valid record that continues the log follows): the
package's documentation, "Recovery: torn tail versus damage".
"""

from __future__ import annotations

import mmap as _mmap
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dedupcore._core as _core
import dedupcore._files as _files

__all__ = [
    "CHECKSUM",
    "FORMAT_VERSION",
    "FRAME_HEAD",
    "FRAME_OVERHEAD",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_LSN",
    "MAX_RECORD_BYTES",
    "Mapped",
    "Scan",
    "all_zero",
    "check_lsn",
    "check_payloads",
    "header_problem",
    "later_record",
    "pack_header",
    "payload_list",
]

#: The segment header (above), written and checked by dedupcore/_files.py.
_HEADER = _files.FileHeader(
    struct.Struct("<8sHHIQQ"),
    b"DDCWAL01",
    1,
    "a dedupcore write-ahead log segment",
    newer="WAL format version",
)
MAGIC, FORMAT_VERSION = _HEADER.magic, _HEADER.version
HEADER, HEADER_SIZE = _HEADER.layout, _HEADER.size  # 32 bytes
FRAME_HEAD = struct.Struct("<IQ")
CHECKSUM = _files.CHECKSUM
FRAME_OVERHEAD = FRAME_HEAD.size + CHECKSUM.size
MAX_RECORD_BYTES = 64 << 20
MAX_LSN = (1 << 64) - 1


def all_zero(view: memoryview) -> bool:
    """True if every byte of ``view`` is zero."""
    return view.tobytes().count(0) == len(view)


def pack_header(first_lsn: int) -> bytes:
    """The header of the segment whose first LSN is ``first_lsn``."""
    return _HEADER.pack(_core.HASH_ALGORITHM_XXH64, 0, first_lsn)


def header_problem(buf: bytes | memoryview, first_lsn: int, source: str) -> str | None:
    """Why a segment header is invalid, or None; UnsupportedFormatError for newer versions."""
    if len(buf) < HEADER_SIZE:
        return f"truncated header: {len(buf)} bytes, shorter than {HEADER_SIZE}"
    problem = _HEADER.problem(buf, source)
    if problem is not None:
        return problem
    _magic, _version, algorithm, _reserved, lsn, _checksum = HEADER.unpack_from(buf)
    if algorithm != _core.HASH_ALGORITHM_XXH64:
        return f"unknown checksum algorithm id {algorithm}"
    if lsn != first_lsn:
        return f"header says first LSN {lsn}, file name says {first_lsn}"
    return None


class Scan:
    """Walks the records of one segment's bytes, stopping at the first invalid byte."""

    __slots__ = ("buf", "next_lsn", "pos", "problem")

    def __init__(self, buf: bytes | memoryview, first_lsn: int) -> None:
        self.buf = buf
        self.pos = HEADER_SIZE  # end of the last valid record
        self.next_lsn = first_lsn  # LSN the next record must carry
        self.problem: str | None = None

    def records(self, through: int | None = None) -> Iterator[tuple[int, int, int]]:
        """Yields (lsn, payload start, payload end) of valid records, up to LSN ``through``."""
        buf = self.buf
        size = len(buf)
        while self.pos < size:
            if through is not None and self.next_lsn > through:
                return
            start = self.pos
            if size - start < FRAME_HEAD.size:
                self.problem = f"truncated record header ({size - start} bytes)"
                return
            length, lsn = FRAME_HEAD.unpack_from(buf, start)
            if lsn != self.next_lsn:
                self.problem = f"record carries LSN {lsn} where {self.next_lsn} was expected"
                return
            if length > MAX_RECORD_BYTES:
                self.problem = (
                    f"record length field {length} exceeds the maximum {MAX_RECORD_BYTES}"
                )
                return
            body_end = start + FRAME_HEAD.size + length
            end = body_end + CHECKSUM.size
            if end > size:
                self.problem = (
                    f"truncated record: {end - start} bytes needed, {size - start} present"
                )
                return
            (stored,) = CHECKSUM.unpack_from(buf, body_end)
            if stored != _core.hash64(buf[start:body_end]):
                self.problem = f"checksum mismatch in the record of LSN {lsn}"
                return
            yield lsn, start + FRAME_HEAD.size, body_end
            self.pos = end
            self.next_lsn += 1


# The last nonzero byte of an LSN below 2**32 and the zero bytes after it (see later_record).
_SMALL_LSN_END = re.compile(b"[^\x00]\x00\x00\x00\x00")


def frame_at(buf: bytes | memoryview, pos: int, lo: int, hi: int) -> int | None:
    """The LSN of a valid record at offset ``pos`` carrying an LSN in lo..hi, else None."""
    size = len(buf)
    if pos < 0 or size - pos < FRAME_OVERHEAD:
        return None
    length, lsn = FRAME_HEAD.unpack_from(buf, pos)
    if not lo <= lsn <= hi or length > MAX_RECORD_BYTES:
        return None
    body_end = pos + FRAME_HEAD.size + length
    if body_end + CHECKSUM.size > size:
        return None
    (stored,) = CHECKSUM.unpack_from(buf, body_end)
    return lsn if stored == _core.hash64(buf[pos:body_end]) else None


def later_record(buf: bytes | memoryview, start: int, next_lsn: int) -> tuple[int, int] | None:
    """(offset, LSN) of a valid record at or after ``start`` carrying ``next_lsn`` or later.

    Any LSN from ``next_lsn`` up to the end of the 2**32 block after its own
    counts: farther than records could reach in a file. Rather than trying every offset in Python,
    candidates come from C-speed searches for the upper half of such an LSN:
    its 4 bytes when nonzero, else the last nonzero byte of the lower half
    followed by 4 zero bytes. A zero-filled tail has no candidate at all; a
    candidate counts only with a valid checksum.
    """
    size = len(buf)
    if size - start < FRAME_OVERHEAD:
        return None
    lo = next_lsn
    hi = min(MAX_LSN, (((next_lsn >> 32) + 2) << 32) - 1)
    best: tuple[int, int] | None = None
    for high in range(lo >> 32, (hi >> 32) + 1):
        if high:
            pattern = re.compile(re.escape(high.to_bytes(4, "little")))
            shifts: tuple[int, ...] = (8,)  # the upper half starts 8 bytes into a record
        else:
            pattern = _SMALL_LSN_END
            shifts = (7, 6, 5, 4)  # the last nonzero byte is one of LSN bytes 0..3
        match = pattern.search(buf, start)
        while match is not None:
            at = match.start()
            if best is not None and at - max(shifts) >= best[0]:
                break
            for shift in shifts:
                if at - shift >= start:
                    lsn = frame_at(buf, at - shift, lo, hi)
                    if lsn is not None and (best is None or at - shift < best[0]):
                        best = (at - shift, lsn)
            match = pattern.search(buf, at + 1)
    return best


class Mapped:
    """A segment file's bytes, memory-mapped read-only (empty files read as b"")."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        size = os.fstat(self._file.fileno()).st_size
        self._map: _mmap.mmap | None = None
        if size:
            self._map = _mmap.mmap(self._file.fileno(), size, access=_mmap.ACCESS_READ)
            self.view: memoryview = memoryview(self._map)
        else:
            self.view = memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            self._map.close()
        self._file.close()

    def __enter__(self) -> Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_lsn(name: str, value: object) -> int:
    """An LSN argument: an int in 0..2**64-1 (TypeError, ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_LSN:
        raise ValueError(f"{name} must be in 0..2**64-1, got {value}")
    return value


def payload_list(payloads: object) -> list[Any]:
    """The payloads of an append as a list; each is checked as it is framed
    (``_core.frame_records``, with :func:`check_payloads` naming a bad one)."""
    if type(payloads) is list:
        return payloads.copy()  # a snapshot: the caller's list may change meanwhile
    return check_payloads(payloads)


def check_payloads(payloads: object) -> list[bytes | bytearray | memoryview]:
    """The payloads as a list, each checked: bytes-like and at most MAX_RECORD_BYTES."""
    if isinstance(payloads, (bytes, bytearray, memoryview, str)):
        raise TypeError(
            f"append takes a sequence of payloads, not a single {type(payloads).__name__} "
            "(wrap one payload in a list)"
        )
    try:
        items = list(payloads)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"append takes a sequence of bytes payloads, not {type(payloads).__name__}"
        ) from None
    out: list[bytes | bytearray | memoryview] = []
    for i, item in enumerate(items):
        if isinstance(item, memoryview):
            if not item.c_contiguous:
                raise TypeError(f"payload {i} is a non-contiguous memoryview")
            item = item.cast("B")
        elif not isinstance(item, (bytes, bytearray)):
            hint = " (encode text first)" if isinstance(item, str) else ""
            raise TypeError(
                f"payload {i} must be bytes, bytearray or memoryview, "
                f"not {type(item).__name__}{hint}"
            )
        if len(item) > MAX_RECORD_BYTES:
            raise ValueError(
                f"payload {i} is {len(item)} bytes; a record holds at most {MAX_RECORD_BYTES} bytes"
            )
        out.append(item)
    return out
