"""DedupStore: claim / complete / release with leases and fencing tokens.

The embedded authority. It decides the order of the tiers and never speaks
LMDB or the log format itself::

    claim ──> recent records (memory, not yet in LMDB)
          ──> front filter: "definitely new" skips the rest
          ──> LmdbTier: exact records, written in sorted checkpoint batches
          ──> cold archive: demoted keys, DUPLICATE with exact=False

Every change is a full record appended to the write-ahead log under the
store's lock (so the log order is the decision order); the caller then
waits, outside the lock, until the log is durable up to every record its
answer depends on (group commit: concurrent callers share one fdatasync).
Only then is the answer returned, so an acknowledged claim or completion
survives a crash, and no answer is ever based on a record a crash could
still take back.

Lease timeline of one key (tokens grow on every new owner)::

    owner A: claim ─ NEW t=1 ── lease ──┤ (A stalls)
    owner B:             claim ─ IN_PROGRESS      claim ─ NEW t=2 (takeover)
    owner A:                                              complete(t=1) ─ StaleTokenError
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from dedupcore import keys as _keys
from dedupcore.api import (
    Claim,
    ClaimAPI,
    InProgressError,
    KeyRecord,
    Outcome,
    change_items,
    check_fingerprints,
    check_owner,
    fingerprint_conflict,
    namespace_counts,
    pack_result,
    unpack_result,
)
from dedupcore.bloom import BloomRing
from dedupcore.config import Retention, StoreConfig, check_lease, policies
from dedupcore.errors import (
    CorruptFileError,
    DedupError,
    StaleTokenError,
)
from dedupcore.record import Record, State, decode, encode
from dedupcore.tiers.archive import ColdArchive
from dedupcore.tiers.lmdb import Change, LmdbTier
from dedupcore.wal import WriteAheadLog

__all__ = [
    "Claim",
    "DedupStore",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "StoreLockedError",
]

log = logging.getLogger("dedupcore.store")

P = ParamSpec("P")
R = TypeVar("R")

LOCK_FILE = "LOCK"
_MAX_NAMESPACES = 65535


class StoreLockedError(DedupError, BlockingIOError):
    """The data directory is owned by another process."""


@dataclass
class _Stats:
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    takeovers: int = 0
    front_negative: int = 0
    front_positive: int = 0
    lmdb_reads: int = 0
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    demoted: int = 0
    swept: int = 0


class DedupStore(ClaimAPI):
    """An embedded dedup store over one data directory (see the module docstring)."""

    # -- opening and closing -------------------------------------------------

    def __init__(
        self, path: str | os.PathLike[str], config: StoreConfig, *, readonly: bool = False
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.readonly = readonly
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._recent: dict[bytes, Record] = {}
        self._flushing: dict[bytes, Record] = {}
        # PROCESSING records stay in memory whatever their age: their lease
        # deadlines live on this process's monotonic clock, not on disk.
        self._inflight: dict[bytes, Record] = {}
        self._stats = _Stats()
        self._closed = False
        self._failed: BaseException | None = None
        self._lock_fd: int | None = None
        self._last_checkpoint = time.monotonic()
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
            self._take_lock()
        try:
            self._lmdb = LmdbTier(
                self.path / "lmdb", map_size=config.map_size, readonly=readonly, sync=durable
            )
            self._ns_ids = {name: i for name, i in self._lmdb.namespaces().items()}
            self._ns_names = {i: name.decode() for name, i in self._ns_ids.items()}
            self._cold = ColdArchive(
                self.path / "cold",
                [p.cold_window for p in policies(config.retention, config.namespaces)],
                slice_capacity=config.cold_slice_capacity,
                error_rate=config.cold_error_rate,
                readonly=readonly,
            )
            self._wal = WriteAheadLog.open(
                self.path / "wal",
                sync="fdatasync" if durable else "none",
                readonly=readonly,
                must_exist=self._lmdb.checkpoint_lsn() > 0,
            )
            front_ok = self._open_front()
            self._replay()
            if not front_ok:
                self._rebuild_front()
            if not readonly:
                self._worker = threading.Thread(
                    target=self._background, name="dedupcore-store", daemon=True
                )
                self._worker.start()
        except BaseException:
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
        another process gets :class:`StoreLockedError` (share it through
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

    def _take_lock(self) -> None:
        lock_path = self.path / LOCK_FILE
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                f"data directory {self.path} is owned by process {owner}; one process "
                "owns a directory at a time: share it through `dedupcore serve` and "
                "connect with dedupcore.Client, or open it with readonly=True to inspect it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        """Checkpoints, saves the filters and closes; the store cannot be used afterwards."""
        if self._closed or os.getpid() != self._pid:
            return
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._worker is not None:
            self._worker.join()
        try:
            if not self.readonly and self._failed is None:
                self._checkpoint()
        finally:
            self._wal.close()
            self._lmdb.close()
            self._release_lock()

    def __enter__(self) -> DedupStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DedupStore {str(self.path)!r}{' readonly' if self.readonly else ''}>"

    def _check_usable(self, write: bool = False) -> None:
        if os.getpid() != self._pid:
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

    # -- filters ---------------------------------------------------------------

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
                self._front.add_many(_keys.u64(batch), now)
                done += len(batch)
                progress(done)
                batch.clear()
        if batch:
            self._front.add_many(_keys.u64(batch), now)
            done += len(batch)
        progress(done)
        for d in self._recent:
            self._front.add_many(_keys.u64([_keys.front_hash(d)]), now)
        if not self.readonly:
            self._front.save()

    # -- replay ----------------------------------------------------------------

    def _replay(self) -> None:
        """Loads in-flight records and the log past the last checkpoint into memory."""
        now_w = time.time()
        now_m = time.monotonic()
        held = self._lmdb.inflight_digests()
        for d, raw in zip(held, self._lmdb.get_many(held), strict=True):
            if raw is not None:
                r = decode(raw)
                if r.state is State.PROCESSING:
                    # A holder may still be alive: it gets a fresh lease of its duration.
                    r.deadline = now_m + r.lease
                    self._inflight[d] = r
        replayed: list[bytes] = []
        for lsn, payload in self._wal.replay(self._lmdb.checkpoint_lsn()):
            for digest, record in _unpack_batch(payload):
                record.lsn = lsn
                self._recent[digest] = record
                replayed.append(digest)
                if record.state is State.PROCESSING:
                    record.deadline = now_m + record.lease
                    self._inflight[digest] = record
                else:
                    self._inflight.pop(digest, None)
        if replayed:
            self._front.add_many(_keys.front_hashes(replayed), now_w)

    # -- namespaces ----------------------------------------------------------

    def _ns_id(self, namespace: bytes) -> int:
        ns_id = self._ns_ids.get(namespace)
        if ns_id is None:
            with self._lock:
                ns_id = self._ns_ids.get(namespace)
                if ns_id is None:
                    if self.readonly:
                        return -1
                    if len(self._ns_ids) >= _MAX_NAMESPACES:
                        raise DedupError(f"more than {_MAX_NAMESPACES} namespaces")
                    ns_id = len(self._ns_ids) + 1
                    self._lmdb.add_namespace(namespace, ns_id)
                    self._ns_ids[namespace] = ns_id
                    self._ns_names[ns_id] = namespace.decode()
        return ns_id

    def _retention(self, ns_id: int) -> Retention:
        return self.config.retention_for(self._ns_names.get(ns_id, ""))

    # -- lookups ---------------------------------------------------------------

    def _records(self, digests: Sequence[bytes], ns_id: int) -> list[Record | None]:
        """Current records of digests (under the lock): memory, then front, then LMDB."""
        out: list[Record | None] = [None] * len(digests)
        missing: list[int] = []
        for i, d in enumerate(digests):
            r = self._inflight.get(d) or self._recent.get(d) or self._flushing.get(d)
            if r is None:
                missing.append(i)
            else:
                out[i] = r
        if not missing:
            return out
        maybe = self._front.contains_many(
            _keys.front_hashes(
                digests if len(missing) == len(digests) else [digests[i] for i in missing]
            )
        )
        to_read = [i for i, m in zip(missing, maybe, strict=True) if m]
        self._stats.front_negative += len(missing) - len(to_read)
        self._stats.front_positive += len(to_read)
        if to_read:
            self._stats.lmdb_reads += len(to_read)
            raws = self._lmdb.get_many([digests[i] for i in to_read])
            for i, raw in zip(to_read, raws, strict=True):
                if raw is not None:
                    # Never PROCESSING: in-flight records are all in memory.
                    out[i] = decode(raw)
        return out

    def _cold_hits(self, digests: Sequence[bytes], ns_id: int) -> list[bool]:
        if not digests:
            return []
        window = self._retention(ns_id).cold_window
        return self._cold.contains_many(window, _keys.front_hashes(list(digests)))

    # -- claims ----------------------------------------------------------------

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace; one log write and one sync for all.

        A key repeated in the batch is NEW once; its later copies are
        IN_PROGRESS (or NEW with the same token for an ``owner``). A bad key or
        a fingerprint conflict raises before anything is claimed.
        """
        self._check_usable(write=True)
        key_list = list(keys)
        ns = _keys.check_namespace(namespace)
        max_key = self.config.max_key_bytes
        raw_keys = [_keys.check_key(k, max_key) for k in key_list]
        lease_s = self.config.lease if lease is None else check_lease(lease)
        owner_b = check_owner(owner)
        fps = check_fingerprints(fingerprints, len(raw_keys))
        ns_name = ns.decode()
        if not raw_keys:
            return []
        digests = _keys.digests(ns, raw_keys)
        ns_id = self._ns_id(ns)
        with self._lock:
            self._check_usable(write=True)
            now_m = time.monotonic()
            now_w = time.time()
            current = self._records(digests, ns_id)
            pending: dict[bytes, Record] = {}
            claims: list[Claim] = []
            writes: list[tuple[bytes, Record]] = []
            depends = 0
            takeovers = 0
            n_new = n_dup = n_busy = 0
            no_record = [i for i, r in enumerate(current) if r is None]
            cold_hits = self._cold_hits([digests[i] for i in no_record], ns_id)
            cold = {i for i, hit in zip(no_record, cold_hits, strict=True) if hit}
            # Records are never changed once logged, so every never-seen key
            # of the batch shares one record (and one encoding in the log).
            fresh: Record | None = None
            renewals: list[tuple[bytes, Record]] = []
            deadline = now_m + lease_s
            for i, d in enumerate(digests):
                r = pending.get(d, current[i]) if pending else current[i]
                fp = fps[i]
                key = key_list[i]
                if r is not None and r.state is not State.RELEASED:
                    if fp is not None and r.fingerprint is not None and fp != r.fingerprint:
                        raise fingerprint_conflict(key, ns_name)
                    if r.lsn > depends:
                        depends = r.lsn
                    if r.state is State.PROCESSED:
                        n_dup += 1
                        claims.append(
                            Claim(key, ns_name, Outcome.DUPLICATE, r.token, unpack_result(r.result))
                        )
                        continue
                    if owner_b is not None and r.owner == owner_b:
                        # A lease renewal lives in memory only (deadlines are not stored).
                        renewed = dataclasses.replace(r, deadline=deadline)
                        renewals.append((d, renewed))
                        pending[d] = renewed
                        n_new += 1
                        claims.append(Claim(key, ns_name, Outcome.NEW, r.token))
                        continue
                    if r.deadline > now_m:
                        n_busy += 1
                        claims.append(Claim(key, ns_name, Outcome.IN_PROGRESS, r.token))
                        continue
                    takeover = True
                    takeovers += 1
                else:
                    if r is None and i in cold:
                        n_dup += 1
                        claims.append(Claim(key, ns_name, Outcome.DUPLICATE, 0, None, exact=False))
                        continue
                    takeover = False
                if r is None and fp is None:
                    if fresh is None:
                        fresh = Record(
                            State.PROCESSING,
                            ns_id,
                            1,
                            now_w,
                            now_w,
                            lease_s,
                            owner_b,
                            None,
                            None,
                            deadline,
                        )
                    new = fresh
                else:
                    token = 1 if r is None else r.token + 1
                    new = Record(
                        State.PROCESSING,
                        ns_id,
                        token,
                        now_w,
                        now_w,
                        lease_s,
                        owner_b,
                        fp,
                        None,
                        deadline,
                    )
                pending[d] = new
                writes.append((d, new))
                n_new += 1
                claims.append(Claim(key, ns_name, Outcome.NEW, new.token, takeover=takeover))
            # Only now, with every key of the batch checked, does anything change.
            for d, renewed in renewals:
                if self._inflight.get(d) is not None:
                    self._inflight[d] = renewed
            last = self._log(writes)
            for outcome, n in (
                (Outcome.NEW, n_new),
                (Outcome.DUPLICATE, n_dup),
                (Outcome.IN_PROGRESS, n_busy),
            ):
                if n:
                    self._stats.outcomes[(ns_name, outcome.value)] += n
            self._stats.takeovers += takeovers
            if writes:
                self._front.add_many(_keys.front_hashes([d for d, _ in writes]), now_w)
        self._sync(max(last, depends))
        return claims

    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims of one namespace: ``(key, token)`` or ``(key, token, result)``.

        Every item is checked first; a stale token or bad input raises before
        anything is completed.
        """
        self._change_many(items, namespace, State.PROCESSED)

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims of one namespace."""
        self._change_many(items, namespace, State.RELEASED)

    def _change_many(self, items: Iterable[Any], namespace: str, state: State) -> None:
        self._check_usable(write=True)
        ns = _keys.check_namespace(namespace)
        ns_name = ns.decode()
        parsed = [
            (
                key,
                _keys.check_key(key, self.config.max_key_bytes),
                token,
                pack_result(result, self.config.max_result_bytes),
            )
            for key, token, result in change_items(items, with_results=state is State.PROCESSED)
        ]
        if not parsed:
            return
        digests = _keys.digests(ns, [p[1] for p in parsed])
        ns_id = self._ns_id(ns)
        with self._lock:
            self._check_usable(write=True)
            now_w = time.time()
            current = self._records(digests, ns_id)
            pending: dict[bytes, Record] = {}
            writes: list[tuple[bytes, Record]] = []
            depends = 0
            for (key, _raw, token, packed), d, r0 in zip(parsed, digests, current, strict=True):
                r = pending.get(d, r0)
                if r is None or r.state is State.RELEASED:
                    raise StaleTokenError(
                        f"key {key!r} in namespace {ns_name!r} is not claimed (never claimed, "
                        "released, or expired from the store)"
                    )
                if r.token != token:
                    raise StaleTokenError(
                        f"token {token} of key {key!r} is not the key's current token "
                        f"{r.token} (a stale owner whose lease was taken over, or a wrong token)"
                    )
                if r.state is State.PROCESSED:
                    if state is State.PROCESSED:
                        depends = max(depends, r.lsn)  # a retried completion: already done
                        continue
                    raise StaleTokenError(
                        f"key {key!r} was already completed; it cannot be released"
                    )
                new = Record(
                    state,
                    r.ns_id,
                    token,
                    r.created,
                    now_w,
                    r.lease,
                    r.owner,
                    r.fingerprint,
                    packed if state is State.PROCESSED else None,
                )
                pending[d] = new
                writes.append((d, new))
            last = self._log(writes)
            if state is State.PROCESSED and writes:
                # Completion re-adds the key so the front spans the exact window from now.
                self._front.add_many(_keys.front_hashes([d for d, _ in writes]), now_w)
        self._sync(max(last, depends))

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it (None if the store holds nothing)."""
        self._check_usable()
        ns = _keys.check_namespace(namespace)
        raw = _keys.check_key(key, self.config.max_key_bytes)
        d = _keys.digest(ns, raw)
        ns_id = self._ns_ids.get(ns, -1)
        with self._lock:
            r = self._records([d], ns_id)[0]
            if r is None:
                if self._cold_hits([d], ns_id)[0]:
                    return KeyRecord(State.PROCESSED, 0, None, None, None, 0.0, 0.0, exact=False)
                return None
            depends = r.lsn
        if not self.readonly:  # a read-only view reports the owner's log as it finds it
            self._sync(depends)
        return KeyRecord(
            r.state, r.token, r.owner, r.fingerprint, unpack_result(r.result), r.created, r.updated
        )

    # -- the log -------------------------------------------------------------

    def _log(self, writes: list[tuple[bytes, Record]]) -> int:
        """Appends records to the log and to memory (under the lock); returns the last LSN.

        A batch is one log record (split only past ``_LOG_CHUNK_BYTES``), see
        :func:`_pack_batches`. Every record of the batch gets the batch's last LSN.
        """
        if not writes:
            return 0
        try:
            last = self._wal.write(_pack_batches(writes))
        except BaseException as exc:
            self._failed = exc
            raise
        recent = self._recent
        inflight = self._inflight
        for d, r in writes:
            r.lsn = last
            recent[d] = r
            if r.state is State.PROCESSING:
                inflight[d] = r
            elif inflight:
                inflight.pop(d, None)
        if len(recent) >= self.config.checkpoint_records:
            self._wake.notify_all()
        return last

    def _sync(self, lsn: int) -> None:
        if lsn <= 0:
            return
        try:
            self._wal.sync(lsn)
        except BaseException as exc:
            self._failed = exc
            raise

    # -- checkpoints and retention ---------------------------------------------

    def checkpoint(self) -> None:
        """Writes recent records into LMDB (sorted, one durable transaction), then trims the log."""
        self._check_usable(write=True)
        self._checkpoint()

    def _checkpoint(self) -> None:
        with self._checkpoint_lock:
            with self._lock:
                if not self._recent:
                    self._last_checkpoint = time.monotonic()
                    return
                snapshot = self._recent
                self._flushing = snapshot
                self._recent = {}
                lsn = max(r.lsn for r in snapshot.values())
            started = time.monotonic()
            try:
                with self._lock:
                    # Later records go to a new segment, so the old ones can be dropped whole.
                    self._wal.rotate()
                    # Keys that stay in flight must not age out of the front filter:
                    # those claimed more than half a front window ago go in again.
                    now_w = time.time()
                    old = now_w - self._front_window() / 2
                    aged = [d for d, r in self._inflight.items() if r.updated < old]
                    if aged:
                        self._front.add_many(_keys.front_hashes(aged), now_w)
                    # The front is saved before LMDB records the checkpoint, so a
                    # saved front holds every key LMDB holds.
                    self._front.save()
                self._wal.sync(lsn, force=True)
                changes = []
                for d, r in snapshot.items():
                    expiry = None
                    if r.state is not State.PROCESSING:
                        window = self._retention(r.ns_id).exact_window
                        expiry = int((r.updated + window) * 1000)
                    changes.append(Change(d, encode(r), expiry, r.state is State.PROCESSING))
                self._lmdb.checkpoint(changes, lsn)
                self._wal.drop_through(lsn)
            except BaseException:
                with self._lock:
                    # Keep serving the records from memory: the log still holds
                    # them, and the next checkpoint writes them again.
                    snapshot.update(self._recent)
                    self._recent = snapshot
                    self._flushing = {}
                raise
            with self._lock:
                self._flushing = {}
                self._last_checkpoint = time.monotonic()
                self._stats.checkpoints += 1
                self._stats.checkpoint_seconds += time.monotonic() - started

    def sweep(self, now: float | None = None) -> int:
        """Demotes expired PROCESSED records to the cold archive; returns how many.

        Copy then delete: the cold slice is written, fsynced and renamed into
        place before the records are deleted from LMDB. Released tombstones
        past their window are deleted; expired cold slices are dropped.
        """
        self._check_usable(write=True)
        now_w = time.time() if now is None else float(now)
        self._release_abandoned(now_w)
        self._checkpoint()
        demoted = 0
        while True:
            with self._lock:
                entries = self._lmdb.expired(int(now_w * 1000), 50_000)
                if not entries:
                    break
                raws = self._lmdb.get_many([d for _, d in entries])
                to_cold: dict[float, list[int]] = {}
                deletes: list[tuple[bytes, bytes | None]] = []
                for (ekey, d), raw in zip(entries, raws, strict=True):
                    if raw is None or d in self._recent or d in self._flushing:
                        deletes.append((ekey, None))
                        continue
                    r = decode(raw)
                    policy = self._retention(r.ns_id)
                    if r.state is State.PROCESSING or r.updated + policy.exact_window > now_w:
                        deletes.append((ekey, None))  # stale entry: the key changed since
                        continue
                    if r.state is State.PROCESSED and policy.cold_window > 0:
                        to_cold.setdefault(policy.cold_window, []).append(_keys.front_hash(d))
                    deletes.append((ekey, d))
                for window, hashes in to_cold.items():
                    demoted += self._cold.add_many(window, hashes, now_w)
                self._lmdb.delete_expired(deletes)
                self._stats.swept += sum(1 for _, d in deletes if d is not None)
        with self._lock:
            self._cold.expire(now_w)
            self._stats.demoted += demoted
            self._last_sweep = time.monotonic()
        return demoted

    def _release_abandoned(self, now_w: float) -> None:
        """Releases PROCESSING records older than their exact window whose lease ran out.

        Their owner is gone and no redelivery claimed them again; a tombstone
        (durable, through the log) keeps the token growing and lets retention
        remove the key like any other.
        """
        now_m = time.monotonic()
        with self._lock:
            writes = [
                (
                    d,
                    Record(
                        State.RELEASED,
                        r.ns_id,
                        r.token,
                        r.created,
                        now_w,
                        r.lease,
                        r.owner,
                        r.fingerprint,
                        None,
                    ),
                )
                for d, r in self._inflight.items()
                if r.deadline <= now_m
                and r.updated + self._retention(r.ns_id).exact_window <= now_w
            ]
            last = self._log(writes)
        self._sync(last)

    def _background(self) -> None:
        """Checkpoints and sweeps on the configured cadence."""
        while True:
            with self._lock:
                if self._closed:
                    return
                self._wake.wait(timeout=1.0)
                if self._closed or self._failed is not None:
                    return
                now = time.monotonic()
                due_checkpoint = (
                    len(self._recent) >= self.config.checkpoint_records
                    or now - self._last_checkpoint >= self.config.checkpoint_interval
                )
                due_sweep = now - self._last_sweep >= self.config.sweep_interval
            try:
                if due_sweep:
                    self.sweep()
                elif due_checkpoint:
                    self._checkpoint()
            except Exception:
                log.exception("background checkpoint/sweep failed; will retry")

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
                },
                "recent_records": len(self._recent) + len(self._flushing),
                "in_flight": len(self._inflight),
                "checkpoints": self._stats.checkpoints,
                "checkpoint_seconds": self._stats.checkpoint_seconds,
                "demoted": self._stats.demoted,
                "wal_last_lsn": self._wal.last_lsn,
            }


_LOG_CHUNK_BYTES = 8 << 20
_BATCH_COUNT = struct.Struct("<I")
_ENTRY_LEN = struct.Struct("<I")


def _pack_batches(writes: Sequence[tuple[bytes, Record]]) -> list[bytes]:
    """Log payloads for many records: u32 count, then per record its 16-byte
    digest, u32 length and encoded record. Records shared by several keys are
    encoded once; a payload is closed once it passes 8 MiB."""
    encoded: dict[int, bytes] = {}
    payloads: list[bytes] = []
    parts: list[bytes] = []
    size = 0
    for d, r in writes:
        body = encoded.get(id(r))
        if body is None:
            raw = encode(r)
            body = encoded[id(r)] = _ENTRY_LEN.pack(len(raw)) + raw
        parts.append(d)
        parts.append(body)
        size += 16 + len(body)
        if size >= _LOG_CHUNK_BYTES:
            payloads.append(_BATCH_COUNT.pack(len(parts) // 2) + b"".join(parts))
            parts, size = [], 0
    if parts:
        payloads.append(_BATCH_COUNT.pack(len(parts) // 2) + b"".join(parts))
    return payloads


def _unpack_batch(payload: bytes) -> Iterator[tuple[bytes, Record]]:
    """The (digest, record) entries of a log payload; CorruptFileError if malformed."""
    try:
        (count,) = _BATCH_COUNT.unpack_from(payload)
        pos = _BATCH_COUNT.size
        view = memoryview(payload)
        for _ in range(count):
            digest = bytes(view[pos : pos + 16])
            (n,) = _ENTRY_LEN.unpack_from(payload, pos + 16)
            start = pos + 16 + _ENTRY_LEN.size
            if len(digest) != 16 or start + n > len(payload):
                raise CorruptFileError("log batch entry runs past its payload")
            yield digest, decode(view[start : start + n])
            pos = start + n
        if pos != len(payload):
            raise CorruptFileError("log batch has trailing bytes")
    except struct.error as exc:
        raise CorruptFileError(f"malformed log batch: {exc}") from exc


def _slice_dict(s: Any) -> dict[str, Any]:
    return {name: getattr(s, name) for name in s.__dataclass_fields__}


def _progress(total: int, what: str) -> Callable[[int], None]:
    import sys

    if not sys.stderr.isatty() or total < 100_000:
        return lambda done: None
    from rich.progress import Progress

    progress = Progress(transient=True)
    task = progress.add_task(what, total=total)
    progress.start()

    def update(done: int) -> None:
        progress.update(task, completed=done)
        if done >= total:
            progress.stop()

    return update
