"""DedupStore: claim / complete / release with leases and fencing tokens.

The order of the tiers, the log's group commit and a key's lease timeline are
drawn in the package's docstring (dedupcore/store/__init__.py); this module
holds the claims, the log writes and the store's life from open to close.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import dedupcore._engine as _engine
import dedupcore.keys as _keys
from dedupcore._engine import FORM_CHECK, FORM_CLAIMS, FORM_COLUMNS
from dedupcore.api import batches
from dedupcore.api.answers import Claim, KeyRecord, Outcome, namespace_counts
from dedupcore.api.contract import ClaimAPI
from dedupcore.api.deferred import Admit, ReplyColumns
from dedupcore.config import Retention, StoreConfig, policies
from dedupcore.decision import stale_token_error
from dedupcore.errors import (
    CorruptFileError,
    DedupError,
)
from dedupcore.migrate import migrate_v1
from dedupcore.record import State
from dedupcore.store.front import open_front, rebuild_front, save_front
from dedupcore.store.lockfile import OwnerLock
from dedupcore.store.maintenance import Maintenance
from dedupcore.tiers.archive import ColdArchive
from dedupcore.tiers.lmdb import LmdbTier
from dedupcore.wal import WriteAheadLog

__all__ = ["LOG_HEAD_FILE", "DedupStore", "ReplyColumns"]  # dedupcore.store has the public names

T = TypeVar("T")

log = logging.getLogger("dedupcore.store")

#: The write-ahead log's head file (dedupcore/wal/segments.py, "The head file"): outside wal/,
#: so that a log deleted whole or cut short by a segment is refused at open.
LOG_HEAD_FILE = "WAL_HEAD"
_MAX_NAMESPACES = 65535
#: What a lookup answers when LMDB is not asked: no records.
_NO_RECORDS = _engine.PackedRecords(b"", 0)


@dataclass
class _Stats:
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    takeovers: int = 0
    front_negative: int = 0
    front_positive: int = 0
    lmdb_reads: int = 0
    lmdb_reopens: int = 0  # LmdbTier.release_pages after a large checkpoint
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    demoted: int = 0
    swept: int = 0


class DedupStore(Maintenance, ClaimAPI):
    """An embedded dedup store over one data directory (see :mod:`dedupcore.store`)."""

    # -- opening and closing -------------------------------------------------

    def __init__(
        self, path: str | os.PathLike[str], config: StoreConfig, *, readonly: bool = False
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.limits = batches.Limits(
            max_key_bytes=config.max_key_bytes, max_result_bytes=config.max_result_bytes
        )
        self.readonly = readonly
        self._pid = os.getpid()
        self._forks = _forks  # a child of a fork sees more (and refuses to serve)
        self._lock = threading.RLock()
        self._ns_lock = threading.Lock()  # one new namespace at a time (see _add_ns)
        self._lock_wanted = False  # a batch waits for the lock (see _lock_for_batch)
        # Notified when keys are completed or released: wakes claim(wait=) waiters.
        self._changed = threading.Condition(self._lock)
        # Records in memory (the native engine's table): every PROCESSING
        # record whatever its age (lease deadlines live on this process's
        # monotonic clock, not on disk), every record logged since the last
        # checkpoint, and clean copies read back from LMDB.
        self._table = _engine.ClaimTable()
        self._ckpt_lsn = 0  # LMDB holds every record through this log position
        self._last_lsn = 0  # the last log position written
        self._unflushed = 0  # records logged and not yet in LMDB (about)
        self._stats = _Stats()
        self._closed = False
        self._failed: BaseException | None = None
        self._owner = OwnerLock(self.path)
        self._last_checkpoint = time.monotonic()
        self._aged_scan = -math.inf  # when a checkpoint last looked for long-held claims
        self._last_sweep = time.monotonic()
        self._checkpoint_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        durable = config.durability == "durable"
        if readonly:
            if not self.path.is_dir():
                raise FileNotFoundError(f"{self.path}: no data directory to open read-only")
        else:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._owner.take()
        try:
            self._lmdb = LmdbTier(
                self.path / "lmdb",
                map_size=config.map_size,
                readonly=readonly,
                sync=durable,
                slice_records=config.slice_records,
                slice_seconds=config.slice_span(),
                slice_error_rate=config.slice_error_rate,
                filters=self.path / "slices",
            )
            if self._lmdb.format == b"1":
                migrate_v1(self._lmdb, self.path / "wal", readonly=readonly)
            # The log before anything else of the directory is touched: a log that
            # lacks acknowledged records refuses the open with nothing changed.
            self._wal = WriteAheadLog.open(
                self.path / "wal",
                sync="fdatasync" if durable else "none",
                readonly=readonly,
                must_exist=self._lmdb.checkpoint_lsn() > 0,
                head=self.path / LOG_HEAD_FILE,
                head_required=self._lmdb.log_head_kept(),
            )
            if not readonly and not self._lmdb.log_head_kept():
                self._lmdb.keep_log_head()
            self._ns_ids = {name: i for name, i in self._lmdb.namespaces().items()}
            self._ns_names = {i: name.decode() for name, i in self._ns_ids.items()}
            self._cold = ColdArchive(
                self.path / "cold",
                [p.cold_window for p in policies(config.retention, config.namespaces)],
                slice_capacity=config.cold_slice_capacity,
                error_rate=config.cold_error_rate,
                readonly=readonly,
            )
            self._front_slice = -1  # the slice the saved front names (-1: save it anew)
            # The log is read before the front filter is opened: a log that refuses
            # (a segment missing) leaves the front's files as they were.
            self._replay()
            self._open_front()
            if not readonly:
                self._worker = threading.Thread(
                    target=self._background, name="dedupcore-store", daemon=True
                )
                self._worker.start()
        except BaseException:
            for part in ("_wal", "_lmdb"):  # what was opened, so that it can be opened again
                opened = self.__dict__.get(part)
                if opened is not None:
                    with contextlib.suppress(Exception):
                        opened.close()
            self._release_lock()
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        config: StoreConfig | None = None,
        **settings: Any,
    ) -> DedupStore:
        """Opens (creating if needed) the store in directory ``path``.

        Settings are :class:`~dedupcore.config.StoreConfig` fields, given as
        keywords or as ``config=``. One process owns a directory at a time;
        another process gets :class:`~dedupcore.errors.StoreLockedError` (share it through
        ``dedupcore serve``) but may open it with ``readonly=True``.
        """
        if isinstance(path, str) and "://" in path:
            raise ValueError(
                f"{path!r} is a URL: DedupStore.open takes a data directory; open a Redis or "
                "SQL authority (and stacks, shards) with dedupcore.open_store(url)"
            )
        if config is None:
            config = StoreConfig(**settings)
        elif settings:
            raise TypeError("pass either config= or settings as keywords, not both")
        return cls(path, config, readonly=readonly)

    def close(self) -> None:
        """Checkpoints, saves the filters and closes; the store cannot be used afterwards."""
        if self._closed or _forks != self._forks:  # a forked child leaves it to the parent
            return
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._worker is not None:
            self._worker.join()
        clean: int | None = None
        try:
            if not self.readonly and self._failed is None:
                self._checkpoint(final=True)
                clean = self._ckpt_lsn  # the log's head records a clean close if it is all
                try:
                    self._lmdb.save_open_filter()
                except OSError as exc:  # only a faster next open is lost
                    log.warning(
                        "could not save the open slice's filter (%s); the next open "
                        "rebuilds it from the slice's keys",
                        exc,
                    )
        finally:
            self._wal.close(checkpointed=clean)
            self._lmdb.close()
            self._release_lock()

    def durability(self) -> str:
        """What an acknowledged claim survives, from ``config.durability``."""
        return self.durability_report()[1]

    def durability_report(self) -> tuple[int, str]:
        """See :meth:`ClaimAPI.durability_report`: 3 when durable, else 2."""
        if self.config.durability == "durable":
            return 3, (
                "durable: the write-ahead log is fdatasynced before each answer: survives a "
                "process crash and a power loss"
            )
        return 2, (
            "power-loss-unsafe: survives a process crash; a power loss or an OS crash can "
            "lose the last acknowledged claims"
        )

    def __repr__(self) -> str:
        return f"<DedupStore {str(self.path)!r}{' readonly' if self.readonly else ''}>"

    def _release_lock(self) -> None:
        self._owner.release()

    def _open_front(self) -> None:
        """Loads the front filter (front.py); rebuilds it from LMDB and the table when
        the saved one does not hold every key LMDB holds."""
        front, complete = open_front(
            self.path / "front", self.config, self._lmdb, readonly=self.readonly
        )
        self._front = front
        if not complete:
            rebuild_front(front, self._lmdb, self._table.digests())
            if not self.readonly:
                self._save_front(self._last_lsn)

    def _save_front(self, lsn: int) -> None:
        """Saves the front filter as covering the log through ``lsn`` and LMDB but for
        the newest slice and the ones after it (front.py)."""
        slice_id = self._lmdb.newest_slice_id
        save_front(self._front, self.path / "front", lsn, slice_id)
        self._front_slice = slice_id

    @property
    def unsynced_commits(self) -> bool:
        """Whether a commit writes the log to the OS without a sync (power-loss-unsafe)."""
        return self.config.durability == "power-loss-unsafe"

    @property
    def failed(self) -> BaseException | None:
        """None while the store serves; after a log write or sync failed, that error:
        the log's tail is unknown, so the store refuses every call until it is closed
        and reopened (reopening recovers the log). The daemon exits for a restart
        when it sees one (docs/daemon.md)."""
        return self._failed

    def _check_usable(self, write: bool = False) -> None:
        if _forks != self._forks:
            raise DedupError(
                f"this store was opened by process {self._pid} and cannot be used after fork "
                f"(in process {os.getpid()}); open it again in the child, or use dedupcore.Client"
            )
        if self._closed:
            raise DedupError("the store is closed")
        if self._failed is not None:
            raise DedupError(
                f"the store stopped after a failed write ({self._failed}); nothing unacknowledged "
                "was kept: close and reopen it"
            ) from self._failed
        if write and self.readonly:
            raise DedupError("the store is open read-only")

    # -- replay ----------------------------------------------------------------

    def _replay(self) -> None:
        """Loads in-flight records and the log past the last checkpoint into memory.

        Replayed records stay in the table until the next checkpoint, which adds
        their keys to the front filter as it writes them to LMDB."""
        now_m = time.monotonic()
        self._ckpt_lsn = self._lmdb.checkpoint_lsn()
        held = self._lmdb.inflight_digests()
        # A holder may still be alive: a PROCESSING record gets a fresh lease of its duration.
        self._load(self._lmdb.read_many(held), now_m)
        for lsn, payload in self._wal.replay(self._ckpt_lsn):
            try:
                self._table.replay(payload, lsn, now_m)
            except ValueError as exc:
                raise CorruptFileError(
                    f"{self.path / 'wal'}: log record {lsn} is damaged: {exc}"
                ) from None
        self._last_lsn = max(self._ckpt_lsn, self._wal.last_lsn)
        self._unflushed = self._table.dirty(self._ckpt_lsn)

    def _load(self, records: _engine.PackedRecords, now_m: float) -> None:
        """Puts records read from LMDB into the table; CorruptFileError if one is
        damaged."""
        bad = self._table.load(records, now_m)
        if bad >= 0:
            self._damaged(records, bad)

    def _damaged(self, records: _engine.PackedRecords, bad: int) -> NoReturn:
        """Raises for the record at ``bad`` of ``records``, read from LMDB, whose
        value fails its checksum."""
        digest = records.digests()[16 * bad : 16 * bad + 16]
        raise CorruptFileError(
            f"{self.path / 'lmdb'}: the record of digest {digest.hex()} fails its "
            "checksum; the store refuses to answer from damaged data (restore the "
            "directory from a backup)"
        )

    # -- namespaces ----------------------------------------------------------

    def _ns_id(self, namespace: bytes) -> int:
        ns_id = self._ns_ids.get(namespace)
        if ns_id is None:
            ns_id = self._add_ns(namespace)
        return ns_id

    def has_namespace(self, namespace: str) -> bool:
        """Whether ``namespace`` has its id already (a claim in it writes no LMDB
        record first)."""
        return _keys.check_namespace(namespace) in self._ns_ids

    def add_namespace(self, namespace: str) -> None:
        """Gives ``namespace`` its id now, recorded in LMDB, where a first claim in it
        would. That write waits for LMDB's writer, which a checkpoint can hold for
        seconds: the daemon makes it in a worker thread, not on its event loop."""
        self._check_usable(write=True)
        self._ns_id(_keys.check_namespace(namespace))

    def _add_ns(self, namespace: bytes) -> int:
        """A new namespace's id, recorded in LMDB first. Under a lock of its own, not
        the store lock: the LMDB write waits for a checkpoint's transaction, and
        claims in the namespaces already known go on meanwhile."""
        with self._ns_lock:
            ns_id = self._ns_ids.get(namespace)
            if ns_id is not None:
                return ns_id
            if self.readonly:
                return -1
            if len(self._ns_ids) >= _MAX_NAMESPACES:
                raise DedupError(f"more than {_MAX_NAMESPACES} namespaces")
            ns_id = len(self._ns_ids) + 1
            self._lmdb.add_namespace(namespace, ns_id)
            self._ns_names[ns_id] = namespace.decode()
            self._ns_ids[namespace] = ns_id  # last: whoever finds the id finds its name
        return ns_id

    def _retention(self, ns_id: int) -> Retention:
        return self.config.retention_for(self._ns_names.get(ns_id, ""))

    # -- lookups ---------------------------------------------------------------

    def _fetch(self, joined: bytes) -> list[int]:
        """Brings the records of concatenated digests into the table (under the lock);
        returns the indexes of those the exact tiers do not hold: memory, then front,
        then LMDB. No Python work per digest (docs/warm-tier.md, "Lookups")."""
        missing, records = self._read_missing(joined)
        if not records.n:
            return missing
        self._load(records, time.monotonic())
        return self._table.missing(joined, None, missing)

    def _fetch_for_claim(
        self, joined: bytes, cold: bool
    ) -> tuple[list[int], _engine.ReadRecords | None]:
        """:meth:`_fetch` for a claim batch: the records read from LMDB that a claim
        only reads (PROCESSED) come back for the decision instead of going into the
        table (docs/engine.md, "Records read for a claim").

        Only the cold archive's probe reads which keys are still missing, so
        without one (``cold`` False) the keys the table lacked come back as they
        are, LMDB's among them, with no second look: a key with a record
        ignores its cold flag in the decision either way."""
        missing, records = self._read_missing(joined)
        if not records.n:
            return missing, None
        read = self._table.read_records(records, time.monotonic())
        if isinstance(read, int):
            self._damaged(records, read)
        if not cold:
            return missing, read
        return self._table.missing(joined, read, missing), read

    def _read_missing(self, joined: bytes) -> tuple[list[int], _engine.PackedRecords]:
        """The indexes of the concatenated digests the table holds no record of, and
        the records of those LMDB holds, read where the front filter says it may
        (counted)."""
        table = self._table
        if table.clean > self.config.checkpoint_records:
            # Clean copies are a read cache: drop them before they crowd the table.
            table.evict(self._ckpt_lsn)
        missing = table.missing(joined)
        if not missing:
            return missing, _NO_RECORDS
        every = len(missing) * 16 == len(joined)
        held = joined if every else _engine.gather_digests(joined, missing)
        to_read = _engine.select_digests(held, self._front.contains_digests(held))
        n_read = len(to_read) // 16
        self._stats.front_negative += len(missing) - n_read
        self._stats.front_positive += n_read
        if not n_read:
            return missing, _NO_RECORDS
        self._stats.lmdb_reads += n_read
        return missing, self._lmdb.read_many(to_read)

    def _cold_hits(self, joined: bytes, ns_id: int) -> memoryview[bool]:
        """Whether the cold archive holds each of concatenated digests."""
        window = self._retention(ns_id).cold_window
        return self._cold.contains_digests(window, joined)

    # -- claims ----------------------------------------------------------------

    def _claim_batch(self, batch: batches.ClaimBatch) -> list[Claim]:
        """Claims a checked batch; one log write and one sync for all."""
        claims, lsn = self.claim_deferred(batch)
        self._sync(lsn)
        return claims  # type: ignore[no-any-return]

    def claim_deferred(
        self, batch: batches.ClaimBatch, *, form: int = FORM_CLAIMS, admit: Admit | None = None
    ) -> tuple[Any, int]:
        """Decides a checked claim batch without waiting for durability: (answer, lsn).

        The answer is in ``form`` (:class:`~dedupcore.api.deferred.DeferredStore`):
        Claims, the reply's columns, or for FORM_CHECK the bytes of the stored
        results it would carry, with nothing applied. ``admit`` is called with
        those bytes after deciding and before anything changes; what it raises
        refuses the batch unchanged (the daemon bounds its reply so). The
        answer may NOT be passed on before :meth:`wait_durable` ``(lsn)``
        returned: it can depend on records (this batch's, or the ones its
        duplicates were answered from) that a crash could still take back;
        ``lsn`` is 0 when all of it is durable already (docs/daemon.md).
        """
        self._check_usable(write=True)
        key_list = batch.keys
        ns_name = batch.namespace
        if not key_list:
            return _empty_answer(form), 0
        lease_s = self.config.lease if batch.lease is None else batch.lease
        ns_id = self._ns_id(batch.ns)
        joined = batch.digests
        table = self._table
        self._lock_for_batch()
        try:
            self._check_usable(write=True)
            now_m = time.monotonic()
            now_w = time.time()
            probe_cold = not self._cold.empty
            absent, read = self._fetch_for_claim(joined, probe_cold)
            cold: bytearray | None = None
            if absent and probe_cold:
                hits = self._cold_hits(
                    joined
                    if len(absent) == len(key_list)
                    else _engine.gather_digests(joined, absent),
                    ns_id,
                )
                cold = _engine.scatter_flags(len(key_list), absent, hits)
            claims, conflict, depends, payloads, counts = table.claim(
                joined,
                key_list,
                ns_name,
                ns_id,
                lease_s,
                batch.owner,
                batch.fingerprints,
                cold,
                now_w,
                now_m,
                Claim,
                _OUTCOMES,
                _unpack_stored,
                form,
                read,
            )
            if claims is None:
                raise batches.fingerprint_conflict(key_list[conflict], ns_name)
            if admit is not None:
                try:
                    admit(counts[5])
                except BaseException:
                    table.discard()
                    raise
            if form == FORM_CHECK:
                return counts[5], 0
            # Only now, with every key of the batch checked, does anything change.
            last = self._log(payloads, counts[4])
            n_new, n_dup, n_busy, takeovers, _, _ = counts
            outcomes = self._stats.outcomes
            if n_new:
                outcomes[(ns_name, _NEW)] += n_new
            if n_dup:
                outcomes[(ns_name, _DUPLICATE)] += n_dup
            if n_busy:
                outcomes[(ns_name, _IN_PROGRESS)] += n_busy
            if takeovers:
                self._stats.takeovers += takeovers
        finally:
            self._lock.release()
        return claims, self._pending_lsn(max(last, depends))

    def _change_batch(self, batch: batches.ChangeBatch) -> None:
        self._sync(self.change_deferred(batch))

    def change_deferred(self, batch: batches.ChangeBatch, *, check: bool = False) -> int:
        """Completes or releases a checked batch without waiting: the LSN to pass to
        :meth:`wait_durable` before acknowledging (0: nothing to wait for). A stale
        token raises before anything changes. With ``check``, nothing changes at all:
        the batch is decided, a stale token raises, and 0 comes back."""
        self._check_usable(write=True)
        if not batch.keys:
            return 0
        joined = batch.digests
        self._ns_id(batch.ns)
        state = State.PROCESSED if batch.completing else State.RELEASED
        self._lock_for_batch()
        try:
            self._check_usable(write=True)
            now_w = time.time()
            self._fetch(joined)
            bad, kind, current, depends, payloads, n = self._table.change(
                joined, batch.tokens, batch.results, int(state), now_w
            )
            if check or bad >= 0:
                self._table.discard()
            if bad >= 0:
                raise stale_token_error(
                    kind, batch.keys[bad], batch.tokens[bad], current, batch.namespace
                )
            if check:
                return 0
            last = self._log(payloads, n)
            self._changed.notify_all()
        finally:
            self._lock.release()
        return self._pending_lsn(max(last, depends))

    def _wait_change(self, batch: batches.ClaimBatch, timeout: float, attempt: int) -> None:
        """Sleeps until a key of ``batch`` is completed or released, the first of their
        leases runs out, or ``timeout`` passes; at once if one is no longer held. The
        asker's claim that follows waits for the log as any claim does."""
        with self._lock:  # held across the check and the wait: no change slips between
            first = self.held_until(batch)
            if first is None:
                return
            now = time.monotonic()
            wake = min(first, now + timeout)
            if wake > now:
                self._changed.wait(wake - now)

    def held_until(self, batch: batches.ClaimBatch) -> float | None:
        """When the first lease of ``batch``'s keys runs out, on ``time.monotonic()``
        (in the past for a lease that ran out and was not taken over yet); None when a
        key is not held (unknown, completed or released). The daemon times its waiters
        by it (docs/daemon.md, "Waiting on keys")."""
        self._check_usable()
        first = math.inf
        with self._lock:
            self._fetch(batch.digests)
            for d in _engine.split_digests(batch.digests):
                r = self._table.get(d)
                if r is None or r[0] != State.PROCESSING:
                    return None
                first = min(first, r[10])
        return first

    def _extend_batch(self, batch: batches.ExtendBatch) -> None:
        """Renews a checked batch's leases on this process's monotonic clock, all or
        nothing. A renewal is kept in memory, as an owner's re-claim is: nothing is
        logged, so there is no log to wait for (docs/reliability.md, "Heartbeats")."""
        self._check_usable(write=True)
        if not batch.keys:
            return
        joined = batch.digests
        lease_s = self.config.lease if batch.lease is None else batch.lease
        self._lock_for_batch()
        try:
            self._check_usable(write=True)
            self._fetch(joined)
            bad, kind, current = self._table.extend(joined, batch.tokens, lease_s, time.monotonic())
            if bad >= 0:
                raise stale_token_error(
                    kind, batch.keys[bad], batch.tokens[bad], current, batch.namespace, "extended"
                )
            self._table.apply(0)  # renewals only: memory, nothing to log
        finally:
            self._lock.release()

    def wait_durable(self, lsn: int) -> None:
        """Returns once the log is durable through ``lsn`` (a deferred call's LSN).

        Concurrent waiters share one commit (group commit). Raises like the
        blocking calls do when that commit failed; the store then stops.
        """
        self._sync(lsn)

    def start_commit(self) -> bool:
        """Starts the log's next commit on its native commit thread (the daemon's group
        commit; dedupcore/wal/log.py, ``start_commit``): False when it cannot, and the
        records are then made durable by :meth:`wait_durable` as before."""
        return self._wal_call(self._wal.start_commit)

    def finish_commit(self) -> bool:
        """Records the native commit's outcome once done (the descriptor of
        :meth:`commit_fd` became readable); True once none is under way."""
        return self._wal_call(self._wal.finish_commit)

    def commit_fd(self) -> int | None:
        """The descriptor that becomes readable when a native commit is done."""
        return self._wal.commit_fd()

    def commit_bytes(self) -> int:
        """Bytes of log a :meth:`wait_durable` would write and sync now (a commit under
        way counts as unbounded): the daemon waits on its event loop only when few."""
        return self._wal.commit_bytes

    def _pending_lsn(self, lsn: int) -> int:
        """``lsn``, or 0 when the log is durable through it already."""
        if lsn <= 0 or lsn <= self._wal.last_lsn:
            return 0
        return lsn

    def _lock_for_batch(self) -> None:
        """Takes the store lock for a batch; when a checkpoint's eviction holds it,
        says so first: the eviction then pauses after its step (a lock let go and
        taken back at once would go to it again while this thread wakes up)."""
        if not self._lock.acquire(blocking=False):
            self._lock_wanted = True
            self._lock.acquire()

    def _get_record(self, ns: bytes, raw: bytes) -> KeyRecord | None:
        self._check_usable()
        d = _keys.digest(ns, raw)
        ns_id = self._ns_ids.get(ns, -1)
        with self._lock:
            self._fetch(d)
            r = self._table.get(d)
            if r is None:
                if self._cold_hits(d, ns_id)[0]:
                    return KeyRecord(State.PROCESSED, 0, None, None, None, 0.0, 0.0, exact=False)
                return None
            state, _ns, token, created, updated, _lease, owner, fp, result, depends, _ = r
        if not self.readonly:  # a read-only view reports the owner's log as it finds it
            self._sync(depends)
        return KeyRecord(State(state), token, owner, fp, _unpack_stored(result), created, updated)

    # -- the log -------------------------------------------------------------

    def _log(self, payloads: list[bytes], count: int) -> int:
        """Appends the staged records' payloads to the log and stores them in the table
        (under the lock); returns the last LSN (0 if nothing was written).

        A batch is one log record (split only past 8 MiB). Every record of the
        batch gets the batch's last LSN. An error before a byte reaches the log
        (a payload the log refuses) leaves the store usable; after that, the
        bytes past the last acknowledged record are unknown and the store stops.
        """
        if not payloads:
            self._table.apply(0)  # lease renewals only: memory, nothing to log
            return 0
        try:
            last = self._wal.write(payloads)
        except (ValueError, TypeError):
            self._table.discard()
            raise
        except BaseException as exc:
            self._table.discard()
            self._failed = exc
            raise
        self._table.apply(last)
        self._last_lsn = last
        self._unflushed += count
        if self._unflushed >= self.config.checkpoint_records:
            self._wake.notify_all()
        return last

    def _sync(self, lsn: int) -> None:
        if lsn > 0:
            self._wal_call(lambda: self._wal.sync(lsn))

    def _wal_call(self, call: Callable[[], T]) -> T:
        """Runs a call of the log whose failure stops the store."""
        try:
            return call()
        except BaseException as exc:
            self._failed = exc
            raise

    # -- figures ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and figures: outcomes per namespace, filters, LMDB size, log position."""
        self._check_usable()
        with self._lock:
            per_ns = namespace_counts(self._stats.outcomes)
            looked = self._stats.front_negative + self._stats.front_positive
            return {
                "namespaces": per_ns,
                "lease_takeovers": self._stats.takeovers,
                "front": {
                    "negative": self._stats.front_negative,
                    "positive": self._stats.front_positive,
                    "skip_ratio": self._stats.front_negative / looked if looked else 0.0,
                    "nbytes": self._front.nbytes,
                    "estimated_fpr": self._front.estimated_fpr,
                    "slices": [_slice_dict(s) for s in self._front.slices()],
                },
                "cold": self._cold.stats(),
                "lmdb": {
                    "records": self._lmdb.record_count(),
                    "disk_bytes": self._lmdb.disk_bytes(),
                    "reads": self._stats.lmdb_reads,
                    "reopens": self._stats.lmdb_reopens,
                    # Digests looked up in a slice: by the native walk, by LMDB itself.
                    "probes_native": self._lmdb.native_probes,
                    "probes_lmdb": self._lmdb.lmdb_probes,
                    # Keys of whole slices read in order (sealing, compaction, an open).
                    "keys_walked_native": self._lmdb.native_keys,
                    "slices": self._lmdb.slices(),
                },
                "recent_records": self._table.dirty(self._ckpt_lsn),
                "in_flight": self._table.inflight,
                "memory": {"records": len(self._table), "table_bytes": self._table.nbytes},
                "checkpoints": self._stats.checkpoints,
                "checkpoint_seconds": self._stats.checkpoint_seconds,
                "demoted": self._stats.demoted,
                "wal_last_lsn": self._wal.last_lsn,
                "wal_commits": self._wal.commits,
            }


#: Forks into a child this process is (os.register_at_fork): every call checks it
#: instead of asking the kernel for the process id.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)

_OUTCOMES = (Outcome.NEW, Outcome.DUPLICATE, Outcome.IN_PROGRESS)
_NEW, _DUPLICATE, _IN_PROGRESS = (o.value for o in _OUTCOMES)  # the counters' keys


def _empty_answer(form: int) -> Any:
    """The answer to an empty claim batch in ``form`` (new lists each time)."""
    if form == FORM_COLUMNS:
        return (b"", b"", [], [], [], [])
    return 0 if form == FORM_CHECK else []


def _unpack_stored(raw: bytes | None) -> Any:
    """A stored result; CorruptFileError if its bytes are not the msgpack it was."""
    try:
        return batches.unpack_result(raw)
    except Exception as exc:
        raise CorruptFileError(f"a stored result cannot be decoded ({exc})") from None


def _slice_dict(s: Any) -> dict[str, Any]:
    return {name: getattr(s, name) for name in s.__dataclass_fields__}
