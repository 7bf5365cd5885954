"""Pure-Python reference model of dedupcore's split-block filter layout (format version 1).

Written from the specification in ext/dc_hash.h, independently of the native code:

- a key is hashed with XXH64 (the ``xxhash`` package) and ``seed``; str keys as UTF-8;
- the block of a 64-bit hash ``h`` is ``((h >> 32) * nblocks) >> 32``;
- lane ``i`` of that block gets bit ``((h & 0xffffffff) * SALT[i] mod 2**32) >> 26``;
- a block is 8 little-endian uint64 lanes (64 bytes); the body is the blocks in order.

Also the file header of dedupcore/bloom.py's docstring, so tests can build headers
(with correct checksums) that the code under test did not write.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import xxhash

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1

# The odd constants of the Parquet split-block Bloom filter spec.
SALT = (
    0x47B6137B,
    0x44974D91,
    0x8824AD5B,
    0xA2B7289D,
    0x705495C7,
    0x2DF1424B,
    0x9EFC4947,
    0x5C6BFB31,
)
LANES = 8
BLOCK_BYTES = 64

# File header, version 1 (see dedupcore/bloom.py), 128 bytes, little-endian.
HEADER_FMT = "<8sHHIQQQdQQ56xQ"
HEADER_SIZE = 128
MAGIC = b"DEDUPBLM"


def key_bytes(key: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    return bytes(key)


def xxh64(key: bytes | bytearray | memoryview | str, seed: int = 0) -> int:
    return xxhash.xxh64_intdigest(key_bytes(key), seed)


def block_index(h: int, nblocks: int) -> int:
    return ((h >> 32) * nblocks) >> 32


def lane_bits(h: int) -> list[int]:
    lo = h & MASK32
    return [((lo * salt) & MASK32) >> 26 for salt in SALT]


def jump(key: int, num_buckets: int) -> int:
    """Jump consistent hash, Lamping & Veach 2014, transcribed from the paper."""
    b, j = -1, 0
    key &= MASK64
    while j < num_buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


class RefFilter:
    """The bits a filter of ``nblocks`` blocks must hold after the same adds."""

    def __init__(self, nblocks: int, seed: int = 0) -> None:
        self.nblocks = nblocks
        self.seed = seed
        self.lanes = [0] * (nblocks * LANES)
        self.count = 0

    def add_hash(self, h: int) -> bool:
        base = block_index(h, self.nblocks) * LANES
        new = False
        for i, bit in enumerate(lane_bits(h)):
            mask = 1 << bit
            if not self.lanes[base + i] & mask:
                new = True
            self.lanes[base + i] |= mask
        self.count += new
        return new

    def contains_hash(self, h: int) -> bool:
        base = block_index(h, self.nblocks) * LANES
        return all(self.lanes[base + i] >> bit & 1 for i, bit in enumerate(lane_bits(h)))

    def add(self, key: bytes | bytearray | memoryview | str) -> bool:
        return self.add_hash(xxh64(key, self.seed))

    def contains(self, key: bytes | bytearray | memoryview | str) -> bool:
        return self.contains_hash(xxh64(key, self.seed))

    def add_many(self, keys: Iterable[bytes | bytearray | memoryview | str]) -> list[bool]:
        return [self.add(k) for k in keys]

    def body(self) -> bytes:
        return struct.pack(f"<{len(self.lanes)}Q", *self.lanes)


def pack_header(
    *,
    version: int = 1,
    algorithm: int = 1,
    block_bytes: int = BLOCK_BYTES,
    seed: int,
    nblocks: int,
    capacity: int,
    error_rate: float,
    count: int,
    body: bytes,
    magic: bytes = MAGIC,
) -> bytes:
    """A version-1 style header with correct body and header checksums."""
    head = struct.pack(
        HEADER_FMT,
        magic,
        version,
        algorithm,
        block_bytes,
        seed,
        nblocks,
        capacity,
        error_rate,
        count,
        xxhash.xxh64_intdigest(body, 0),
        0,
    )[: HEADER_SIZE - 8]
    return head + struct.pack("<Q", xxhash.xxh64_intdigest(head, 0))


def unpack_header(data: bytes) -> dict[str, object]:
    fields = struct.unpack_from(HEADER_FMT, data)
    names = (
        "magic",
        "version",
        "algorithm",
        "block_bytes",
        "seed",
        "nblocks",
        "capacity",
        "error_rate",
        "count",
        "body_checksum",
        "header_checksum",
    )
    return dict(zip(names, fields, strict=True))
