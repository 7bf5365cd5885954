"""The manifest of a persisted :class:`~dedupcore.ring.BloomRing` (``ring.json``).

It names the ring's settings and, oldest first, every live slice: a Bloom
slice's sub-filter files, whether it is sealed and how many hashes its key log
must prove, or a fuse slice's file. It is read strictly (a damaged or foreign
manifest is refused, never guessed at) and written whole, after every file it
names (docs/architecture.md, "The layers"; docs/warm-tier.md, "The cold archive").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dedupcore.errors import CorruptFileError, UnsupportedFormatError

__all__ = [
    "RING_FORMAT",
    "RING_MANIFEST",
    "Entry",
    "bloom_entry",
    "damaged",
    "encode",
    "entries",
    "fuse_entry",
    "load",
]

RING_MANIFEST = "ring.json"
RING_FORMAT = 2  # 2: slices rebuilt as fuse filters, key logs; 1 is read as it is


@dataclass(frozen=True)
class Entry:
    """One slice as the manifest names it."""

    bucket: int
    subfilters: int
    sealed: bool
    fuse: bool
    keys: int | None  # hashes the slice's key log must prove (None: no log)


def encode(settings: dict[str, Any], slices: list[dict[str, Any]]) -> bytes:
    """The manifest's bytes: the ring's settings and its slices' entries."""
    return json.dumps({"format": RING_FORMAT, **settings, "slices": slices}, indent=1).encode()


def bloom_entry(bucket: int, subfilters: int, sealed: bool, keys: int | None) -> dict[str, Any]:
    """The entry of a Bloom slice (``keys``: what its key log must prove, None: no log)."""
    entry: dict[str, Any] = {"bucket": bucket, "subfilters": subfilters, "sealed": sealed}
    if keys is not None:
        entry["keys"] = keys
    return entry


def fuse_entry(bucket: int) -> dict[str, Any]:
    """The entry of a slice rebuilt as a fuse filter."""
    return {"bucket": bucket, "kind": "fuse", "sealed": True}


def damaged(path: Path, exc: Exception) -> CorruptFileError:
    """The error that refuses a manifest whose content does not check out."""
    return CorruptFileError(f"{path}: damaged ring manifest: {exc}")


def load(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` as an object whose format this version reads at most;
    :class:`CorruptFileError` when it is missing or not such an object,
    :class:`UnsupportedFormatError` when a newer version wrote it."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: ring manifest is missing") from None
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict):
            raise TypeError("manifest is not an object")
        fmt = manifest["format"]
    except (ValueError, TypeError, KeyError) as exc:
        raise damaged(path, exc) from exc
    if isinstance(fmt, int) and fmt > RING_FORMAT:
        raise UnsupportedFormatError(
            f"{path}: ring format {fmt} is newer than this dedupcore reads"
        )
    return manifest


def entries(manifest: dict[str, Any]) -> list[Entry]:
    """The slices a loaded manifest names, checked: its format one this version
    writes or reads, every entry strictly typed, buckets in increasing order.
    Raises ValueError, TypeError or KeyError (the caller says :func:`damaged`)."""
    fmt = manifest["format"]
    if fmt not in (1, RING_FORMAT) or isinstance(fmt, bool):
        raise ValueError(f"format {fmt!r} is not 1 or {RING_FORMAT}")
    if not isinstance(manifest["slices"], list):
        raise TypeError("slices is not a list")
    found = [_entry(e) for e in manifest["slices"]]
    buckets = [e.bucket for e in found]
    if buckets != sorted(set(buckets)):
        raise ValueError("slices are not in increasing bucket order")
    return found


def _entry(entry: object) -> Entry:
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
        return Entry(bucket, 0, True, True, None)
    if kind != "bloom":
        raise ValueError(f"slice kind must be bloom or fuse, got {kind!r}")
    count = entry["subfilters"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"slice subfilters must be an int >= 1, got {count!r}")
    keys = entry.get("keys")
    if keys is not None and (isinstance(keys, bool) or not isinstance(keys, int) or keys < 0):
        raise ValueError(f"slice keys must be an int >= 0, got {keys!r}")
    return Entry(bucket, count, sealed, False, keys)
