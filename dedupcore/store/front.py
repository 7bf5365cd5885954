"""The embedded store's front filter: its open, rebuild and what a saved copy covers.

The front filter is a time-sliced Bloom ring over every key the store holds:
a lookup it answers "definitely new" skips LMDB (docs/warm-tier.md, "The front
filter"). A saved front records the log position and warm-tier slice it
covers (:data:`FRONT_COVERS`), so an open after a crash adds the keys of the
slices since, and rebuilds it from LMDB only when it cannot be trusted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import dedupcore._engine as _engine
import dedupcore.keys as _keys
from dedupcore.bloom import BloomRing, atomic_write
from dedupcore.config import StoreConfig
from dedupcore.errors import CorruptFileError
from dedupcore.tiers.lmdb import LmdbTier

__all__ = ["FRONT_COVERS", "FrontFilter", "read_covers"]

log = logging.getLogger("dedupcore.store")

# The log position the saved front filter covers: every key logged through it
# is in the filter. Written after the filter, before LMDB's checkpoint moves.
FRONT_COVERS = "covers_lsn"


class FrontFilter:
    """The front filter's part of :class:`~dedupcore.store.DedupStore` (mixed in)."""

    path: Path
    config: StoreConfig
    readonly: bool
    _lmdb: LmdbTier
    _table: _engine.ClaimTable
    _front: BloomRing
    _front_slice: int
    _last_lsn: int

    def _front_window(self) -> float:
        window = self.config.longest_exact_window()
        return window + max(window * 0.25, 2 * self.config.sweep_interval)

    def _open_front(self) -> bool:
        """Loads the front filter; False if it has to be rebuilt from the authority."""
        path = self.path / "front"
        window = self._front_window()
        try:
            ring = BloomRing.open(path)
            if ring.window != window or ring.error_rate != self.config.front_error_rate:
                raise CorruptFileError("front filter settings changed")
            covers, covers_slice = read_covers(path / FRONT_COVERS)
            checkpoint = self._lmdb.checkpoint_lsn()
            if covers < checkpoint and covers_slice < 0:
                # Valid files from an earlier moment (a restored or copied
                # directory) would answer "definitely new" for keys LMDB holds.
                raise CorruptFileError(
                    f"front filter covers the log through {covers}, behind the checkpoint "
                    f"{checkpoint}"
                )
            if covers < checkpoint:
                # Saved at an earlier checkpoint (docs/warm-tier.md, "The front filter
                # on disk"): what LMDB took since lies in that slice and newer ones.
                now_w = time.time()
                for joined in self._lmdb.digests_since(covers_slice):
                    ring.insert_many(_keys.front_hashes_of(joined), now_w)
        except CorruptFileError as exc:
            if (path / "ring.json").exists() or self._lmdb.record_count():
                log.warning(
                    "front filter at %s unusable (%s); rebuilding it from the authority", path, exc
                )
            for stale in path.glob("*"):
                if not self.readonly:
                    stale.unlink()
            self._front = self._new_front(None if self.readonly else path)
            return not self._lmdb.record_count()
        self._front = ring
        return True

    def _new_front(self, path: Path | None) -> BloomRing:
        window = self._front_window()
        return BloomRing(
            window,
            window / 8,
            self.config.front_slice_capacity,
            self.config.front_error_rate,
            path=path,
        )

    def _rebuild_front(self) -> None:
        total = self._lmdb.record_count()
        now = time.time()
        batch: list[int] = []
        done = 0
        progress = _progress(total, "rebuilding the front filter")
        for digest, _raw in self._lmdb.iter_records():
            batch.append(_keys.front_hash(digest))
            if len(batch) >= 100_000:
                self._front.insert_many(_keys.u64(batch), now)
                done += len(batch)
                progress(done)
                batch.clear()
        if batch:
            self._front.insert_many(_keys.u64(batch), now)
            done += len(batch)
        progress(done)
        held = self._table.digests()
        if held:
            self._front.insert_many(_keys.front_hashes_of(held), now)
        if not self.readonly:
            self._save_front(self._last_lsn)

    def _save_front(self, lsn: int) -> None:
        """Saves the front filter and records that it covers the log through ``lsn`` and
        every record LMDB holds outside the newest slice and the ones after it."""
        slice_id = self._lmdb.newest_slice_id
        self._front.save()
        atomic_write(self.path / "front" / FRONT_COVERS, [f"{lsn} {slice_id}\n".encode()])
        self._front_slice = slice_id


def read_covers(path: Path) -> tuple[int, int]:
    """What a saved front filter covers: (log position, warm-tier slice); -1 for what is
    unknown (a file without the slice makes a front behind the checkpoint rebuilt)."""
    try:
        fields = path.read_text().split()
        lsn = int(fields[0])
        slice_id = int(fields[1]) if len(fields) > 1 else -1
    except (OSError, ValueError, IndexError):
        return -1, -1
    return lsn, slice_id


def _progress(total: int, what: str) -> Callable[[int], None]:
    """A progress bar on a terminal for long work; a no-op elsewhere or without rich
    (an optional dependency: the ``cli`` extra)."""
    import sys

    if not sys.stderr.isatty() or total < 100_000:
        return lambda done: None
    try:
        from rich.progress import Progress
    except ImportError:
        return lambda done: None

    progress = Progress(transient=True)
    task = progress.add_task(what, total=total)
    progress.start()

    def update(done: int) -> None:
        progress.update(task, completed=done)
        if done >= total:
            progress.stop()

    return update
