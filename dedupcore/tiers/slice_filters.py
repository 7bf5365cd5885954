"""The Bloom filters of the warm tier's slices, and their files.

Every slice of :class:`~dedupcore.tiers.lmdb.LmdbTier` has a Bloom filter of
its digests, keyed by each digest's second 8 bytes (independent of the
front filter's hash, which is the first 8): a lookup reads only the slices
whose filter says "maybe" (docs/warm-tier.md, "Lookups").

- A sealed slice's filter is a file ``<id>.bloom`` under the filters'
  directory, sized to what the slice holds, written, fsynced and renamed
  into place before the slice is marked sealed, and mapped read-only.
- The open slice's filter lives in memory and takes every checkpoint's
  digests before LMDB does (a filter that holds a key LMDB lacks costs a
  read; the reverse would hide a record). A clean close saves it as
  ``<id>.open-<covers>.bloom``, named after what it covers (the checkpoint
  position and the slice's record count); an open uses it only if the slice
  is still exactly that, and takes every such file away.
- Any filter that is missing, damaged or stale is built again from the
  slice's keys, so a filter file is never the only copy of anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from dedupcore._files import DIR_MODE
from dedupcore.bloom import BloomFilter
from dedupcore.errors import CorruptFileError

__all__ = ["SliceFilters", "second_halves"]

MIN_SEALED_CAPACITY = 1000  # a sealed slice's filter holds at least this many keys


def second_halves(joined: bytes) -> memoryview:
    """Slice-filter hashes of concatenated 16-byte digests: each digest's second 8 bytes."""
    if not joined:
        return memoryview(b"").cast("Q")
    return memoryview(joined).cast("Q")[1::2]


class SliceFilters:
    """The slices' filter files under ``directory``, at ``error_rate`` each.

    A slice is named by its id; the tier supplies what only LMDB knows: a
    slice's digests (batches of concatenated 16-byte digests) and, for the
    open slice, the string that says what it covers.
    """

    def __init__(
        self, directory: str | os.PathLike[str], error_rate: float, *, readonly: bool
    ) -> None:
        self.directory = Path(directory)
        self.error_rate = error_rate
        self.readonly = readonly

    def path(self, slice_id: int) -> Path:
        """Where a sealed slice's filter file lives."""
        return self.directory / f"{slice_id:08d}.bloom"

    def _open_path(self, slice_id: int, covers: str) -> Path:
        return self.directory / f"{slice_id:08d}.open-{covers}.bloom"

    def new(self, capacity: int) -> BloomFilter:
        """An empty filter for a slice that starts now."""
        return BloomFilter(capacity, self.error_rate)

    def build(self, digests: Iterable[bytes], capacity: int) -> BloomFilter:
        """A filter of every digest of ``digests`` (batches of concatenated digests)."""
        bf = self.new(capacity)
        for batch in digests:
            bf.add_many(second_halves(batch))
        return bf

    def _build_sealed(self, records: int, digests: Iterable[bytes]) -> BloomFilter:
        """A sealed slice's filter, sized to the ``records`` it holds."""
        return self.build(digests, max(records, MIN_SEALED_CAPACITY))

    def _save(self, bf: BloomFilter, path: Path) -> None:
        """Writes ``bf`` to ``path`` atomically and durably, creating the directory."""
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        bf.save(path)

    def load_sealed(self, slice_id: int, records: int, digests: Iterable[bytes]) -> BloomFilter:
        """A sealed slice's saved filter, or the one built from its digests when the file
        is missing or damaged (saved again when writable)."""
        try:
            return BloomFilter.open(self.path(slice_id), mmap=True)
        except (OSError, CorruptFileError):
            pass
        built = self._build_sealed(records, digests)
        if not self.readonly:
            self._save(built, self.path(slice_id))
        return built

    def load_open(
        self, slice_id: int, covers: str, digests: Iterable[bytes], capacity: int
    ) -> BloomFilter:
        """The open slice's filter saved at the last clean close if it covers the slice
        as it is now (``covers``), else the one built from its digests. Every saved file
        goes: a filter taken into memory is saved again at the next clean close."""
        want = self._open_path(slice_id, covers)
        found = None
        for path in sorted(self.directory.glob("*.open-*.bloom")):
            if path == want:
                try:
                    found = BloomFilter.open(path, mmap=False)
                except (OSError, CorruptFileError):
                    found = None
            if not self.readonly:
                path.unlink(missing_ok=True)
        return found if found is not None else self.build(digests, capacity)

    def save_open(self, slice_id: int, covers: str, bf: BloomFilter) -> None:
        """Saves the open slice's filter, named after what it covers (at a clean close:
        the next open need not read the slice's keys)."""
        self._save(bf, self._open_path(slice_id, covers))

    def seal(self, slice_id: int, records: int, digests: Iterable[bytes]) -> BloomFilter:
        """Builds a sealing slice's filter sized to its ``records``, writes, fsyncs and
        renames its file into place; returns the file mapped read-only. The caller marks
        the slice sealed only after this returns."""
        self._save(self._build_sealed(records, digests), self.path(slice_id))
        return BloomFilter.open(self.path(slice_id), mmap=True, verify=False)

    def remove(self, slice_id: int) -> None:
        """Deletes a dropped slice's filter file."""
        self.path(slice_id).unlink(missing_ok=True)
