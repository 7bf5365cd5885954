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

import dedupcore.keys as _keys
from dedupcore._files import atomic_write
from dedupcore.config import StoreConfig
from dedupcore.errors import CorruptFileError
from dedupcore.ring import BloomRing
from dedupcore.tiers.lmdb import LmdbTier

__all__ = [
    "FRONT_COVERS",
    "front_window",
    "new_front",
    "open_front",
    "read_covers",
    "rebuild_front",
    "save_front",
]

log = logging.getLogger("dedupcore.store")

# The log position the saved front filter covers: every key logged through it
# is in the filter. Written after the filter, before LMDB's checkpoint moves.
FRONT_COVERS = "covers_lsn"


def front_window(config: StoreConfig) -> float:
    """Seconds a key stays in the front filter: the longest exact window and a margin
    of a quarter of it, at least two sweeps (a checkpoint renews keys in flight)."""
    window = config.longest_exact_window()
    return window + max(window * 0.25, 2 * config.sweep_interval)


def open_front(
    path: Path, config: StoreConfig, lmdb: LmdbTier, *, readonly: bool
) -> tuple[BloomRing, bool]:
    """Loads the front filter saved in ``path``: (filter, whether it holds every key
    LMDB holds). Unusable files give an empty filter (False unless LMDB is empty
    too): :func:`rebuild_front` fills it from the authority."""
    window = front_window(config)
    try:
        ring = BloomRing.open(path)
        if ring.window != window or ring.error_rate != config.front_error_rate:
            raise CorruptFileError("front filter settings changed")
        covers, covers_slice = read_covers(path / FRONT_COVERS)
        checkpoint = lmdb.checkpoint_lsn()
        if covers < checkpoint and covers_slice < 0:
            # Valid files from an earlier moment (a restored or copied
            # directory) would answer "definitely new" for keys LMDB holds.
            raise CorruptFileError(
                f"front filter covers the log through {covers}, behind the checkpoint {checkpoint}"
            )
        if covers < checkpoint:
            # Saved at an earlier checkpoint (docs/warm-tier.md, "The front filter
            # on disk"): what LMDB took since lies in that slice and newer ones.
            now_w = time.time()
            for joined in lmdb.digests_since(covers_slice):
                ring.insert_many(_keys.front_hashes_of(joined), now_w)
    except CorruptFileError as exc:
        if (path / "ring.json").exists() or lmdb.record_count():
            log.warning(
                "front filter at %s unusable (%s); rebuilding it from the authority", path, exc
            )
        for stale in path.glob("*"):
            if not readonly:
                stale.unlink()
        return new_front(config, None if readonly else path), not lmdb.record_count()
    return ring, True


def new_front(config: StoreConfig, path: Path | None) -> BloomRing:
    """An empty front filter (saved in ``path``; None: kept in memory only)."""
    window = front_window(config)
    return BloomRing(
        window,
        window / 8,
        config.front_slice_capacity,
        config.front_error_rate,
        path=path,
    )


def rebuild_front(front: BloomRing, lmdb: LmdbTier, held: bytes) -> None:
    """Adds the key of every record LMDB holds, and of the concatenated digests
    ``held`` (the records in memory), to ``front``."""
    total = lmdb.record_count()
    now = time.time()
    batch: list[int] = []
    done = 0
    progress = _progress(total, "rebuilding the front filter")
    for digest, _raw in lmdb.iter_records():
        batch.append(_keys.front_hash(digest))
        if len(batch) >= 100_000:
            front.insert_many(_keys.u64(batch), now)
            done += len(batch)
            progress(done)
            batch.clear()
    if batch:
        front.insert_many(_keys.u64(batch), now)
        done += len(batch)
    progress(done)
    if held:
        front.insert_many(_keys.front_hashes_of(held), now)


def save_front(front: BloomRing, path: Path, lsn: int, slice_id: int) -> None:
    """Saves ``front`` into ``path`` and records that it covers the log through ``lsn``
    and every record LMDB holds outside warm-tier slice ``slice_id`` and the ones
    after it: the filter first, then what it covers (docs/warm-tier.md)."""
    front.save()
    atomic_write(path / FRONT_COVERS, [f"{lsn} {slice_id}\n".encode()])


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
