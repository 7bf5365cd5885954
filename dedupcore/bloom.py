"""Split-block Bloom filters and time-sliced filter rings.

:class:`BloomFilter` is a set-like filter whose hot paths (single keys and
batches) are the native core's. This module adds what the core leaves out:
sizing from a capacity and a target false-positive rate, the file format, and
:class:`BloomRing`, a ring of filters, one per time bucket, for keys that
expire.

File format (version 1), little-endian, 128-byte header then the body::

    offset size field
         0    8 magic b"DEDUPBLM"
         8    2 format version (1)
        10    2 hash algorithm (1 = XXH64)
        12    4 block size in bytes (64)
        16    8 hash seed
        24    8 number of blocks
        32    8 capacity (keys the filter was sized for)
        40    8 error rate (float64)
        48    8 count (keys added that were new)
        56    8 XXH64 (seed 0) of the body
        64   56 reserved, zero
       120    8 XXH64 (seed 0) of header bytes 0..119
       128    - body: nblocks * 64 bytes

The body starts at offset 128, so a memory-mapped body is cache-line aligned.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import mmap as _mmap
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import dedupcore._core as _core
from dedupcore._files import FileHeader, mkdir_private
from dedupcore._files import atomic_write as atomic_write  # re-exported for older importers
from dedupcore.errors import CorruptFileError, UnsupportedFormatError
from dedupcore.fuse import KeyLog, fuse_file_chunks, open_fuse

log = logging.getLogger(__name__)

__all__ = [
    "BloomFilter",
    "BloomRing",
    "SliceInfo",
    "blocks_for",
    "split_block_fpr",
]

MAGIC = b"DEDUPBLM"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHIQQQdQQ56xQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 128
_FORMAT = FileHeader(HEADER, MAGIC, FORMAT_VERSION, "a dedupcore Bloom filter")
MAX_SEED = (1 << 64) - 1

Keys = Iterable[bytes | bytearray | memoryview | str] | memoryview


def split_block_fpr(keys_per_block: float) -> float:
    """False-positive rate of the split-block layout at a mean load per block.

    A block holding j keys answers a random absent key positive with
    probability (1 - (63/64)^j)^8 (one bit in each of 8 lanes of 64 bits);
    loads are Poisson with mean ``keys_per_block``.
    """
    lam = float(keys_per_block)
    if lam <= 0.0:
        return 0.0
    top = int(lam + 12.0 * math.sqrt(lam) + 30.0)
    log_lam = math.log(lam)
    total = 0.0
    for j in range(1, top + 1):
        weight = math.exp(j * log_lam - lam - math.lgamma(j + 1))
        total += weight * (1.0 - (63.0 / 64.0) ** j) ** 8
    return total


@functools.lru_cache(maxsize=256)
def _load_for(error_rate: float) -> float:
    """Largest mean keys per block whose false-positive rate is at most error_rate.

    Kept per rate: the bisection costs milliseconds of Python arithmetic, and a
    store makes a filter at every slice and every sub-filter a slice grows
    (5 % of a fresh store's first 200k claims, in py-spy, before it was kept)."""
    lo, hi = 1e-9, 4096.0
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if split_block_fpr(mid) <= error_rate:
            lo = mid
        else:
            hi = mid
    return lo


def blocks_for(capacity: int, error_rate: float) -> int:
    """Number of 64-byte blocks that keep ``capacity`` keys under ``error_rate``."""
    _check_capacity(capacity)
    _check_error_rate(error_rate)
    nblocks = max(1, math.ceil(capacity / _load_for(error_rate)))
    if nblocks > _core.MAX_BLOCKS:
        raise ValueError(
            f"capacity {capacity} at error_rate {error_rate} needs {nblocks} blocks; "
            f"the layout allows at most {_core.MAX_BLOCKS} (256 GiB)"
        )
    return nblocks


def _check_capacity(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    return capacity


def _check_error_rate(error_rate: object) -> float:
    if isinstance(error_rate, bool) or not isinstance(error_rate, (int, float)):
        raise TypeError(f"error_rate must be a float, not {type(error_rate).__name__}")
    rate = float(error_rate)
    if not 0.0 < rate < 1.0:
        raise ValueError(f"error_rate must be in (0, 1), got {error_rate!r}")
    return rate


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    return seed


@dataclass(frozen=True)
class _Header:
    seed: int
    nblocks: int
    capacity: int
    error_rate: float
    count: int
    body_checksum: int


def _pack_header(bf: _core.BlockFilter, count: int, body_checksum: int) -> bytes:
    return _FORMAT.pack(
        _core.HASH_ALGORITHM_XXH64,
        _core.BLOCK_BYTES,
        bf.seed,
        bf.nblocks,
        bf.capacity,
        bf.error_rate,
        count,
        body_checksum,
    )


def _serialize(bf: _core.BlockFilter) -> tuple[bytes, bytes]:
    """(header, body) of a consistent snapshot, safe while other threads add keys."""
    body, count, checksum = bf._snapshot()
    return _pack_header(bf, count, checksum), body


def _parse_header(head: bytes, total_size: int, source: str) -> _Header:
    (
        algorithm,
        block_bytes,
        seed,
        nblocks,
        capacity,
        error_rate,
        count,
        body_checksum,
    ) = _FORMAT.unpack(head, source)
    if algorithm != _core.HASH_ALGORITHM_XXH64:
        raise UnsupportedFormatError(f"{source}: unknown hash algorithm id {algorithm}")
    if block_bytes != _core.BLOCK_BYTES:
        raise CorruptFileError(f"{source}: unsupported block size {block_bytes}")
    if not 1 <= nblocks <= _core.MAX_BLOCKS:
        raise CorruptFileError(f"{source}: invalid block count {nblocks}")
    if not 0.0 < error_rate < 1.0 or capacity <= 0:
        raise CorruptFileError(f"{source}: invalid capacity/error rate in header")
    expected = HEADER_SIZE + nblocks * _core.BLOCK_BYTES
    if total_size != expected:
        what = "truncated" if total_size < expected else "has trailing bytes"
        raise CorruptFileError(f"{source}: {what}: {total_size} bytes, header says {expected}")
    return _Header(seed, nblocks, capacity, error_rate, count, body_checksum)


class BloomFilter(_core.BlockFilter):
    """A split-block Bloom filter sized for ``capacity`` keys at ``error_rate``.

    Feels like a set that may answer "maybe" for an absent key, never "no" for
    a present one: ``add``, ``in``, ``update``, ``|``, ``|=``, ``copy``,
    ``len`` (keys added that were new). Batches go through ``add_many`` and
    ``contains_many``, which take a list of bytes/str keys or a uint64 buffer
    of pre-hashed keys (``hash64(key, seed=bf.seed)``) and return per-key flags.

    Keys are hashed with XXH64 (seeded, stable across processes and machines),
    so saved filters can be reopened anywhere.
    """

    def __init__(self, capacity: int, error_rate: float = 0.001, *, seed: int = 0) -> None:
        capacity = _check_capacity(capacity)
        error_rate = _check_error_rate(error_rate)
        seed = _check_seed(seed)
        self._allocate(blocks_for(capacity, error_rate), seed, capacity, error_rate)

    # -- derived figures -----------------------------------------------------

    @property
    def bits_per_key(self) -> float:
        """Bits of memory per key of capacity."""
        return self.nbytes * 8 / self.capacity

    @property
    def fill_ratio(self) -> float:
        """Fraction of bits set."""
        return float(self._bits_set()) / (self.nbytes * 8)

    @property
    def estimated_fpr(self) -> float:
        """False-positive rate for a random absent key, computed from the bits set now."""
        return float(self._fpr_now())

    @property
    def expected_fpr(self) -> float:
        """False-positive rate the layout predicts at the current count."""
        return split_block_fpr(self.count / self.nblocks)

    def __repr__(self) -> str:
        return (
            f"<BloomFilter capacity={self.capacity} error_rate={self.error_rate} "
            f"count={self.count} nbytes={self.nbytes}{' readonly' if self.readonly else ''}>"
        )

    # -- set-like operations -------------------------------------------------

    def copy(self) -> BloomFilter:
        """A writable copy with the same geometry, seed, bits and count."""
        new = BloomFilter.__new__(BloomFilter)
        new._allocate(self.nblocks, self.seed, self.capacity, self.error_rate)
        new._copy_body_from(self)
        return new

    def _check_compatible(self, other: object) -> _core.BlockFilter:
        if not isinstance(other, _core.BlockFilter):
            raise TypeError(f"cannot combine a BloomFilter with {type(other).__name__}")
        if other.nblocks != self.nblocks or other.seed != self.seed:
            raise ValueError(
                "filters must have the same geometry and seed to be combined: "
                f"{self.nblocks} blocks seed {self.seed} vs "
                f"{other.nblocks} blocks seed {other.seed}"
            )
        return other

    def __ior__(self, other: object) -> BloomFilter:
        compatible = self._check_compatible(other)
        self._union_update(compatible)
        estimate = self._estimated_count()
        # A saturated filter has no finite estimate: count it as full.
        estimated = int(estimate) if math.isfinite(estimate) else 2**63 - 1
        self._set_count(max(self.count, compatible.count, estimated))
        return self

    def __or__(self, other: object) -> BloomFilter:
        result = self.copy()
        result |= other
        return result

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _core.BlockFilter):
            return NotImplemented
        return (
            self.nblocks == other.nblocks
            and self.seed == other.seed
            and memoryview(self) == memoryview(other)
        )

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (BloomFilter.from_bytes, (self.to_bytes(),))

    # -- persistence ---------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The filter in the file format (header and body)."""
        head, body = _serialize(self)
        return head + body

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> BloomFilter:
        """A writable filter from ``to_bytes()`` output; checks every checksum."""
        view = memoryview(data).cast("B")
        header = _parse_header(bytes(view[:HEADER_SIZE]), len(view), "filter bytes")
        body = view[HEADER_SIZE:]
        new = cls.__new__(cls)
        new._allocate(header.nblocks, header.seed, header.capacity, header.error_rate)
        memoryview(new)[:] = body
        new._set_count(header.count)
        if new._checksum() != header.body_checksum:
            raise CorruptFileError("filter bytes: body checksum mismatch")
        return new

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the filter to ``path`` atomically and durably."""
        atomic_write(path, _serialize(self))

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, mmap: bool = True, verify: bool = True
    ) -> BloomFilter:
        """Opens a saved filter.

        With ``mmap=True`` the body is mapped read-only (shared page cache,
        nothing copied; ``add`` raises); with ``mmap=False`` it is read into
        writable memory. ``verify`` checks the body checksum, reading it once.
        A truncated, damaged or foreign file raises :class:`CorruptFileError`;
        one from a newer format, :class:`UnsupportedFormatError`.
        """
        source = os.fspath(path)
        with open(source, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            header = _parse_header(fh.read(HEADER_SIZE), size, source)
            new = cls.__new__(cls)
            if mmap:
                mapped = _mmap.mmap(fh.fileno(), 0, access=_mmap.ACCESS_READ)
                body = memoryview(mapped)[HEADER_SIZE:]
                new._attach(
                    body,
                    header.nblocks,
                    header.seed,
                    header.capacity,
                    header.error_rate,
                    header.count,
                    False,
                )
                # The memoryview slice holds the mapping open for the filter's life.
            else:
                new._allocate(header.nblocks, header.seed, header.capacity, header.error_rate)
                _read_exact(fh, memoryview(new), source)
                new._set_count(header.count)
        if verify and new._checksum() != header.body_checksum:
            raise CorruptFileError(f"{source}: body checksum mismatch")
        return new


def _read_exact(fh: BinaryIO, target: memoryview, source: str) -> None:
    done = 0
    while done < len(target):
        n = fh.readinto(target[done:])  # type: ignore[attr-defined]
        if not n:
            raise CorruptFileError(f"{source}: truncated while reading the body")
        done += n


# ------------------------------------------------------------------ ring ---

GROWTH_TIGHTENING = 0.5  # each grown sub-filter gets half the previous error budget
GROWTH_FACTOR = 2  # and twice the previous capacity
RATE_HEADROOM = 1.25  # a new slice expects the previous slice's keys plus a quarter
KNOWN_RESERVE = 0.1  # the budget share a slice sized from a known count keeps for growth
KNOWN_HEADROOM = 1.05  # and the capacity it adds to that count
MIN_KNOWN_CAPACITY = 1024  # the smallest slice sized from a known count
MIN_GROWN_BUDGET = 1e-12  # a grown sub-filter's budget never reaches zero
RING_MANIFEST = "ring.json"
RING_FORMAT = 2  # 2: slices rebuilt as fuse filters, key logs; 1 is read as it is
FUSE_FPR = 2.0**-16  # a 16-bit fingerprint: the false-positive rate of a fuse slice


@dataclass
class _Slice:
    bucket: int
    filters: list[BloomFilter] = field(default_factory=list)
    sealed: bool = False
    # A sealed slice rebuilt as a static filter (no Bloom filters left then).
    fuse: _core.FuseFilter | None = None
    # The hashes the slice took (persisted rings): the input of that rebuild.
    log: KeyLog | None = None
    pending: list[memoryview] = field(default_factory=list)  # not yet in the log

    def count(self) -> int:
        return self.fuse.count if self.fuse is not None else sum(f.count for f in self.filters)

    def nbytes(self) -> int:
        return self.fuse.nbytes if self.fuse is not None else sum(f.nbytes for f in self.filters)

    def estimated_fpr(self) -> float:
        if self.fuse is not None:
            return FUSE_FPR if self.fuse.count else 0.0
        miss = 1.0
        for f in self.filters:
            miss *= 1.0 - f.estimated_fpr
        return 1.0 - miss


@dataclass(frozen=True)
class SliceInfo:
    """Figures of one time slice of a :class:`BloomRing`."""

    bucket: int
    start: float
    count: int
    capacity: int
    subfilters: int
    nbytes: int
    fill_ratio: float
    estimated_fpr: float
    sealed: bool
    kind: str = "bloom"  # "fuse": rebuilt as a static filter (subfilters 0, fill_ratio 0)


class BloomRing:
    """A time-sliced Bloom filter: keys expire ``window`` seconds after their slice.

    One slice per time bucket of ``slice_seconds``; a key is held by the slice
    of the time it was added. ``contains`` is true if any slice holds the key;
    ``expire(now)`` drops slices whose newest possible key is older than the
    window. Time is always passed in.

    Sizing: at most ``ceil(window / slice_seconds) + 1`` slices are live at
    once, and each gets an equal share of ``error_rate``, so the ring as a
    whole meets it. A slice expecting ``slice_capacity`` keys that receives
    more grows a sub-filter with twice the capacity and half the error budget
    (a scalable Bloom filter), so an overfull slice never silently exceeds its
    rate. Each new slice is sized for the keys the previous one received
    (plus a quarter) when that is more than ``slice_capacity``, so a steady
    stream settles into one filter per slice.

    With ``path``, slices persist as filter files in that directory: a slice
    is saved and reopened memory-mapped when a newer slice replaces it as the
    head; ``save()`` writes the head and the manifest. With ``key_logs=True``
    (the cold archive's rings) each unsealed slice also keeps a key log (the
    hashes it took, owner-only like every file of the ring), and
    :meth:`compact` rebuilds sealed slices from their logs as binary fuse
    filters: about 2.25 bytes per key at 2**-16 instead of the Bloom filter's
    share of the budget (dedupcore.fuse; docs/warm-tier.md, "The cold
    archive").
    """

    def __init__(
        self,
        window: float,
        slice_seconds: float,
        slice_capacity: int,
        error_rate: float = 0.001,
        *,
        seed: int = 0,
        path: str | os.PathLike[str] | None = None,
        key_logs: bool = False,
    ) -> None:
        self.window = _check_positive("window", window)
        self.slice_seconds = _check_positive("slice_seconds", slice_seconds)
        self.slice_capacity = _check_capacity(slice_capacity)
        self.error_rate = _check_error_rate(error_rate)
        self.seed = _check_seed(seed)
        self.max_slices = math.ceil(self.window / self.slice_seconds) + 1
        self.slice_error_rate = 1.0 - (1.0 - self.error_rate) ** (1.0 / self.max_slices)
        self.path = Path(path) if path is not None else None
        # Open slices keep their keys' hashes, so that sealed ones can be rebuilt
        # as fuse filters (compact()): a ring with a path that asks for them.
        self.key_logs = bool(key_logs) and self.path is not None
        self._slices: list[_Slice] = []
        self._vouched: dict[int, int] = {}  # bucket -> hashes its key log must prove (open())
        # Every live filter; None: stale.
        self._every: tuple[BloomFilter | _core.FuseFilter, ...] | None = ()
        self._saved: dict[tuple[int, int], int] = {}  # (bucket, sub-filter) -> count saved
        self._lock = threading.RLock()
        self._compacting = threading.Lock()  # one rebuild at a time, outside _lock
        if self.path is not None:
            mkdir_private(self.path)

    # -- time ----------------------------------------------------------------

    def bucket_of(self, now: float) -> int:
        """The time bucket that ``now`` falls in."""
        return math.floor(now / self.slice_seconds)

    def _live(self, bucket: int, now: float) -> bool:
        return (bucket + 1) * self.slice_seconds + self.window > now

    def expire(self, now: float) -> int:
        """Drops the slices that hold only keys older than the window; returns how many."""
        _check_time(now)
        with self._lock:
            keep = [s for s in self._slices if self._live(s.bucket, now)]
            dropped = [s for s in self._slices if not self._live(s.bucket, now)]
            self._slices = keep
            self._every = None
            if dropped and self.path is not None:
                self._write_manifest()
                for s in dropped:
                    self._unlink_slice(s)
            return len(dropped)

    def _unlink_slice(self, s: _Slice) -> None:
        """Removes every file a slice may have (Bloom filters, fuse file, key log)."""
        for i in range(max(1, len(s.filters))):
            _unlink_quiet(self._file(s.bucket, i))
        _unlink_quiet(self._fuse_file(s.bucket))
        _unlink_quiet(self._log_file(s.bucket))

    def _head_for(self, now: float, expected: int = 0) -> _Slice:
        _check_time(now)
        bucket = self.bucket_of(now)
        if self._slices and bucket <= self._slices[-1].bucket:
            if self._slices[-1].fuse is None:
                # Late keys go to the head, the slice that lives longest.
                return self._slices[-1]
            # The newest slice was rebuilt read-only (a manifest written by
            # hand, or a clock set back): late keys start the next slice, which
            # keeps them a slice longer, never shorter.
            bucket = self._slices[-1].bucket + 1
        base, reserve = self.slice_capacity, GROWTH_TIGHTENING
        if self._slices:
            previous = self._slices[-1]
            self._seal(previous)
            # Size the new slice for the rate the last one saw, so a steady
            # stream fills one filter instead of a chain of grown ones.
            seen = sum(f.count for f in previous.filters)
            base = max(base, math.ceil(seen * RATE_HEADROOM))
        if expected > 0:
            # The caller knows what the slice will hold (a warm-tier drop knows
            # the records still to come in this bucket): one filter of that
            # size gets nine tenths of the budget instead of half.
            base = max(MIN_KNOWN_CAPACITY, math.ceil(expected * KNOWN_HEADROOM))
            reserve = KNOWN_RESERVE
        head = _Slice(bucket)
        head.filters.append(
            BloomFilter(base, self.slice_error_rate * (1 - reserve), seed=self.seed)
        )
        if self.key_logs:
            # A log left by a slice of this bucket that never reached the
            # manifest (a crash) vouches for nothing: start it afresh.
            _unlink_quiet(self._log_file(bucket))
            head.log = KeyLog(self._log_file(bucket))
        self._slices.append(head)
        self._every = None
        self.expire(now)
        return head

    def _target(self, head: _Slice) -> BloomFilter:
        target = head.filters[-1]
        if target.count >= target.capacity:
            # A grown sub-filter has twice the capacity of the one before and
            # half the budget: the first filter's share is taken from its own
            # header, so a reopened ring grows the way it was sized.
            first = head.filters[0]
            index = len(head.filters)
            reserve = max(0.0, self.slice_error_rate - first.error_rate)
            budget = reserve * (1 - GROWTH_TIGHTENING) * GROWTH_TIGHTENING ** (index - 1)
            target = BloomFilter(
                first.capacity * GROWTH_FACTOR**index,
                max(budget, MIN_GROWN_BUDGET),
                seed=self.seed,
            )
            head.filters.append(target)
            self._every = None
        return target

    # -- keys ----------------------------------------------------------------

    def _filters(self) -> tuple[BloomFilter | _core.FuseFilter, ...]:
        """Every live filter, Bloom or fuse, oldest first (kept until the set changes)."""
        every = self._every
        if every is None:
            every = self._every = tuple(
                f for s in self._slices for f in ([s.fuse] if s.fuse is not None else s.filters)
            )
        return every

    def add(self, key: bytes | bytearray | memoryview | str, now: float) -> bool:
        """Adds a key at time ``now``; True if no live slice held it before."""
        h = _core.hash64(key, self.seed)
        with self._lock:
            head = self._head_for(now)
            target = self._target(head)
            seen = any(f.contains_hash(h) for f in self._filters() if f is not target)
            new = target.add_hash(h)
            if head.log is not None:
                head.pending.append(memoryview(struct.pack("<Q", h)).cast("Q"))
            return new and not seen

    def add_many(self, keys: Keys, now: float, *, expected: int = 0) -> memoryview[bool]:
        """Adds a batch at time ``now``; per-key flags, True where the key was new.

        ``expected``: when this batch starts the slice of ``now``, the number
        of keys that slice will receive in all (this batch included). The
        slice is then one filter of that size with nine tenths of its error
        budget, instead of the rate-based guess with half (docs/warm-tier.md,
        "The cold archive"). Ignored once the slice exists.
        """
        return self._add_many(keys, now, report=True, expected=expected)

    def insert_many(self, keys: Keys, now: float, *, expected: int = 0) -> None:
        """Adds a batch at time ``now`` without asking which keys were new.

        Probes only the head's filter, not every live slice: with a slice
        grown into several sub-filters that is most of the cost of an add.
        ``expected`` as for :meth:`add_many`.
        """
        self._add_many(keys, now, report=False, expected=expected)

    def _add_many(
        self, keys: Keys, now: float, *, report: bool, expected: int = 0
    ) -> memoryview[bool]:
        # Hash (and so validate) every key before the ring changes at all; a
        # uint64 buffer is taken as already hashed and comes back as a copy.
        batch = _core.hash64_many(_as_batch(keys), self.seed)
        if isinstance(expected, bool) or not isinstance(expected, int):
            raise TypeError(f"expected must be an int, not {type(expected).__name__}")
        if expected < 0:
            raise ValueError(f"expected must be >= 0, got {expected}")
        with self._lock:
            head = self._head_for(now, expected)
            if head.log is not None and len(batch):
                head.pending.append(batch)  # logged before the filter is saved (save())
            parts: list[memoryview[bool]] = []
            start, n = 0, len(batch)
            while start < n or not parts:
                target = self._target(head)
                room = max(1, target.capacity - target.count)
                chunk = batch[start : start + room]
                # Fuse slices only answer: a key one of them may hold was not new.
                others = tuple(f for f in self._filters() if f is not target) if report else ()
                parts.append(_core.probe_many(others, chunk, target, self.seed))
                start += room
            if len(parts) == 1:
                return parts[0]
            return memoryview(b"".join(p.cast("B") for p in parts)).cast("?")

    def __contains__(self, key: object) -> bool:
        h = _core.hash64(key, self.seed)  # type: ignore[arg-type]  # TypeError names the type
        with self._lock:
            return any(f.contains_hash(h) for f in self._filters())

    def contains(self, key: bytes | bytearray | memoryview | str) -> bool:
        """True if a live slice may hold the key."""
        return key in self

    def contains_many(self, keys: Keys) -> memoryview[bool]:
        """Membership of each key of a batch in any slice; one hash per key."""
        batch = _as_batch(keys)
        with self._lock:
            return _core.probe_many(self._filters(), batch, None, self.seed)

    def contains_digests(self, digests: bytes) -> memoryview[bool]:
        """Membership in any slice of each of concatenated 16-byte record digests,
        keyed by their first 8 bytes (the store's front hash; ``_core.probe_digests``)."""
        with self._lock:
            return _core.probe_digests(self._filters(), digests, self.seed)

    # -- figures -------------------------------------------------------------

    def __len__(self) -> int:
        return sum(f.count for f in self._filters())

    @property
    def slices_live(self) -> int:
        """How many slices are live (0: the ring holds nothing, nothing to probe)."""
        return len(self._slices)

    @property
    def count(self) -> int:
        """Keys held by live slices (new keys added)."""
        return len(self)

    @property
    def nbytes(self) -> int:
        """Memory of all live filters, in bytes."""
        return sum(f.nbytes for f in self._filters())

    @property
    def estimated_fpr(self) -> float:
        """Probability that an absent key tests positive in some live slice, from the bits
        set (a fuse slice: its fingerprint's 2**-16)."""
        miss = 1.0
        for s in self._slices:
            miss *= 1.0 - s.estimated_fpr()
        return 1.0 - miss

    def slices(self) -> list[SliceInfo]:
        """Figures of each live slice, oldest first."""
        with self._lock:
            out = []
            for s in self._slices:
                nbytes = s.nbytes()
                bits = sum(f.fill_ratio * f.nbytes for f in s.filters)
                out.append(
                    SliceInfo(
                        bucket=s.bucket,
                        start=s.bucket * self.slice_seconds,
                        count=s.count(),
                        capacity=sum(f.capacity for f in s.filters) or s.count(),
                        subfilters=len(s.filters),
                        nbytes=nbytes,
                        fill_ratio=bits / nbytes if nbytes and s.filters else 0.0,
                        estimated_fpr=s.estimated_fpr(),
                        sealed=s.sealed,
                        kind="bloom" if s.fuse is None else "fuse",
                    )
                )
            return out

    def __iter__(self) -> Iterator[SliceInfo]:
        return iter(self.slices())

    def __repr__(self) -> str:
        return (
            f"<BloomRing window={self.window} slice_seconds={self.slice_seconds} "
            f"slices={len(self._slices)} count={self.count} nbytes={self.nbytes}>"
        )

    # -- persistence ---------------------------------------------------------

    def _file(self, bucket: int, index: int) -> Path:
        assert self.path is not None
        return self.path / f"slice-{bucket}-{index}.bloom"

    def _fuse_file(self, bucket: int) -> Path:
        assert self.path is not None
        return self.path / f"slice-{bucket}.fuse"

    def _log_file(self, bucket: int) -> Path:
        assert self.path is not None
        return self.path / f"slice-{bucket}.keys"

    @staticmethod
    def _flush_keys(s: _Slice) -> None:
        """Appends the hashes a slice took since the last flush to its key log (fsynced).
        Called before the slice's filter is saved, so the log never lags the filter."""
        if s.log is not None:
            for batch in s.pending:
                s.log.append(batch)
        s.pending.clear()

    def _seal(self, s: _Slice) -> None:
        """Makes a slice read-only; persisted rings save it and map it back."""
        if s.sealed:
            return
        if self.path is not None:
            self._flush_keys(s)
            reopened = []
            for i, f in enumerate(s.filters):
                f.save(self._file(s.bucket, i))
                reopened.append(BloomFilter.open(self._file(s.bucket, i), mmap=True, verify=False))
            s.filters = reopened
            self._every = None
        s.sealed = True
        if self.path is not None:
            self._write_manifest()

    def compact(self) -> int:
        """Rebuilds sealed slices as binary fuse filters from their key logs; returns how
        many it rebuilt.

        Runs outside the ring's lock: probes and adds go on meanwhile, against
        the slice's Bloom filters, which stay its authority until the fuse file
        and the manifest naming it are durable. A log that cannot prove every
        hash the manifest vouches for leaves its slice as it is, with a warning
        (the slice keeps its larger Bloom filters; nothing is lost). The head
        slice and the slices of rings without a path are never rebuilt.
        """
        if self.path is None:
            return 0
        rebuilt = 0
        with self._compacting:
            while True:
                with self._lock:
                    s = next(
                        (
                            s
                            for s in self._slices[:-1]
                            if s.sealed and s.fuse is None and s.log is not None
                        ),
                        None,
                    )
                if s is None or s.log is None:
                    return rebuilt
                keylog = s.log
                try:
                    hashes = keylog.read()
                    fuse = _core.FuseFilter.build(hashes, self.seed)
                    # A guard against a builder that lost a key: every logged hash
                    # must be held before the slice's Bloom filters may go.
                    held = fuse.contains_many(hashes)
                    if len(held) and held.cast("B").tobytes().find(b"\0") >= 0:
                        raise CorruptFileError(f"{keylog.path}: the rebuilt filter misses keys")
                    del hashes, held
                    # The built filter is what a reopened ring would read back:
                    # its body is in memory of its own already (open_fuse).
                    atomic_write(self._fuse_file(s.bucket), fuse_file_chunks(fuse, self.seed))
                except (CorruptFileError, OSError) as exc:
                    log.warning("cold slice %d stays a Bloom filter: %s", s.bucket, exc)
                    with self._lock:
                        s.log = None
                    continue
                with self._lock:
                    if s not in self._slices:  # expired meanwhile
                        _unlink_quiet(self._fuse_file(s.bucket))
                        continue
                    s.fuse, s.filters, s.log = fuse, [], None
                    self._every = None
                    self._write_manifest()
                    self._unlink_slice_rest(s)
                rebuilt += 1

    def save(self) -> None:
        """Writes the unsealed head slice and the manifest to ``path``."""
        if self.path is None:
            raise ValueError("this ring has no path; pass path= to persist it")
        with self._lock:
            for s in self._slices:
                if not s.sealed:
                    self._flush_keys(s)
                    for i, f in enumerate(s.filters):
                        # A sub-filter that took no key since it was saved is on disk
                        # as it is (a full one never changes again).
                        count = f.count
                        if self._saved.get((s.bucket, i)) == count:
                            continue
                        f.save(self._file(s.bucket, i))
                        self._saved[(s.bucket, i)] = count
            self._write_manifest()

    def _write_manifest(self) -> None:
        """Writes the manifest, after every file it names (unsealed heads are saved first)."""
        for s in self._slices:
            if not s.sealed:
                self._flush_keys(s)
                for i, f in enumerate(s.filters):
                    if not self._file(s.bucket, i).exists():
                        f.save(self._file(s.bucket, i))
        manifest = {
            "format": RING_FORMAT,
            "window": self.window,
            "slice_seconds": self.slice_seconds,
            "slice_capacity": self.slice_capacity,
            "error_rate": self.error_rate,
            "seed": self.seed,
            "key_logs": self.key_logs,
            "slices": [self._manifest_entry(s) for s in self._slices],
        }
        data = json.dumps(manifest, indent=1).encode()
        assert self.path is not None
        atomic_write(self.path / RING_MANIFEST, [data])

    @staticmethod
    def _manifest_entry(s: _Slice) -> dict[str, Any]:
        if s.fuse is not None:
            return {"bucket": s.bucket, "kind": "fuse", "sealed": True}
        entry: dict[str, Any] = {
            "bucket": s.bucket,
            "subfilters": len(s.filters),
            "sealed": s.sealed,
        }
        if s.log is not None:
            entry["keys"] = s.log.hashes  # what the log must prove to be rebuilt from
        return entry

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        readonly: bool = False,
        key_logs: bool | None = None,
    ) -> BloomRing:
        """Reopens a saved ring: sealed slices memory-mapped, the head writable.

        A missing or damaged manifest or slice file raises
        :class:`CorruptFileError`; the caller decides whether to rebuild.
        ``readonly``: a view of a ring another process may be writing; nothing
        on disk is touched (no torn key-log tail cut, no leftover removed).
        ``key_logs``: whether slices started from now on keep a key log (None:
        as the manifest says; slices that have one keep it either way).
        """
        root = Path(path)
        manifest_path = root / RING_MANIFEST
        try:
            raw = manifest_path.read_bytes()
        except FileNotFoundError:
            raise CorruptFileError(f"{manifest_path}: ring manifest is missing") from None
        try:
            manifest = json.loads(raw)
            if not isinstance(manifest, dict):
                raise TypeError("manifest is not an object")
            fmt = manifest["format"]
            if isinstance(fmt, int) and fmt > RING_FORMAT:
                raise UnsupportedFormatError(
                    f"{manifest_path}: ring format {fmt} is newer than this dedupcore reads"
                )
            ring = cls(
                manifest["window"],
                manifest["slice_seconds"],
                manifest["slice_capacity"],
                manifest["error_rate"],
                seed=manifest["seed"],
                path=root,
                key_logs=manifest.get("key_logs", False) if key_logs is None else key_logs,
            )
            if fmt not in (1, RING_FORMAT) or isinstance(fmt, bool):
                raise ValueError(f"format {fmt!r} is not 1 or {RING_FORMAT}")
            if not isinstance(manifest["slices"], list):
                raise TypeError("slices is not a list")
            entries = [_manifest_slice(e) for e in manifest["slices"]]
            buckets = [e.bucket for e in entries]
            if buckets != sorted(set(buckets)):
                raise ValueError("slices are not in increasing bucket order")
        except UnsupportedFormatError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptFileError(f"{manifest_path}: damaged ring manifest: {exc}") from exc
        ring._vouched = {e.bucket: e.keys for e in entries if e.keys is not None}
        if not readonly:
            for stale in root.glob(".*.tmp"):  # a write a crash cut short (atomic_write)
                _unlink_quiet(stale)
        for n, entry in enumerate(entries):
            bucket, count, sealed = entry.bucket, entry.subfilters, entry.sealed
            if entry.fuse:
                ring._slices.append(ring._open_fuse_slice(bucket, verify, readonly))
                continue
            if n == len(entries) - 1:
                # The newest slice is the head again: writable, so late keys have a home.
                sealed = False
            s = _Slice(bucket, sealed=sealed)
            if entry.keys is not None:
                if sealed:
                    # Read (and proved) when the slice is rebuilt (compact()).
                    if ring._log_file(bucket).exists():
                        s.log = KeyLog(ring._log_file(bucket), entry.keys)
                elif not readonly:
                    s.log = KeyLog.resume(ring._log_file(bucket), entry.keys)
                if s.log is None and not readonly:
                    log.warning(
                        "%s: the key log cannot prove the %d hashes the manifest vouches "
                        "for; the slice stays a Bloom filter",
                        ring._log_file(bucket),
                        entry.keys,
                    )
            for i in range(count):
                try:
                    f = BloomFilter.open(ring._file(bucket, i), mmap=sealed, verify=verify)
                except FileNotFoundError:
                    raise CorruptFileError(
                        f"{ring._file(bucket, i)}: slice file named by the manifest is missing"
                    ) from None
                if f.seed != ring.seed:
                    raise CorruptFileError(f"{ring._file(bucket, i)}: seed differs from the ring")
                s.filters.append(f)
            ring._slices.append(s)
        ring._every = None
        return ring

    def vouched_key_logs(self) -> list[KeyLog]:
        """The key logs of a reopened ring, each with the hashes its manifest vouches for
        (read-side verification: :meth:`KeyLog.check` each)."""
        if self.path is None:
            return []
        return [KeyLog(self._log_file(b), n) for b, n in sorted(self._vouched.items())]

    def _open_fuse_slice(self, bucket: int, verify: bool, readonly: bool) -> _Slice:
        """A rebuilt slice of a reopened ring; files a crash left beside it are removed."""
        path = self._fuse_file(bucket)
        try:
            fuse, seed = open_fuse(path, verify=verify)
        except FileNotFoundError:
            raise CorruptFileError(f"{path}: slice file named by the manifest is missing") from None
        if seed != self.seed:
            raise CorruptFileError(f"{path}: seed differs from the ring")
        s = _Slice(bucket, sealed=True, fuse=fuse)
        if not readonly:
            self._unlink_slice_rest(s)
        return s

    def _unlink_slice_rest(self, s: _Slice) -> None:
        """The Bloom filters and key log of a rebuilt slice: a crash may leave them after
        the manifest named the fuse file."""
        assert self.path is not None
        for stale in self.path.glob(f"slice-{s.bucket}-*.bloom"):
            _unlink_quiet(stale)
        _unlink_quiet(self._log_file(s.bucket))


@dataclass(frozen=True)
class _Entry:
    bucket: int
    subfilters: int
    sealed: bool
    fuse: bool
    keys: int | None  # hashes the slice's key log must prove (None: no log)


def _manifest_slice(entry: object) -> _Entry:
    """A manifest slice entry, strictly typed."""
    if not isinstance(entry, dict):
        raise TypeError("slice entry is not an object")
    bucket, sealed = entry["bucket"], entry["sealed"]
    if isinstance(bucket, bool) or not isinstance(bucket, int):
        raise TypeError(f"slice bucket must be an int, got {bucket!r}")
    if not isinstance(sealed, bool):
        raise TypeError(f"slice sealed must be a bool, got {sealed!r}")
    kind = entry.get("kind", "bloom")
    if kind == "fuse":
        if not sealed:
            raise ValueError(f"fuse slice {bucket} is not sealed")
        return _Entry(bucket, 0, True, True, None)
    if kind != "bloom":
        raise ValueError(f"slice kind must be bloom or fuse, got {kind!r}")
    count = entry["subfilters"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"slice subfilters must be an int >= 1, got {count!r}")
    keys = entry.get("keys")
    if keys is not None and (isinstance(keys, bool) or not isinstance(keys, int) or keys < 0):
        raise ValueError(f"slice keys must be an int >= 0, got {keys!r}")
    return _Entry(bucket, count, sealed, False, keys)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _check_time(now: object) -> None:
    if isinstance(now, bool) or not isinstance(now, (int, float)):
        raise TypeError(f"now must be a number of seconds, not {type(now).__name__}")
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")


def _as_batch(keys: Keys) -> Any:
    """A sliceable batch: list/tuple of keys, or a uint64 memoryview."""
    if isinstance(keys, (list, tuple)):
        return keys
    if isinstance(keys, (bytes, str, bytearray)):
        raise TypeError(
            f"expected a sequence of keys or a uint64 buffer, not a single "
            f"{type(keys).__name__} (wrap one key in a list)"
        )
    try:
        return memoryview(keys)  # type: ignore[arg-type]
    except TypeError:
        return list(keys)


def _unlink_quiet(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
