"""The embedded store's upkeep: checkpoints, sweeps, compaction and their schedule.

A checkpoint writes the records logged since the last one into LMDB (sorted,
one durable transaction), trims the log and evicts what LMDB now holds from
memory in bounded steps. A sweep drops warm-tier slices past the exact window,
copying their processed keys into the cold archive first. A background thread
runs both on the configured cadence and compacts sealed slices in between
(docs/warm-tier.md).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import dedupcore._engine as _engine
import dedupcore.keys as _keys
from dedupcore.config import Retention, StoreConfig
from dedupcore.record import State, decode_stored
from dedupcore.ring import BloomRing
from dedupcore.store.front import front_window
from dedupcore.tiers.archive import ColdArchive
from dedupcore.tiers.lmdb import LmdbTier
from dedupcore.wal import WriteAheadLog

if TYPE_CHECKING:
    from dedupcore.store.store import _Stats

__all__ = ["Maintenance"]

log = logging.getLogger("dedupcore.store")

# How a checkpoint evicts, in steps that each hold the store lock. A step runs
# without the GIL, and taking the GIL back costs up to a switch interval while
# another thread runs Python. At the daemon's 0.5 ms interval (at most 1 ms):
# steps of 4096 journal entries (about a millisecond), and after a step during
# which a batch asked for the lock (_lock_for_batch) a short pause, since a lock
# let go and taken again at once goes back to the thread that let it go. At the
# default 5 ms: steps of 65536 entries and no pause, so that the GIL's hand-backs
# do not slow the checkpoint down behind a thread that claims without pause.
_EVICT_STEP = 4096
_EVICT_STEP_COARSE = 65536
_EVICT_PAUSE = 0.0002
# The searches for claims in flight (the checkpoint's aged scan, the sweep's
# abandoned claims) visit the table's slots in steps that each hold the store
# lock, with the same pause for a waiting batch (docs/engine.md, "Scans in
# steps"). Slots are read in order, so a step visits more slots than an
# eviction step visits journal entries in the same time; a step of the sweep
# also ends at _SCAN_FOUND records found, since each costs Python work (a
# tuple, a check of its window, its release).
_SCAN_STEP = 32768
_SCAN_STEP_COARSE = 262_144
_SCAN_FOUND = 4096
#: A checkpoint of at least this many records is followed by the LMDB tier's
#: release_pages (docs/warm-tier.md, "Memory after a checkpoint"): LMDB keeps every
#: page a write transaction changed, so the process would hold up to a page per
#: record of its largest checkpoint (16 MiB at this count).
_RELEASE_PAGES_RECORDS = 4096
#: Records per compaction transaction (docs/warm-tier.md, "Compaction"): a few
#: tenths of a second, after which a due checkpoint goes first.
_COMPACT_STEP = 262_144


def _evict_pacing() -> tuple[int, bool]:
    """(entries per step, whether to pause for a waiting batch) at this switch interval."""
    if sys.getswitchinterval() <= 0.001:
        return _EVICT_STEP, True
    return _EVICT_STEP_COARSE, False


def _scan_pacing() -> tuple[int, bool]:
    """(slots a search for claims in flight visits per hold of the store lock,
    whether to pause for a waiting batch) at this switch interval."""
    if sys.getswitchinterval() <= 0.001:
        return _SCAN_STEP, True
    return _SCAN_STEP_COARSE, False


class Maintenance:
    """Checkpoints, sweeps and compaction of :class:`~dedupcore.store.DedupStore` (mixed in)."""

    path: Path
    config: StoreConfig
    _lock: threading.RLock
    _lock_wanted: bool
    _checkpoint_lock: threading.Lock
    _wake: threading.Condition
    _table: _engine.ClaimTable
    _lmdb: LmdbTier
    _wal: WriteAheadLog
    _cold: ColdArchive
    _front: BloomRing
    _front_slice: int
    _stats: _Stats
    _ckpt_lsn: int
    _last_lsn: int
    _unflushed: int
    _closed: bool
    _failed: BaseException | None
    _last_checkpoint: float
    _aged_scan: float
    _last_sweep: float

    if TYPE_CHECKING:  # the store's own

        def _check_usable(self, write: bool = False) -> None: ...
        def _log(self, payloads: list[bytes], count: int) -> int: ...
        def _sync(self, lsn: int) -> None: ...
        def _retention(self, ns_id: int) -> Retention: ...
        def _save_front(self, lsn: int) -> None: ...

    def checkpoint(self) -> None:
        """Writes recent records into LMDB (sorted, one durable transaction), then trims the log."""
        self._check_usable(write=True)
        self._checkpoint()

    def compact(self, max_records: int | None = None) -> int:
        """Rewrites sealed warm-tier slices in key order now (the background thread
        does it on its own, a step at a time); returns the records copied.

        A slice filled by random inserts has B-tree pages about 70 % full; the
        copy, appended in key order, fills them (docs/warm-tier.md,
        "Compaction"). ``max_records`` bounds the work of this call.
        """
        self._check_usable(write=True)
        return self._compact(max_records)

    def _compact(self, limit: int | None) -> int:
        done = 0
        while self._lmdb.compaction_pending() and (limit is None or done < limit):
            step = _COMPACT_STEP if limit is None else min(_COMPACT_STEP, limit - done)
            with self._checkpoint_lock:  # no checkpoint or drop meanwhile
                done += self._lmdb.compact_step(step, self._lock)
        return done

    def _checkpoint(self, final: bool = False) -> None:
        with self._checkpoint_lock:
            with self._lock:
                upto = self._last_lsn
                idle = upto <= self._ckpt_lsn
                aged_scan = False
                if idle:
                    if self._table.clean:
                        self._table.evict(self._ckpt_lsn)
                    self._last_checkpoint = time.monotonic()
                else:
                    started = time.monotonic()
                    # What changed through upto, taken out of the table in O(1):
                    # claims go on meanwhile and their changes are the next
                    # checkpoint's (docs/engine.md, "The change journal").
                    changes = self._table.take_changes()
                    now_w = time.time()
                    # Keys that stay in flight must not age out of the front filter:
                    # those claimed more than half a front window ago go in again.
                    # That visits every slot, so it runs every quarter window, not
                    # at every checkpoint: a key is back in by 3/4 of its window.
                    aged_scan = started - self._aged_scan >= front_window(self.config) / 4
                    if aged_scan:
                        self._aged_scan = started
            if idle:  # nothing to write; a closing store still saves its front
                if final:
                    self._save_front(upto)
                return
            try:
                # The file work runs outside the store lock, so claims go on
                # meanwhile (the log and the front filter have their own locks).
                # Later records go to a new segment, so the old ones can be
                # dropped whole.
                self._wal.rotate()
                aged: list[bytes] = []
                if aged_scan:  # in steps: claims go on between two
                    cutoff = now_w - front_window(self.config) / 2
                    self._scan_steps(math.inf, cutoff, lambda d, _: aged.append(d))
                # Everything goes to LMDB in key order, each record's latest change.
                # LMDB reads the records in place, one at a time (no lists of
                # millions of tuples to build and free while holding the GIL).
                packed, n = _engine.sort_changes(changes)
                records = _engine.PackedRecords(packed, n)
                digests = records.digests()
                # The front filter takes every key LMDB is about to take, before
                # LMDB has it and before the front is saved: a record leaves the
                # table only after this, so a lookup that misses both the table and
                # the front is right to skip LMDB. A claim or a completion adds
                # nothing itself: its record is in the table until it gets here, and
                # its key's front entry spans the exact window from here on
                # (docs/warm-tier.md, "The front filter").
                self._front.insert_many(_keys.front_hashes_of(digests), now_w)
                if aged:
                    self._front.insert_many(_keys.front_hashes_of(b"".join(aged)), now_w)
                # The front is saved before LMDB records the checkpoint, so a saved
                # front, with the slices from the one it names on, holds every key
                # LMDB holds. It is saved once per slice (and at close): between
                # two saves, an open after a crash adds the keys of those slices
                # (docs/warm-tier.md).
                if final or self._lmdb.newest_slice_id != self._front_slice:
                    self._save_front(upto)
                self._wal.sync(upto, force=True)
                self._lmdb.checkpoint(
                    records,
                    records.inflight,
                    records.settled,
                    upto,
                    now=time.time(),
                    newest=changes.newest,
                    digests=digests,
                )
            except BaseException:
                with self._lock:  # LMDB did not take them: the next checkpoint writes them
                    self._table.give_back(changes)
                raise
            del changes, records, packed
            with self._lock:
                self._ckpt_lsn = upto
            self._wal.drop_through(upto)
            released = n >= _RELEASE_PAGES_RECORDS
            if released:
                try:
                    self._lmdb.release_pages()
                except BaseException as exc:
                    # LMDB could not be opened again: the store stops, as after a
                    # failed write (nothing is lost; a reopen serves again).
                    self._failed = exc
                    raise
            # What LMDB now holds leaves memory in bounded steps: a claim waits
            # on the lock for one step at most, not for the whole checkpoint.
            more = True
            step, pause = _evict_pacing()
            while more:
                with self._lock:
                    _dropped, more = self._table.evict_some(upto, step)
                if more and pause:
                    self._let_batch_in()
            with self._lock:
                self._unflushed = self._table.pending
                self._last_checkpoint = time.monotonic()
                self._stats.checkpoints += 1
                self._stats.lmdb_reopens += released
                self._stats.checkpoint_seconds += time.monotonic() - started

    def sweep(self, now: float | None = None) -> int:
        """Drops warm-tier slices past the exact window; returns the keys demoted to cold.

        A slice is dropped whole once its newest record is older than the
        longest exact window (docs/warm-tier.md). Copy then drop: its PROCESSED
        keys (those no newer slice holds) are written into the cold archive,
        fsynced and renamed into place first; records still in flight move to
        the newest slice in the same LMDB transaction as the drop. Abandoned
        claims past their window become tombstones first; expired cold slices
        are dropped.
        """
        self._check_usable(write=True)
        now_w = time.time() if now is None else float(now)
        self._release_abandoned(now_w)
        self._checkpoint()
        window = self.config.longest_exact_window()
        demoted = 0
        with self._checkpoint_lock:  # no checkpoint writes into a slice being dropped
            self._lmdb.seal_idle(now_w, window)
            for sid in self._lmdb.droppable(now_w, window):
                keep, to_cold, dropped = self._drop_plan(sid)
                for cold_window, hashes in to_cold.items():
                    expected = self._cold_expected(
                        cold_window, now_w, len(hashes), dropped + len(keep)
                    )
                    demoted += self._cold.add_many(cold_window, hashes, now_w, expected=expected)
                with self._lock:
                    self._lmdb.drop_slice(sid, keep, now=time.time())
                    self._table.evict(self._ckpt_lsn)  # no clean copy of a dropped record
                    self._stats.swept += dropped
        with self._lock:
            self._cold.expire(now_w)
            self._stats.demoted += demoted
            self._last_sweep = time.monotonic()
        # Outside both locks: a large slice takes seconds, and claims probe
        # its Bloom filters meanwhile (docs/warm-tier.md, "The cold archive").
        self._cold.compact()
        return demoted

    def _cold_expected(self, cold_window: float, now: float, demoting: int, scanned: int) -> int:
        """Keys the cold slice this drop goes into will receive in all: the records of
        the warm slices that drop before that slice ends (this one included), at
        the share of this slice's records that went to ``cold_window``. The
        archive uses it only when this drop starts the slice."""
        end = self._cold.slice_end(cold_window, now)
        if end is None or not scanned:
            return 0
        window = self.config.longest_exact_window()
        upcoming = self._lmdb.records_dropping_by(end, window)
        return max(demoting, math.ceil(upcoming * demoting / scanned))

    def _drop_plan(self, sid: int) -> tuple[list[tuple[bytes, bytes]], dict[float, list[int]], int]:
        """What dropping slice ``sid`` must keep: (in-flight records to move, PROCESSED
        front hashes per cold window, records dropped). Only the newest version of a
        key counts: a key a newer slice holds is that slice's business."""
        inflight = set(_engine.split_digests(self._lmdb.inflight_digests()))
        keep: list[tuple[bytes, bytes]] = []
        to_cold: dict[float, list[int]] = {}
        seen = 0
        batch: list[tuple[bytes, bytes]] = []

        def flush() -> None:
            nonlocal seen
            newer = self._lmdb.newer_holds(sid, [d for d, _ in batch])
            for (d, raw), superseded in zip(batch, newer, strict=True):
                seen += 1
                if superseded:
                    continue
                state, ns_id, *_ = decode_stored(d, raw, self.path / "lmdb")
                if state == State.PROCESSING and d in inflight:
                    keep.append((d, raw))
                elif state == State.PROCESSED:
                    policy = self._retention(ns_id)
                    if policy.cold_window > 0:
                        to_cold.setdefault(policy.cold_window, []).append(_keys.front_hash(d))
            batch.clear()

        for item in self._lmdb.scan_slice(sid):
            batch.append(item)
            if len(batch) >= 100_000:
                flush()
        if batch:
            flush()
        return keep, to_cold, seen - len(keep)

    def _let_batch_in(self) -> None:
        """Pauses between two steps that hold the store lock if a batch asked for it:
        a lock let go and taken again at once goes back to this thread."""
        if self._lock_wanted:
            self._lock_wanted = False
            time.sleep(_EVICT_PAUSE)

    def _scan_steps(
        self,
        deadline_before: float,
        updated_before: float,
        found: Callable[[bytes, list[tuple[int, int, float]]], None],
        details: bool = False,
    ) -> None:
        """Searches the table for PROCESSING records whose lease deadline is <=
        ``deadline_before`` and last change < ``updated_before``, a bounded step per
        hold of the store lock; ``found(digests, details)`` runs under the lock of
        each step with what it found. A record may be found twice; none that stays
        in flight is missed (docs/engine.md, "Scans in steps"). The caller holds
        the checkpoint lock: one search at a time."""
        step, pause = _scan_pacing()
        begun = more = False
        try:
            while not begun or more:
                with self._lock:
                    if not begun:
                        self._table.scan_begin()
                        begun = True
                    digests, info, _visited, more = self._table.scan_step(
                        deadline_before,
                        updated_before,
                        step,
                        _SCAN_FOUND if details else 0,
                        details,
                    )
                    if digests:
                        found(digests, info)
                if more and pause:
                    self._let_batch_in()
        finally:
            if more:  # given up half way (an error): the table stops tracking it
                with self._lock:
                    self._table.scan_end()

    def _release_abandoned(self, now_w: float) -> None:
        """Releases PROCESSING records older than their exact window whose lease ran out.

        Their owner is gone and no redelivery claimed them again; a tombstone
        (durable, through the log) keeps the token growing and lets retention
        remove the key like any other. Found and released a step at a time, each
        in one hold of the store lock.
        """
        now_m = time.monotonic()
        last = 0

        def release(digests: bytes, info: list[tuple[int, int, float]]) -> None:
            nonlocal last
            gone: dict[bytes, int] = {}  # a record found twice is released once
            for i, (ns_id, token, updated) in enumerate(info):
                if updated + self._retention(ns_id).exact_window <= now_w:
                    gone[digests[16 * i : 16 * i + 16]] = token
            if gone:
                bad, _kind, _cur, _dep, payloads, n = self._table.change(
                    b"".join(gone), list(gone.values()), None, int(State.RELEASED), now_w
                )
                if bad < 0:
                    last = self._log(payloads, n)

        with self._checkpoint_lock:
            self._scan_steps(now_m, math.inf, release, details=True)
        self._sync(last)

    def _background(self) -> None:
        """Checkpoints and sweeps on the configured cadence; compacts sealed slices
        while neither is due."""
        compacting = False
        while True:
            with self._lock:
                if self._closed:
                    return
                if not compacting:
                    self._wake.wait(timeout=1.0)
                if self._closed or self._failed is not None:
                    return
                now = time.monotonic()
                due_checkpoint = (
                    self._unflushed >= self.config.checkpoint_records
                    or now - self._last_checkpoint >= self.config.checkpoint_interval
                )
                due_sweep = now - self._last_sweep >= self.config.sweep_interval
            compacting = False
            try:
                if due_sweep:
                    self.sweep()
                elif due_checkpoint:
                    self._checkpoint()
                # One step after every checkpoint, back to back while none is due: a
                # store under constant load still compacts (a step of 262,144 records
                # per checkpoint of 200,000 keeps up with the slices being sealed).
                if self.config.compact_slices and self._lmdb.compaction_pending():
                    self._compact(_COMPACT_STEP)
                    compacting = self._lmdb.compaction_pending()
            except Exception:
                log.exception("background checkpoint/sweep/compaction failed; will retry")
