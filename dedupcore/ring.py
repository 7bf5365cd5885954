"""Time-sliced Bloom filter rings: one filter per time bucket, for keys that expire.

:class:`BloomRing` holds one slice per time bucket, each a split-block Bloom
filter (dedupcore/bloom.py) that grows sub-filters when it is overfull. A
ring with a path persists its slices as filter files beside a manifest
(``ring.json``), and with key logs rebuilds sealed slices as binary fuse
filters (dedupcore/fuse.py; docs/warm-tier.md, "The cold archive").
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dedupcore._core as _core
import dedupcore.ring_manifest as manifests
from dedupcore._files import atomic_write, mkdir_private
from dedupcore._files import unlink_quiet as _unlink_quiet
from dedupcore.bloom import BloomFilter, check_capacity, check_error_rate, check_seed
from dedupcore.errors import CorruptFileError
from dedupcore.fuse import KeyLog, fuse_file_chunks, open_fuse
from dedupcore.fuse_stacks import FuseStacks, Params
from dedupcore.ring_manifest import RING_FORMAT as RING_FORMAT  # where it always was
from dedupcore.ring_manifest import RING_MANIFEST as RING_MANIFEST

# The ring's messages keep the logger they always had.
log = logging.getLogger("dedupcore.bloom")

__all__ = ["BloomRing", "SliceInfo"]

Keys = Iterable[bytes | bytearray | memoryview | str] | memoryview


GROWTH_TIGHTENING = 0.5  # each grown sub-filter gets half the previous error budget
GROWTH_FACTOR = 2  # and twice the previous capacity
RATE_HEADROOM = 1.25  # a new slice expects the previous slice's keys plus a quarter
KNOWN_RESERVE = 0.1  # the budget share a slice sized from a known count keeps for growth
KNOWN_HEADROOM = 1.05  # and the capacity it adds to that count
MIN_KNOWN_CAPACITY = 1024  # the smallest slice sized from a known count
MIN_GROWN_BUDGET = 1e-12  # a grown sub-filter's budget never reaches zero
FUSE_FPR = 2.0**-16  # a 16-bit fingerprint: the false-positive rate of a fuse slice
#: Keys an insert_many adds per hold of the ring's lock (well under a millisecond),
#: and its pause after a step during which a lookup waited for the lock.
INSERT_STEP = 32768
INSERT_PAUSE = 0.0002


@dataclass
class _Slice:
    bucket: int
    filters: list[BloomFilter] = field(default_factory=list)
    sealed: bool = False
    # A sealed slice rebuilt as a static filter (no Bloom filters left then).
    fuse: _core.FuseFilter | None = None
    # The hashes the slice took (persisted rings): the input of that rebuild.
    log: KeyLog | None = None
    # The stack whose column holds the fuse filter (its own body released then).
    stack: _core.FuseStack | None = None
    column: int = -1
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
    stacked: bool = False  # a fuse slice whose filter is a column of a stack


class _Lookup:
    """The ring's lock, taken for a lookup: when an insert holds it, the lookup says so
    first (``waiting``), so that the insert lets it in after its step; a lock let go
    and taken again at once would go back to the inserting thread while this one
    wakes up. A class, not a generator context manager, which made a one-key lookup
    twice as slow (3.5 us against 1.6)."""

    __slots__ = ("_lock", "waiting")

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.waiting = False

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waiting = True
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _Change:
    """The ring's two locks, taken to change it: ``writing`` first, then the lock its
    lookups take. :meth:`BloomRing.save` holds only ``writing``: nothing changes the
    ring while it writes, and lookups go on (docs/warm-tier.md, "The front filter")."""

    __slots__ = ("_lock", "_writing")

    def __init__(self, writing: threading.RLock, lock: threading.RLock) -> None:
        self._writing = writing
        self._lock = lock

    def __enter__(self) -> None:
        self._writing.acquire()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._writing.release()


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
        self.slice_capacity = check_capacity(slice_capacity)
        self.error_rate = check_error_rate(error_rate)
        self.seed = check_seed(seed)
        self.max_slices = math.ceil(self.window / self.slice_seconds) + 1
        self.slice_error_rate = 1.0 - (1.0 - self.error_rate) ** (1.0 / self.max_slices)
        self.path = Path(path) if path is not None else None
        # Open slices keep their keys' hashes, so that sealed ones can be rebuilt
        # as fuse filters (compact()): a ring with a path that asks for them.
        self.key_logs = bool(key_logs) and self.path is not None
        self._slices: list[_Slice] = []
        self._vouched: dict[int, int] = {}  # bucket -> hashes its key log must prove (open())
        # Every live filter; None: stale.
        self._every: tuple[BloomFilter | _core.FuseFilter | _core.FuseStack, ...] | None = ()
        self._saved: dict[tuple[int, int], int] = {}  # (bucket, sub-filter) -> count saved
        self._lock = threading.RLock()  # lookups; with _writing, every change
        self._writing = threading.RLock()  # changes and saves (see _Change)
        self._change = _Change(self._writing, self._lock)
        # Fuse slices side by side (docs/warm-tier.md, "Stacked fuse slices"), each
        # stack at most as wide as the sealed slices the ring can hold live.
        self.fuse_stacks = FuseStacks(
            min(self.max_slices - 1, _core.FUSE_STACK_MAX_WIDTH), self._change
        )
        self._lookup = _Lookup(self._lock)  # the lock, for lookups (see insert_many)
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
        with self._change:
            keep = [s for s in self._slices if self._live(s.bucket, now)]
            dropped = [s for s in self._slices if not self._live(s.bucket, now)]
            self._slices = keep
            self._every = None
            for s in dropped:
                self.fuse_stacks.leave(s)
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

    def _filters(self) -> tuple[BloomFilter | _core.FuseFilter | _core.FuseStack, ...]:
        """Every live filter: Bloom filters and fuse filters not in a stack oldest first,
        then the stacks (kept until the set changes)."""
        every = self._every
        if every is None:
            every = self._every = (
                *(f for s in self._slices if s.fuse is None for f in s.filters),
                *(s.fuse for s in self._slices if s.fuse is not None and s.stack is None),
                *self.fuse_stacks,
            )
        return every

    def add(self, key: bytes | bytearray | memoryview | str, now: float) -> bool:
        """Adds a key at time ``now``; True if no live slice held it before."""
        h = _core.hash64(key, self.seed)
        with self._change:
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
        batch = self._hashed(keys, expected)
        with self._change:
            return self._add_hashes(batch, now, True, expected)

    def insert_many(self, keys: Keys, now: float, *, expected: int = 0) -> None:
        """Adds a batch at time ``now`` without asking which keys were new.

        Probes only the head's filter, not every live slice: with a slice
        grown into several sub-filters that is most of the cost of an add.
        ``expected`` as for :meth:`add_many`. The keys go in INSERT_STEP at a
        time, each step one hold of the ring's lock, and a lookup that found
        the lock held goes before the next step: a claim's lookup waits for one
        step, not for a checkpoint's whole batch (docs/warm-tier.md, "The front
        filter").
        """
        batch = self._hashed(keys, expected)
        n = len(batch)
        for start in range(0, max(n, 1), INSERT_STEP):
            with self._change:
                self._add_hashes(batch[start : start + INSERT_STEP], now, False, expected)
            if self._lookup.waiting:
                self._lookup.waiting = False
                time.sleep(INSERT_PAUSE)

    def _hashed(self, keys: Keys, expected: int) -> memoryview:
        """The batch's hashes, every key checked before the ring changes at all (a
        uint64 buffer is taken as already hashed and comes back as a copy)."""
        batch = _core.hash64_many(_as_batch(keys), self.seed)
        if isinstance(expected, bool) or not isinstance(expected, int):
            raise TypeError(f"expected must be an int, not {type(expected).__name__}")
        if expected < 0:
            raise ValueError(f"expected must be >= 0, got {expected}")
        return batch

    def _add_hashes(
        self, batch: memoryview, now: float, report: bool, expected: int
    ) -> memoryview[bool]:
        """Adds hashed keys to the head of ``now`` (the caller holds the lock); with
        ``report``, per-key flags: True where no live slice held the key before."""
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
        with self._lookup:
            return any(f.contains_hash(h) for f in self._filters())

    def contains(self, key: bytes | bytearray | memoryview | str) -> bool:
        """True if a live slice may hold the key."""
        return key in self

    def contains_many(self, keys: Keys) -> memoryview[bool]:
        """Membership of each key of a batch in any slice; one hash per key."""
        batch = _as_batch(keys)
        with self._lookup:
            return _core.probe_many(self._filters(), batch, None, self.seed)

    def contains_digests(self, digests: bytes) -> memoryview[bool]:
        """Membership in any slice of each of concatenated 16-byte record digests,
        keyed by their first 8 bytes (the store's front hash; ``_core.probe_digests``)."""
        with self._lookup:
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
                        stacked=s.stack is not None,
                    )
                )
            return out

    def __iter__(self) -> Iterator[SliceInfo]:
        return iter(self.slices())

    def stacks(self) -> list[dict[str, int]]:
        """Each stack of fuse slices: its columns, how many are live, and its bytes
        (docs/warm-tier.md, "Stacked fuse slices")."""
        return self.fuse_stacks.info()

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
                    self._stack_loose()
                    return rebuilt
                keylog = s.log
                try:
                    hashes = keylog.read()
                    with self._lock:
                        like = self.fuse_stacks.like(len(hashes))
                    fuse = _core.FuseFilter.build(hashes, self.seed, like)
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
                    with self._change:
                        s.log = None
                    continue
                with self._change:
                    if s not in self._slices:  # expired meanwhile
                        _unlink_quiet(self._fuse_file(s.bucket))
                        continue
                    s.fuse, s.filters, s.log = fuse, [], None
                    self._every = None
                    self._write_manifest()
                    self._unlink_slice_rest(s)
                rebuilt += 1
                self._stack_loose()  # before the next rebuild picks its geometry

    def _stack_loose(self, widths: dict[Params, int] | None = None) -> None:
        """Moves the fuse slices that can go into a stack there (FuseStacks.stack_loose)."""
        self.fuse_stacks.stack_loose(lambda: self._slices, self._filters_changed, widths)

    def _filters_changed(self) -> None:
        self._every = None

    def save(self) -> None:
        """Writes the unsealed head slice and the manifest to ``path``.

        Holds the lock every change of the ring takes, not the one lookups take:
        lookups go on while the files are written and synced; adds wait."""
        if self.path is None:
            raise ValueError("this ring has no path; pass path= to persist it")
        with self._writing:
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
        settings = {
            "window": self.window,
            "slice_seconds": self.slice_seconds,
            "slice_capacity": self.slice_capacity,
            "error_rate": self.error_rate,
            "seed": self.seed,
            "key_logs": self.key_logs,
        }
        data = manifests.encode(settings, [self._manifest_entry(s) for s in self._slices])
        assert self.path is not None
        atomic_write(self.path / RING_MANIFEST, [data])

    @staticmethod
    def _manifest_entry(s: _Slice) -> dict[str, Any]:
        if s.fuse is not None:
            return manifests.fuse_entry(s.bucket)
        # A key log's count is what it must prove for the slice to be rebuilt from it.
        keys = s.log.hashes if s.log is not None else None
        return manifests.bloom_entry(s.bucket, len(s.filters), s.sealed, keys)

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
        manifest = manifests.load(manifest_path)
        try:
            ring = cls(
                manifest["window"],
                manifest["slice_seconds"],
                manifest["slice_capacity"],
                manifest["error_rate"],
                seed=manifest["seed"],
                path=root,
                key_logs=manifest.get("key_logs", False) if key_logs is None else key_logs,
            )
            entries = manifests.entries(manifest)
        except (ValueError, TypeError, KeyError) as exc:
            raise manifests.damaged(manifest_path, exc) from exc
        ring._vouched = {e.bucket: e.keys for e in entries if e.keys is not None}
        if not readonly:
            for stale in root.glob(".*.tmp"):  # a write a crash cut short (atomic_write)
                _unlink_quiet(stale)
        widths = ring.fuse_stacks.widths(ring._fuse_file(e.bucket) for e in entries if e.fuse)
        for n, entry in enumerate(entries):
            bucket, count, sealed = entry.bucket, entry.subfilters, entry.sealed
            if entry.fuse:
                ring._slices.append(ring._open_fuse_slice(bucket, verify, readonly))
                # Into its stack at once: the archive never takes twice its memory.
                ring._stack_loose(widths)
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
        ring._stack_loose()  # those a stack of full width left loose
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
