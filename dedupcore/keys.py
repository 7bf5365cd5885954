"""Validation of dedup keys and namespaces, and the digests records are stored under.

A dedup key is ``(namespace, key)``. Namespaces are 1..128 bytes of
``[A-Za-z0-9._:/-]``; keys are 1..``max_key_bytes`` bytes (str as UTF-8).
Records are stored under a 16-byte digest of ``namespace \\0 key``: two
XXH64 hashes with different seeds, little-endian. The first one (``h0``) is also the hash
the Bloom filters use, so a digest is enough to put a key into a filter.
"""

from __future__ import annotations

import array
import re
import struct
from collections.abc import Sequence

from dedupcore._core import hash64, hash64_many

__all__ = [
    "DIGEST_SEED_HI",
    "MAX_NAMESPACE_BYTES",
    "check_key",
    "check_namespace",
    "digest",
    "digests",
    "front_hash",
    "front_hashes",
    "front_hashes_of",
    "key_hashes",
    "u64",
]

MAX_NAMESPACE_BYTES = 128
DIGEST_SEED_HI = 0x9E3779B97F4A7C15
_NAMESPACE_RE = re.compile(rb"[A-Za-z0-9._:/\-]{1,128}\Z")
_DIGEST = struct.Struct("<QQ")


#: Namespaces checked already (a handful per process; bounded all the same).
_CHECKED_NAMESPACES: dict[str, bytes] = {}
_CHECKED_NAMESPACES_MAX = 1024


def check_namespace(namespace: object) -> bytes:
    """The namespace as bytes; ValueError/TypeError naming what is wrong."""
    if type(namespace) is str:  # every call checks one: remembered
        known = _CHECKED_NAMESPACES.get(namespace)
        if known is not None:
            return known
    if isinstance(namespace, str):
        try:
            raw = namespace.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError(
                f"namespace must be ASCII [A-Za-z0-9._:/-], got {namespace!r}"
            ) from None
    else:
        raise TypeError(f"namespace must be str, not {type(namespace).__name__}")
    if not _NAMESPACE_RE.match(raw):
        if not raw:
            raise ValueError("namespace must not be empty")
        if len(raw) > MAX_NAMESPACE_BYTES:
            raise ValueError(f"namespace is {len(raw)} bytes; the limit is {MAX_NAMESPACE_BYTES}")
        raise ValueError(f"namespace may only hold [A-Za-z0-9._:/-], got {namespace!r}")
    if type(namespace) is str and len(_CHECKED_NAMESPACES) < _CHECKED_NAMESPACES_MAX:
        _CHECKED_NAMESPACES[namespace] = raw
    return raw


def check_key(key: object, max_key_bytes: int) -> bytes:
    """The key as bytes (str as UTF-8); ValueError/TypeError naming what is wrong."""
    if isinstance(key, bytes):
        raw = key
    elif isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"key is not valid UTF-8: {exc}") from None
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise TypeError(f"key must be bytes or str, not {type(key).__name__}")
    if not raw:
        raise ValueError("key must not be empty")
    if len(raw) > max_key_bytes:
        raise ValueError(f"key is {len(raw)} bytes; the limit is max_key_bytes={max_key_bytes}")
    return raw


def _joined(namespace: bytes, key: bytes) -> bytes:
    return namespace + b"\x00" + key


def digest(namespace: bytes, key: bytes) -> bytes:
    """16-byte record digest of a checked namespace and key."""
    joined = _joined(namespace, key)
    return _DIGEST.pack(hash64(joined, 0), hash64(joined, DIGEST_SEED_HI))


def digests(namespace: bytes, keys: list[bytes]) -> list[bytes]:
    """Digests of many checked keys of one namespace."""
    prefix = namespace + b"\x00"
    joined = [prefix + k for k in keys]
    lo = hash64_many(joined, 0)
    hi = hash64_many(joined, DIGEST_SEED_HI)
    pack = _DIGEST.pack
    return [pack(a, b) for a, b in zip(lo, hi, strict=True)]


def key_hashes(namespace: bytes, keys: Sequence[bytes]) -> memoryview:
    """The Bloom-filter hashes of checked keys, without their full record digests.

    The same values as ``front_hashes(digests(namespace, keys))``: the first
    half of each digest, computed alone where no record is looked up.
    """
    prefix = namespace + b"\x00"
    return hash64_many([prefix + k for k in keys], 0)


def front_hash(d: bytes) -> int:
    """The Bloom-filter hash of a digest (its first 8 bytes, little-endian)."""
    return int.from_bytes(d[:8], "little")


def front_hashes(ds: Sequence[bytes]) -> memoryview:
    """The Bloom-filter hashes of many digests, as a uint64 buffer (no per-key Python work)."""
    return front_hashes_of(b"".join(ds))


def front_hashes_of(joined: bytes) -> memoryview:
    """The Bloom-filter hashes of concatenated 16-byte digests, as a uint64 buffer."""
    if not joined:
        return memoryview(b"").cast("Q")
    return memoryview(joined).cast("Q")[::2]


def u64(values: Sequence[int]) -> memoryview:
    """Hashes as a uint64 buffer, the form the filters take without per-key conversion."""
    return memoryview(array.array("Q", values))
