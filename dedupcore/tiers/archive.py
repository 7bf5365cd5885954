"""The cold archive: sealed, checksummed filter slices per cold window.

Keys demoted from an exact tier go into the ring of their namespace's
``cold_window``; a key found only here is answered DUPLICATE with
``exact=False``, with the ring's measured false-positive rate as its error.
The archive cannot be rebuilt from anything else, so a damaged or
half-present ring is an error, never an empty archive.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dedupcore.errors import CorruptFileError
from dedupcore.keys import u64
from dedupcore.ring import BloomRing

__all__ = ["ColdArchive"]


class ColdArchive:
    """One :class:`BloomRing` per cold window under ``path`` (or in memory without one).

    ``add`` writes, fsyncs and renames the touched ring's files into place
    before it returns, so a caller can delete the exact records afterwards
    (copy, then delete). A slice is a Bloom filter while it takes keys and is
    rebuilt as a binary fuse filter once sealed (:meth:`compact`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        windows: Iterable[float],
        *,
        slice_capacity: int = 1_000_000,
        error_rate: float = 0.001,
        readonly: bool = False,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.readonly = readonly
        self.rings: dict[float, BloomRing] = {}
        for window in sorted({float(w) for w in windows if w > 0}):
            ring_path = None if self.path is None else self.path / f"{window:g}"
            if ring_path is not None and (ring_path / "ring.json").exists():
                # Damage is an error.
                self.rings[window] = BloomRing.open(ring_path, readonly=readonly, key_logs=True)
            elif ring_path is not None and any(ring_path.glob("slice-*.bloom")):
                # Slices without their manifest cannot be read, and an empty
                # archive would answer NEW for keys it holds.
                raise CorruptFileError(
                    f"{ring_path}: cold archive slices are present but ring.json is missing; "
                    "restore it from a backup (the archive cannot be rebuilt)"
                )
            else:
                self.rings[window] = BloomRing(
                    window,
                    window / 8,
                    slice_capacity,
                    error_rate,
                    path=None if readonly else ring_path,
                    key_logs=True,  # sealed slices are rebuilt as fuse filters
                )

    @property
    def empty(self) -> bool:
        """True while no ring has a slice: nothing to probe (a young store's archive)."""
        for ring in self.rings.values():  # noqa: SIM110 (every claim asks: no generator)
            if ring.slices_live:
                return False
        return True

    def contains_many(self, window: float, hashes: memoryview) -> memoryview[bool]:
        """Whether the ring of ``window`` holds each front hash (a uint64 buffer)."""
        ring = self.rings.get(window)
        if ring is None or not len(hashes) or not ring.slices_live:
            return memoryview(bytearray(len(hashes))).cast("?")
        return ring.contains_many(hashes)

    def contains_digests(self, window: float, digests: bytes) -> memoryview[bool]:
        """Whether the ring of ``window`` holds each of concatenated record digests
        (keyed by their front hash, as :meth:`contains_many`)."""
        ring = self.rings.get(window)
        if ring is None or not ring.slices_live:
            return memoryview(bytearray(len(digests) // 16)).cast("?")
        return ring.contains_digests(digests)

    def slice_end(self, window: float, now: float) -> float | None:
        """When the ring slice that keys added at ``now`` go into ends (None: no such ring).

        A caller sizing that slice counts the keys it will add before then.
        """
        ring = self.rings.get(window)
        if ring is None:
            return None
        return (ring.bucket_of(now) + 1) * ring.slice_seconds

    def add_many(
        self,
        window: float,
        hashes: Sequence[int] | memoryview,
        now: float,
        *,
        expected: int = 0,
    ) -> int:
        """Adds front hashes to the ring of ``window`` and saves it; returns how many.

        ``expected`` sizes the ring's slice for ``now`` when this call starts
        it: the keys it will receive in all (:meth:`BloomRing.add_many`).
        Nothing asks which keys were new, so only that slice's filter is
        touched.
        """
        ring = self.rings.get(window)
        if ring is None or not len(hashes):
            return 0
        if not isinstance(hashes, memoryview):
            hashes = u64(hashes)
        ring.insert_many(hashes, now, expected=expected)
        if ring.path is not None:
            ring.save()
        return len(hashes)

    def compact(self) -> int:
        """Rebuilds the rings' sealed slices as fuse filters (:meth:`BloomRing.compact`);
        returns how many. It can take seconds for a large slice: call it outside
        any lock that claims wait for."""
        if self.readonly:
            return 0
        return sum(ring.compact() for ring in self.rings.values())

    def expire(self, now: float) -> None:
        """Drops slices older than their window."""
        for ring in self.rings.values():
            ring.expire(now)

    def stats(self) -> dict[str, Any]:
        """Per window: memory, estimated false-positive rate, the live slices and the
        stacks of the fuse ones."""
        return {
            f"{window:g}": {
                "nbytes": ring.nbytes,
                "estimated_fpr": ring.estimated_fpr,
                "slices": [
                    {name: getattr(s, name) for name in s.__dataclass_fields__}
                    for s in ring.slices()
                ],
                "stacks": ring.stacks(),
            }
            for window, ring in self.rings.items()
        }
