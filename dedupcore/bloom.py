"""Split-block Bloom filters: sizing, the set-like filter and its file format.

:class:`BloomFilter` is a set-like filter whose hot paths (single keys and
batches) are the native core's. This module adds what the core leaves out:
sizing from a capacity and a target false-positive rate, and the file
format. :class:`~dedupcore.ring.BloomRing`, a ring of filters, one per time
bucket, for keys that expire, is in dedupcore/ring.py.

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

import functools
import math
import mmap as _mmap
import os
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import dedupcore._core as _core
from dedupcore._checks import checked_int
from dedupcore._files import FileHeader, atomic_write
from dedupcore.errors import CorruptFileError, UnsupportedFormatError

if TYPE_CHECKING:  # the deprecated aliases below, typed
    from dedupcore.ring import RING_FORMAT as RING_FORMAT
    from dedupcore.ring import RING_MANIFEST as RING_MANIFEST
    from dedupcore.ring import BloomRing as BloomRing
    from dedupcore.ring import SliceInfo as SliceInfo

__all__ = [
    "BloomFilter",
    "blocks_for",
    "split_block_fpr",
]

#: The file header (above), written and checked by dedupcore/_files.py.
_FORMAT = FileHeader(struct.Struct("<8sHHIQQQdQQ56xQ"), b"DEDUPBLM", 1, "a dedupcore Bloom filter")
HEADER_SIZE = _FORMAT.size  # 128: a mapped body starts cache-line aligned
MAX_SEED = (1 << 64) - 1


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
    check_capacity(capacity)
    check_error_rate(error_rate)
    nblocks = max(1, math.ceil(capacity / _load_for(error_rate)))
    if nblocks > _core.MAX_BLOCKS:
        raise ValueError(
            f"capacity {capacity} at error_rate {error_rate} needs {nblocks} blocks; "
            f"the layout allows at most {_core.MAX_BLOCKS} (256 GiB)"
        )
    return nblocks


def check_capacity(capacity: object) -> int:
    """A filter's capacity: an int > 0 (TypeError, ValueError otherwise)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    return capacity


def check_error_rate(error_rate: object) -> float:
    """A false-positive rate in (0, 1), as a float (TypeError, ValueError otherwise)."""
    if isinstance(error_rate, bool) or not isinstance(error_rate, (int, float)):
        raise TypeError(f"error_rate must be a float, not {type(error_rate).__name__}")
    rate = float(error_rate)
    if not 0.0 < rate < 1.0:
        raise ValueError(f"error_rate must be in (0, 1), got {error_rate!r}")
    return rate


def check_seed(seed: object) -> int:
    """A hash seed in 0..2**64-1 (TypeError, ValueError otherwise)."""
    return checked_int("seed", seed, 0, MAX_SEED, "0..2**64-1")


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
        capacity = check_capacity(capacity)
        error_rate = check_error_rate(error_rate)
        seed = check_seed(seed)
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


#: Names that moved to dedupcore.ring: deprecated aliases here (docs/compatibility.md).
_MOVED_TO_RING = ("BloomRing", "SliceInfo", "RING_FORMAT", "RING_MANIFEST")


def __getattr__(name: str) -> Any:
    """Deprecated aliases of names that moved out of this module: each warns, then answers."""
    if name in _MOVED_TO_RING:
        warnings.warn(
            f"dedupcore.bloom.{name} moved to dedupcore.ring.{name} (BloomRing is also "
            "dedupcore.BloomRing); the old name will be removed in 0.3.0",
            DeprecationWarning,
            stacklevel=2,
        )
        import dedupcore.ring as _ring

        return getattr(_ring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
