"""Sealed ring slices as static filters: the fuse file format and the key log.

A :class:`~dedupcore.ring.BloomRing` with a path keeps, beside each unsealed
slice's Bloom filter, a *key log*: the 64-bit hashes of every key the slice
took, appended before the filter is saved. Once the slice is sealed (a newer
slice took its place) and no key can reach it any more, the ring builds a
binary fuse filter with 16-bit fingerprints from the log (``_core.FuseFilter``:
about 2.25 bytes per key at a false-positive rate of 2**-16, against about
3.1 bytes for the split-block Bloom filter at the ring's per-slice budget)
and drops the Bloom filter and the log (docs/warm-tier.md, "The cold
archive").

The Bloom filter stays the slice's authority until the fuse file and the
manifest naming it are durable, and a log that cannot prove it holds every
key the filter took (a torn tail is fine, a damaged chunk is not) leaves the
slice as it is. A fuse filter is never built from fewer keys than the Bloom
filter answers for.

Key log, little-endian, a sequence of chunks::

    offset size field
         0    4 magic b"DKLG"
         4    4 reserved, zero
         8    8 n: hashes in this chunk
        16  8*n the hashes
    16+8*n    8 XXH64 (seed 0) of the chunk's bytes 0 .. 16+8*n

Fuse file (version 1), little-endian, 128-byte header then the body::

    offset size field
         0    8 magic b"DEDUPFUS"
         8    2 format version (1)
        10    2 hash algorithm (1 = XXH64)
        12    4 number of filter parameters that follow (at most 6)
        16    8 hash seed of the keys (the ring's)
        24    8 count (distinct keys the filter was built from)
        32    8 XXH64 (seed 0) of the body
        40   48 filter parameters (FuseFilter.params), unused ones zero
        88   32 reserved, zero
       120    8 XXH64 (seed 0) of header bytes 0..119
       128    - body: the fingerprints
"""

from __future__ import annotations

import mmap as _mmap
import os
import struct
from pathlib import Path
from typing import BinaryIO

import dedupcore._core as _core
from dedupcore._files import FILE_MODE, FileHeader, resize_durably
from dedupcore.errors import CorruptFileError, UnsupportedFormatError

__all__ = ["KeyLog", "fuse_file_chunks", "fuse_file_params", "open_fuse"]

MAX_PARAMS = 6
#: The fuse file's header (above), written and checked by dedupcore/_files.py.
_FORMAT = FileHeader(
    struct.Struct("<8sHHIQQQ6Q32xQ"),
    b"DEDUPFUS",
    1,
    "a dedupcore fuse filter",
    newer="fuse format version",
    invalid="invalid fuse format version {version}",
)
FUSE_HEADER_SIZE = _FORMAT.size  # 128

LOG_MAGIC = b"DKLG"
LOG_HEAD = struct.Struct("<4sIQ")
LOG_TAIL = struct.Struct("<Q")
#: Hashes per chunk at most, so that a chunk's checksum covers a bounded span.
LOG_CHUNK = 1 << 20


def _pack_fuse_header(fuse: _core.FuseFilter, seed: int) -> bytes:
    params = tuple(fuse.params)
    if len(params) > MAX_PARAMS:
        raise ValueError(f"a fuse filter with {len(params)} parameters does not fit the header")
    return _FORMAT.pack(
        _core.HASH_ALGORITHM_XXH64,
        len(params),
        seed,
        fuse.count,
        fuse._checksum(),
        *params,
        *([0] * (MAX_PARAMS - len(params))),
    )


def fuse_file_chunks(fuse: _core.FuseFilter, seed: int) -> list[bytes | memoryview]:
    """The fuse file of ``fuse`` (built from hashes with ``seed``): header, then body."""
    return [_pack_fuse_header(fuse, seed), memoryview(fuse).cast("B")]


def open_fuse(
    path: str | os.PathLike[str], *, verify: bool = True, mmap: bool = False
) -> tuple[_core.FuseFilter, int]:
    """(the filter, its key hash seed) of a saved fuse file.

    The body is read into memory of the filter's own, in huge pages where the
    kernel gives them: a probe makes three random reads, and over a file
    mapping of 4 KiB pages each is a TLB miss (docs/warm-tier.md, "Sealed
    slices become fuse filters"). ``mmap=True`` maps the file read-only
    instead (nothing copied, shared page cache). A truncated, damaged or
    foreign file raises :class:`CorruptFileError`; one from a newer format,
    :class:`UnsupportedFormatError`. ``verify`` checks the body checksum,
    reading it once.
    """
    source = os.fspath(path)
    with open(source, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        seed, count, body_sum, params = _read_header(fh, source)
        if size <= FUSE_HEADER_SIZE:
            raise CorruptFileError(f"{source}: truncated: no body after the header")
        mapped = _mmap.mmap(fh.fileno(), 0, access=_mmap.ACCESS_READ)
    if mmap and hasattr(mapped, "madvise") and hasattr(_mmap, "MADV_RANDOM"):
        # Probes read three random fingerprints: readahead around each fault
        # only evicts other pages (measured on a cold 8 GiB body: 24 s for
        # 2,000 probes with readahead, 0.03 s without).
        mapped.madvise(_mmap.MADV_RANDOM)
    fuse = _core.FuseFilter()
    whole = memoryview(mapped)
    body = whole[FUSE_HEADER_SIZE:]
    try:
        # _attach checks that the body's length is exactly what the parameters say.
        fuse._attach(body, params, count, copy=not mmap)
    except ValueError as exc:
        raise CorruptFileError(f"{source}: {exc}") from None
    finally:
        if not mmap:  # the filter holds its own copy
            body.release()
            whole.release()
            mapped.close()
    if verify and fuse._checksum() != body_sum:
        raise CorruptFileError(f"{source}: body checksum mismatch")
    return fuse, seed


def _read_header(fh: BinaryIO, source: str) -> tuple[int, int, int, tuple[int, ...]]:
    """(key hash seed, count, body checksum, filter params) of a fuse file's header."""
    algorithm, nparams, seed, count, body_sum, *params = _FORMAT.unpack(
        fh.read(FUSE_HEADER_SIZE), source
    )
    if algorithm != _core.HASH_ALGORITHM_XXH64:
        raise UnsupportedFormatError(f"{source}: unknown hash algorithm id {algorithm}")
    if not 1 <= nparams <= MAX_PARAMS:
        raise CorruptFileError(f"{source}: invalid parameter count {nparams}")
    return seed, count, body_sum, tuple(params[:nparams])


def fuse_file_params(path: str | os.PathLike[str]) -> tuple[tuple[int, ...], int]:
    """(``FuseFilter.params``, count) of a saved fuse file, from its header alone
    (errors as :func:`open_fuse` raises them for the header)."""
    source = os.fspath(path)
    with open(source, "rb") as fh:
        _, count, _, params = _read_header(fh, source)
    return params, count


def _valid_chunks(data: bytes | bytearray | _mmap.mmap) -> list[tuple[int, int, int]]:
    """``(offset of the hashes, their count, end of the chunk)`` for each chunk of a
    key log's valid prefix, in order: whole chunks whose magic, count and checksum
    hold (format above). The walk stops at the first that does not; no view of
    ``data`` is left when it returns."""
    chunks: list[tuple[int, int, int]] = []
    with memoryview(data) as view:
        pos, size = 0, len(view)
        while pos + LOG_HEAD.size <= size:
            magic, _, n = LOG_HEAD.unpack_from(view, pos)
            end = pos + LOG_HEAD.size + 8 * n
            if magic != LOG_MAGIC or n > LOG_CHUNK or end + LOG_TAIL.size > size:
                break
            with view[pos:end] as chunk:
                if LOG_TAIL.unpack_from(view, end)[0] != _core.hash64(chunk):
                    break
            chunks.append((pos + LOG_HEAD.size, n, end + LOG_TAIL.size))
            pos = end + LOG_TAIL.size
    return chunks


class KeyLog:
    """The append-only log of the key hashes an unsealed slice took (format above).

    ``append`` writes and fsyncs before it returns: the ring appends a batch
    before it saves the Bloom filter holding it, so the log never lags the
    filter. ``hashes`` is how many the log vouches for: those appended through
    this object, or the count the ring's manifest recorded for a reopened log.
    Reading the log back (``read``) must prove at least that many.
    """

    def __init__(self, path: Path, hashes: int = 0) -> None:
        self.path = path
        self.hashes = hashes

    @classmethod
    def resume(cls, path: Path, committed: int) -> KeyLog | None:
        """The log of a reopened head slice, a torn tail cut off; None (the slice will
        not be rebuilt, its Bloom filter stays) if the log cannot prove ``committed``
        hashes."""
        log = cls(path)
        try:
            valid, hashes = log._scan()
        except FileNotFoundError:
            return None
        if hashes < committed:
            return None
        resize_durably(path, valid)
        log.hashes = hashes
        return log

    def append(self, hashes: memoryview) -> None:
        """Appends ``hashes`` (a uint64 buffer) in checksummed chunks, then fsyncs."""
        raw = memoryview(hashes).cast("B")
        # Owner only, as every file of the store: the hashes tell which keys were seen.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        with open(fd, "ab") as fh:
            for start in range(0, len(raw), 8 * LOG_CHUNK):
                body = raw[start : start + 8 * LOG_CHUNK]
                head = LOG_HEAD.pack(LOG_MAGIC, 0, len(body) // 8)
                fh.write(head)
                fh.write(body)
                fh.write(LOG_TAIL.pack(_core.hash64(head + bytes(body))))
            fh.flush()
            os.fsync(fh.fileno())
        self.hashes += len(raw) // 8

    def _scan(self) -> tuple[int, int]:
        """(bytes, hashes) of the log's valid prefix: whole chunks whose checksum holds."""
        valid = hashes = 0
        with open(self.path, "rb") as fh:
            if not os.fstat(fh.fileno()).st_size:
                return 0, 0
            # Mapped, not read: a head slice's log can be hundreds of MB.
            with _mmap.mmap(fh.fileno(), 0, access=_mmap.ACCESS_READ) as data:
                chunks = _valid_chunks(data)
        for _, n, end in chunks:
            valid = end
            hashes += n
        return valid, hashes

    def check(self) -> int:
        """The hashes of the log's valid prefix, read in place (mapped, not copied);
        :class:`CorruptFileError` if they are fewer than ``hashes`` (as :meth:`read`)."""
        try:
            _, hashes = self._scan()
        except FileNotFoundError:
            raise CorruptFileError(f"{self.path}: key log is missing") from None
        if hashes < self.hashes:
            raise CorruptFileError(
                f"{self.path}: key log holds {hashes} valid hashes; it vouches for {self.hashes}"
            )
        return hashes

    def read(self) -> memoryview:
        """Every hash of the log's valid prefix as one uint64 buffer.

        Raises :class:`CorruptFileError` when that prefix holds fewer than
        ``hashes`` (a chunk the log vouches for is damaged or missing): a
        filter built from it would miss keys.
        """
        try:
            data = bytearray(self.path.read_bytes())
        except FileNotFoundError:
            raise CorruptFileError(f"{self.path}: key log is missing") from None
        view = memoryview(data)
        out = 0
        for start, n, _ in _valid_chunks(data):
            # Compact in place: the hashes move down over the chunk framing (every
            # chunk was checked before the first move).
            view[out : out + 8 * n] = view[start : start + 8 * n]
            out += 8 * n
        if out // 8 < self.hashes:
            raise CorruptFileError(
                f"{self.path}: key log holds {out // 8} valid hashes; it vouches for {self.hashes}"
            )
        return view[:out].cast("Q")
