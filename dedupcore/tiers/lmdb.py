"""LmdbTier: the warm, exact records of the embedded authority, in LMDB, in time slices.

The tier is written only in large, sorted, durable batches (checkpoints) from
the store's records in memory; acknowledgements never wait for it (a durable
LMDB commit of random keys costs about one page write per key;
docs/architecture.md, "Performance"). A B-tree that takes random inserts forever gets slower
and bigger as history grows, so the records live in time slices
(docs/warm-tier.md):

- ``s:<id>`` (one named database per slice): 16-byte digest -> the record in
  the stored format of docs/engine.md. Checkpoints write only into the
  newest slice, so the tree that takes random inserts stays small. A slice
  holds at most ``slice_records`` records (or a 32nd of all the slices hold,
  when that is more: ``SLICE_SHARE``) and takes writes for at most
  ``slice_seconds``; then it is sealed and the next one starts.
- Every slice has a Bloom filter of its digests (dedupcore.tiers.slice_filters,
  which keeps their files under ``slices/``): a lookup reads only the slices
  whose filter says "maybe", newest first, and the first version found wins.
- A sealed slice is rewritten in key order into ``k:<id>`` (compaction):
  random inserts leave B-tree pages about 70 % full, appends in key order
  fill them (40 bytes per record instead of about 58). The copy runs in
  bounded steps beside claims and checkpoints, resumes from the last key
  copied after a crash, and takes the slice's place in one transaction
  (docs/warm-tier.md, "Compaction").
- A sealed slice whose newest record is past the exact window is dropped
  whole (no per-key deletes); LMDB reuses its pages. The store copies its
  PROCESSED keys into the cold archive first and moves records still in
  flight into the newest slice in the same transaction as the drop.
- ``inflight``: digest -> b"" for PROCESSING records, loaded at open.
- ``meta``: ``checkpoint_lsn`` (the write-ahead log position LMDB holds
  everything up to), ``format`` (b"3"; b"2" is the same layout without
  compacted slices, opened as it is; b"1" is the older single-tree format,
  converted at open by dedupcore.migrate), namespace names <-> 16-bit ids,
  and one ``slice:<id>`` entry per slice (records, first and last write
  time, state: open, sealed, or sealed and compacted), and ``log_head``
  (b"1" once the store keeps the write-ahead log's head file, ``WAL_HEAD``:
  from then on a missing head file is damage, docs/operations.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import lmdb

import dedupcore._core as _core
import dedupcore._engine as _engine
from dedupcore._platform import trim_heap
from dedupcore.bloom import BloomFilter
from dedupcore.config import StoreConfig
from dedupcore.errors import CorruptFileError, DedupError, UnsupportedFormatError
from dedupcore.tiers.environment import Environment, open_dbs
from dedupcore.tiers.slice_filters import SliceFilters, second_halves

__all__ = ["FORMAT", "LmdbTier", "SliceInfo"]

FORMAT = b"3"
#: b"2" differs only in having no compacted slices: an older version would not
#: find their ``k:`` databases, so the first compaction raises the format to 3.
_KNOWN_FORMATS = (b"1", b"2", FORMAT)
_U64 = struct.Struct(">Q")

_T_co = TypeVar("_T_co", covariant=True)


class SizedIterable(Protocol[_T_co]):
    """What a checkpoint takes: sized, and iterable again (a list, or records read
    in place from a buffer)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[_T_co]: ...


_SLICE_META = struct.Struct("<QQQB")  # records, first write ms, last write ms, state
_OPEN, _SEALED, _COMPACTED = 0, 1, 2  # a slice's state in its meta entry
MAX_SLICES = 200  # past this, slices stop rolling over by count (LMDB named-db slots)
_MAX_DBS = MAX_SLICES + 16
#: A slice takes at least ``slice_records`` records, and at least this fraction of all
#: the tier holds: small slices while the tier is small (the tree that takes random
#: inserts stays in cache, and the pages its copy-on-write frees stay few), about 140
#: slices at a billion records (docs/warm-tier.md).
SLICE_SHARE = 1 / 32


@dataclass(slots=True)
class SliceInfo:
    """One slice of the warm tier."""

    id: int
    records: int
    first_ms: int
    last_ms: int
    sealed: bool
    compacted: bool = False  # rewritten in key order into ``k:<id>``
    db: Any = None
    filter: BloomFilter | None = None

    @property
    def name(self) -> bytes:
        return self.compacted_name if self.compacted else self.inserted_name

    @property
    def inserted_name(self) -> bytes:
        """The database checkpoints wrote (until a compaction takes its place)."""
        return b"s:%08d" % self.id

    @property
    def compacted_name(self) -> bytes:
        return b"k:%08d" % self.id

    def meta_key(self) -> bytes:
        return b"slice:%08d" % self.id

    def meta_value(self, compacted: bool | None = None) -> bytes:
        if compacted is None:
            compacted = self.compacted
        state = _COMPACTED if compacted else _SEALED if self.sealed else _OPEN
        return _SLICE_META.pack(self.records, self.first_ms, self.last_ms, state)


def _drop_if_present(txn: lmdb.Transaction, env: lmdb.Environment, name: bytes) -> None:
    """Deletes the named database in ``txn`` if it exists."""
    with contextlib.suppress(lmdb.NotFoundError):
        txn.drop(env.open_db(name, txn=txn, create=False), delete=True)


class LmdbTier:
    """The LMDB environment of one data directory."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int,
        readonly: bool,
        sync: bool,
        slice_records: int = StoreConfig.slice_records,
        slice_seconds: float = 86400.0,
        slice_error_rate: float = StoreConfig.slice_error_rate,
        filters: str | os.PathLike[str] | None = None,
        load_filters: bool = True,
    ) -> None:
        self.path = Path(path)
        # False: the slices' filters are neither opened nor rebuilt (``info.filter`` stays
        # None, so no lookup works): for dedupcore.check, which verifies their files itself.
        self._load_filters = load_filters
        self.readonly = readonly
        self.slice_records = slice_records
        self.slice_seconds = slice_seconds
        self.filters = SliceFilters(
            Path(filters) if filters is not None else self.path.parent / "slices",
            slice_error_rate,
            readonly=readonly,
        )
        self._slices: list[SliceInfo] = []  # oldest first
        self._env = Environment(
            self.path, map_size=map_size, readonly=readonly, sync=sync, max_dbs=_MAX_DBS
        )
        try:
            self._open_handles(create=not readonly)
        except lmdb.Error as exc:
            self._env.close()
            raise CorruptFileError(f"{self.path}: damaged LMDB environment: {exc}") from exc
        if not readonly:
            # Readers that died without closing their transaction pin old pages.
            self.env.reader_check()
            with self._env.txn(write=True) as txn:
                fmt = txn.get(b"format", db=self.meta)
                if fmt is None:
                    txn.put(b"format", FORMAT, db=self.meta)
                    fmt = FORMAT
        else:
            with self._env.txn() as txn:
                fmt = txn.get(b"format", db=self.meta) or FORMAT
        self.format = bytes(fmt)
        if self.format not in _KNOWN_FORMATS:
            self._env.close()
            raise UnsupportedFormatError(
                f"{self.path}: record format {self.format!r} is newer than this version of "
                f"dedupcore knows ({FORMAT!r}); open it with the version that wrote it"
            )
        try:
            self._load_slices()
        except BaseException:
            self._env.close()
            raise

    def _load_slices(self) -> None:
        entries: list[SliceInfo] = []
        with self._env.txn() as txn:
            cur = txn.cursor(db=self.meta)
            if cur.set_range(b"slice:"):
                for key, value in cur:
                    key = bytes(key)
                    if not key.startswith(b"slice:"):
                        break
                    try:
                        records, first, last, state = _SLICE_META.unpack(bytes(value))
                        sid = int(key[6:])
                        if state not in (_OPEN, _SEALED, _COMPACTED):
                            raise ValueError(state)
                    except (struct.error, ValueError):
                        raise CorruptFileError(
                            f"{self.path}: damaged slice entry {key!r}"
                        ) from None
                    entries.append(
                        SliceInfo(sid, records, first, last, state != _OPEN, state == _COMPACTED)
                    )
        for info in entries:
            try:
                info.db = self._env.open_db(info.name, create=False)
            except lmdb.NotFoundError:
                raise CorruptFileError(
                    f"{self.path}: slice {info.id} is listed but its database is missing"
                ) from None
            if self._load_filters:
                info.filter = self._load_filter(info)
        if not self.readonly:
            # A crash between a compaction taking a slice's place and the drop of
            # the tree it replaced leaves that tree: it goes now (one transaction,
            # and none at all in the usual case: a durable commit per slice would
            # cost an open one fsync per slice).
            with self._env.txn() as txn:  # named databases are keys of the main one
                left = [
                    info.inserted_name
                    for info in entries
                    if info.compacted and txn.get(info.inserted_name) is not None
                ]
            if left:
                self._drop_dbs(left)
        self._slices = entries

    def slice_infos(self) -> list[SliceInfo]:
        """The slices as listed at open (or since), oldest first."""
        return list(self._slices)

    def _load_filter(self, info: SliceInfo) -> BloomFilter:
        """A slice's filter: its file, the open one's saved at the last clean close if it
        covers the slice as it is, or built from the slice's keys."""
        digests = self._slice_digests(info)
        if info.sealed:
            return self.filters.load_sealed(info.id, info.records, digests)
        return self.filters.load_open(info.id, self._covers(info), digests, self.slice_target())

    def _covers(self, info: SliceInfo) -> str:
        """What the open slice's filter covers as it stands now: the slice at this
        checkpoint position and record count. Checkpoints, the only writers of the open
        slice besides a slice drop's moved records, change the position; a drop's moves
        change the count (an open slice only gains keys)."""
        with self._env.txn() as txn:
            entries = int(txn.stat(info.db)["entries"])
        return f"{self.checkpoint_lsn()}-{entries}"

    def save_open_filter(self) -> None:
        """Saves the open slice's filter (at a clean close: the next open need not read
        the slice's keys)."""
        if self.readonly or not self._slices or self._slices[-1].sealed:
            return
        info = self._slices[-1]
        assert info.filter is not None
        self.filters.save_open(info.id, self._covers(info), info.filter)

    def _slice_digests(self, info: SliceInfo) -> Iterator[bytes]:
        """The digests of one slice in key order, in batches of up to 100,000
        concatenated 16-byte digests (walked in native code: Environment.keys)."""
        with self._env.txn(buffers=False) as txn:
            yield from self._env.keys(txn, info.name, info.db, 100_000)

    def close(self) -> None:
        """Closes the environment."""
        self._env.close()

    @property
    def native_probes(self) -> int:
        """Digests looked up in a slice by the walk in native code."""
        return self._env.native_probes

    @property
    def lmdb_probes(self) -> int:
        """Digests looked up in a slice by LMDB itself (where the walk could not)."""
        return self._env.lmdb_probes

    @property
    def native_keys(self) -> int:
        """Keys of whole slices (and of the in-flight index) walked in native code."""
        return self._env.native_keys

    @property
    def env(self) -> lmdb.Environment:
        """The LMDB environment (a new one after :meth:`release_pages`)."""
        return self._env.lmdb

    def _open_handles(self, *, create: bool) -> None:
        """The handles of the in-flight index, the metadata and every slice listed
        (at open, none yet), from the environment as it is now. Called at open and
        inside :meth:`Environment.alone`, so without the gate."""
        env = self._env.lmdb
        self.inflight, self.meta = open_dbs(env, [b"inflight", b"meta"], create=create)
        handles = open_dbs(env, [info.name for info in self._slices], create=False)
        for info, db in zip(self._slices, handles, strict=True):
            info.db = db

    def release_pages(self) -> None:
        """Gives back the memory LMDB keeps of the pages its write transactions
        changed: closes the environment and opens it again, then returns the
        free heap to the system (docs/warm-tier.md, "Memory after a checkpoint").

        LMDB keeps every page a write transaction copied for reuse by later ones,
        without a bound, until the environment closes; a checkpoint that inserts
        random keys copies nearly every leaf page of its slice and of the
        in-flight index, so the process would hold as many pages as the largest
        checkpoint changed. No transaction is open meanwhile (as for a map
        resize); the databases are opened again by name. A failure to open
        again raises, and the tier is then unusable (as after a failed write).
        """
        if self.readonly:
            return
        with self._env.alone():
            try:
                self._env.reopen()
                self._open_handles(create=False)
            except lmdb.Error as exc:
                raise DedupError(
                    f"{self.path}: the LMDB environment could not be opened again after "
                    f"giving its pages back ({exc})"
                ) from exc
        trim_heap()

    # -- reads ---------------------------------------------------------------

    def read_many(self, joined: bytes) -> _engine.PackedRecords:
        """The newest record (digest and stored bytes) of each of concatenated digests
        that a slice holds; absent digests have none.

        Slices are probed newest first, each only for the digests its filter
        may hold and that no newer slice had; one read transaction, no Python
        work per digest (docs/warm-tier.md, "Lookups").
        """
        return self._read(list(reversed(self._slices)), joined)

    def _read(self, slices: list[SliceInfo], joined: bytes) -> _engine.PackedRecords:
        """The first record of each digest found in ``slices``, in that order."""
        found: list[_engine.PackedRecords] = []
        if not joined or not slices:
            return _engine.join_records(found)
        # In key order: neighbouring reads share B-tree pages (about 40 % less
        # per read than batch order on a slice of millions of records).
        todo = _engine.sort_digests(joined)
        with self._env.txn(buffers=False) as txn:
            for n, info in enumerate(slices, 1):
                assert info.filter is not None
                # The slice filter's hash is each digest's second half, read in place.
                maybe = _core.probe_digests((info.filter,), todo, info.filter.seed, 1)
                ask = _engine.select_digests(todo, maybe)
                if not ask:
                    continue
                # bytes, not buffers: the transaction is opened with buffers=False.
                got = self._env.read_sorted(txn, info.name, info.db, ask)
                if not got.n:
                    continue
                found.append(got)
                if n == len(slices):
                    break
                todo = _engine.drop_found(todo, got)
                if not todo:
                    break
        return _engine.join_records(found)

    def checkpoint_lsn(self) -> int:
        """The log position LMDB is complete up to."""
        with self._env.txn() as txn:
            raw = txn.get(b"checkpoint_lsn", db=self.meta)
        return _U64.unpack(raw)[0] if raw else 0

    def log_head_kept(self) -> bool:
        """Whether the store keeps the write-ahead log's head file (so a missing one is
        damage, not a directory from before it was kept)."""
        with self._env.txn() as txn:
            return txn.get(b"log_head", db=self.meta) is not None

    def keep_log_head(self) -> None:
        """Records durably that the store keeps the log's head file (once)."""
        self._write(lambda txn: txn.put(b"log_head", b"1", db=self.meta))

    def inflight_digests(self) -> bytes:
        """Digests of PROCESSING records, concatenated in key order (walked in native
        code: Environment.keys; an open after a crash reads them all)."""
        with self._env.txn(buffers=False) as txn:
            return b"".join(self._env.keys(txn, b"inflight", self.inflight, 100_000))

    def iter_records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (digest, record bytes) of every slice, newest slice first (a digest
        written in several slices comes once per slice)."""
        for info in list(reversed(self._slices)):
            yield from self.scan_slice(info.id)

    @property
    def newest_slice_id(self) -> int:
        """The id of the newest slice (0 before the first): checkpoints write into it or
        into a newer one, never into an older one."""
        return self._slices[-1].id if self._slices else 0

    def digests_since(self, slice_id: int) -> Iterator[bytes]:
        """The digests of every record in the slices ``slice_id`` and newer, in batches of
        concatenated 16-byte digests."""
        for info in [i for i in self._slices if i.id >= slice_id]:
            yield from self._slice_digests(info)

    def scan_slice(self, slice_id: int) -> Iterator[tuple[bytes, bytes]]:
        """Every (digest, record bytes) of one slice, in digest order."""
        info = self._slice(slice_id)
        with self._env.txn() as txn:
            for key, value in txn.cursor(db=info.db):
                yield bytes(key), bytes(value)

    def newer_holds(self, slice_id: int, digests: list[bytes]) -> list[bool]:
        """Whether a slice newer than ``slice_id`` holds each digest."""
        newer = [s for s in reversed(self._slices) if s.id > slice_id]
        held = {d for d, _ in self._read(newer, b"".join(digests))}
        return [d in held for d in digests]

    def record_count(self) -> int:
        """Number of records in every slice (a key in two slices counts twice)."""
        with self._env.txn() as txn:
            return sum(int(txn.stat(s.db)["entries"]) for s in self._slices)

    def disk_bytes(self) -> int:
        """Bytes of the environment's data file in use (pages used, free pages included)."""
        return self._env.used_bytes()

    def slices(self) -> list[dict[str, Any]]:
        """Per slice, oldest first: id, records, first and last write (unix s), sealed."""
        return [
            {
                "id": s.id,
                "records": s.records,
                "first": s.first_ms / 1000,
                "last": s.last_ms / 1000,
                "sealed": s.sealed,
                "compacted": s.compacted,
                "filter_bytes": s.filter.nbytes if s.filter is not None else 0,
            }
            for s in self._slices
        ]

    def droppable(self, now: float, window: float) -> list[int]:
        """Ids of sealed slices whose newest record is more than ``window`` seconds old."""
        return [s.id for s in self._slices if s.sealed and s.last_ms / 1000 + window <= now]

    def records_dropping_by(self, end: float, window: float) -> int:
        """Records held by the slices whose newest record passes ``window`` before ``end``
        (unix s): what the drops still to come by then can demote at most."""
        return sum(s.records for s in self._slices if s.last_ms / 1000 + window < end)

    def _slice(self, slice_id: int) -> SliceInfo:
        for s in self._slices:
            if s.id == slice_id:
                return s
        raise KeyError(f"no slice {slice_id}")

    # -- namespaces ----------------------------------------------------------

    def namespaces(self) -> dict[bytes, int]:
        """Namespace name -> id."""
        out = {}
        with self._env.txn() as txn:
            cur = txn.cursor(db=self.meta)
            if cur.set_range(b"ns:"):
                for key, value in cur:
                    if not bytes(key).startswith(b"ns:"):
                        break
                    out[bytes(key[3:])] = struct.unpack("<H", value)[0]
        return out

    def add_namespace(self, name: bytes, ns_id: int) -> None:
        """Records a namespace id durably (rare: once per namespace)."""
        self._write(lambda txn: txn.put(b"ns:" + name, struct.pack("<H", ns_id), db=self.meta))

    # -- writes --------------------------------------------------------------

    def _current(self, now_ms: int, incoming: int) -> SliceInfo:
        """The slice a checkpoint writes into: the open one, or a new one after sealing
        it when it is full or old enough."""
        cur = self._slices[-1] if self._slices and not self._slices[-1].sealed else None
        if cur is not None:
            full = cur.records and cur.records + incoming > self.slice_target()
            old = cur.records and now_ms - cur.first_ms >= self.slice_seconds * 1000
            if (full or old) and len(self._slices) < MAX_SLICES:
                self.seal(cur.id)
                cur = None
        if cur is None:
            sid = self._slices[-1].id + 1 if self._slices else 1
            cur = SliceInfo(sid, 0, now_ms, now_ms, False)
            # The database before its entry: a crash in between leaves an empty,
            # unlisted database that the next slice of the same id reuses.
            cur.db = self._env.open_db(cur.name, create=True)
            new = cur

            def create(txn: lmdb.Transaction) -> None:
                txn.put(new.meta_key(), new.meta_value(), db=self.meta)

            self._write(create)
            cur.filter = self.filters.new(self.slice_target())
            self._slices.append(cur)
        return cur

    def slice_target(self) -> int:
        """Records after which the open slice is sealed: ``slice_records``, or
        SLICE_SHARE of every record the slices hold when that is more."""
        held = sum(s.records for s in self._slices)
        return max(self.slice_records, int(held * SLICE_SHARE))

    def seal_idle(self, now: float, window: float) -> None:
        """Seals the open slice if its newest record is past ``window`` (so it can go)."""
        if self._slices and not self._slices[-1].sealed:
            cur = self._slices[-1]
            if cur.records and cur.last_ms / 1000 + window <= now:
                self.seal(cur.id)

    def seal(self, slice_id: int) -> None:
        """Ends writes to a slice: its filter, sized to what it holds, is written,
        fsynced and renamed into place before the slice is marked sealed."""
        info = self._slice(slice_id)
        if info.sealed:
            return
        with self._env.txn() as txn:
            info.records = int(txn.stat(info.db)["entries"])
        sealed_filter = self.filters.seal(info.id, info.records, self._slice_digests(info))
        info.sealed = True
        self._write(lambda txn: txn.put(info.meta_key(), info.meta_value(), db=self.meta))
        info.filter = sealed_filter

    def checkpoint(
        self,
        items: SizedIterable[tuple[bytes, bytes]],
        inflight: SizedIterable[bytes],
        settled: SizedIterable[bytes],
        lsn: int,
        *,
        now: float,
        newest: float = 0.0,
        fmt: bytes | None = None,
        digests: bytes | None = None,
    ) -> None:
        """Writes records into the newest slice and records ``lsn``, in one durable
        transaction. ``items`` are (digest, value) sorted by digest; ``inflight``
        digests are PROCESSING, ``settled`` ones are not (their in-flight entry
        goes). ``newest`` is the latest change time among them: a slice goes
        when its latest one is past the window. ``fmt`` also sets the format.
        ``digests`` are the items' digests concatenated, when the caller has them.

        The three collections are iterated once per attempt (a transaction
        retried after growing the map iterates them again), never copied into
        lists: a checkpoint of a million records builds no million tuples.
        """
        now_ms = int(now * 1000)
        newest_ms = int(newest * 1000)
        cur = self._current(now_ms, len(items))
        assert cur.filter is not None
        # The filter first: a filter that holds a key LMDB lacks costs a read;
        # the reverse would hide a record.
        if digests is None:
            digests = b"".join(d for d, _ in items)
        cur.filter.add_many(second_halves(digests))

        def apply(txn: lmdb.Transaction) -> None:
            with txn.cursor(db=cur.db) as c:
                c.putmulti(iter(items))
            if inflight:
                with txn.cursor(db=self.inflight) as c:
                    c.putmulti((d, b"") for d in inflight)
            if settled and txn.stat(self.inflight)["entries"]:
                for d in settled:
                    txn.delete(d, db=self.inflight)
            txn.put(b"checkpoint_lsn", _U64.pack(lsn), db=self.meta)
            if fmt is not None:
                txn.put(b"format", fmt, db=self.meta)
            cur.records = int(txn.stat(cur.db)["entries"])
            cur.last_ms = max(cur.last_ms, newest_ms)
            txn.put(cur.meta_key(), cur.meta_value(), db=self.meta)

        self._write(apply)

    def drop_slice(self, slice_id: int, keep: list[tuple[bytes, bytes]], *, now: float) -> None:
        """Drops a sealed slice whole; ``keep`` (digest, value) records move into the
        newest slice in the same transaction (records still in flight)."""
        info = self._slice(slice_id)
        if not info.sealed:
            raise ValueError(f"slice {slice_id} is still taking writes")
        cur = self._current(int(now * 1000), len(keep)) if keep else None
        if cur is not None:
            assert cur.filter is not None
            cur.filter.add_many(second_halves(b"".join(d for d, _ in keep)))

        def apply(txn: lmdb.Transaction) -> None:
            if cur is not None:
                with txn.cursor(db=cur.db) as c:
                    c.putmulti(sorted(keep))
                cur.records = int(txn.stat(cur.db)["entries"])
                txn.put(cur.meta_key(), cur.meta_value(), db=self.meta)
            txn.drop(info.db, delete=True)
            if not info.compacted:  # a compaction's copy in progress goes with it
                _drop_if_present(txn, self.env, info.compacted_name)
            txn.delete(info.meta_key(), db=self.meta)

        self._write(apply)
        self._slices.remove(info)
        self.filters.remove(info.id)

    # -- compaction --------------------------------------------------------------

    def compaction_pending(self) -> bool:
        """Whether a sealed slice is still in the order its random inserts left it."""
        return any(s.sealed and not s.compacted for s in self._slices)

    def compact_step(self, budget: int, swap: AbstractContextManager[object]) -> int:
        """Copies up to ``budget`` records of the oldest sealed, not yet compacted
        slice, in key order, into its ``k:<id>`` database (appends: full pages), in
        one durable transaction; returns the records copied (0 also when the step
        only completed a copy: ``compaction_pending()`` says whether more is left).

        The copy resumes after the last key its database holds, so a step that a
        crash or a full map cut short is simply done again. The caller keeps
        checkpoints and slice drops out meanwhile. Once the copy holds every
        record, one transaction records the slice as compacted (and the format
        as 3); then, holding ``swap`` (the lock every reader of the slices takes),
        the slice reads from the copy; the old tree is dropped after that, and an
        open drops it if a crash came first.
        """
        info = next((s for s in self._slices if s.sealed and not s.compacted), None)
        if info is None:
            return 0
        dst = self._env.open_db(info.compacted_name, create=True)
        copied = [0]
        complete = [False]

        def copy(txn: lmdb.Transaction) -> None:
            out = txn.cursor(db=dst)
            start = bytes(out.key()) if out.last() else None
            src = txn.cursor(db=info.db)
            more = src.set_range(start) if start is not None else src.first()
            if more and start is not None and bytes(src.key()) == start:
                more = src.next()
            copied[0] = 0
            if more:
                copied[0] = out.putmulti(itertools.islice(src.iternext(), budget), append=True)[0]
            if copied[0] < budget:
                # Every record is in the copy: it takes the slice's place.
                want, have = txn.stat(info.db)["entries"], txn.stat(dst)["entries"]
                if want != have:
                    raise CorruptFileError(
                        f"{self.path}: compacting slice {info.id}: copied {have} of {want} records"
                    )
                txn.put(info.meta_key(), info.meta_value(compacted=True), db=self.meta)
                txn.put(b"format", FORMAT, db=self.meta)
                complete[0] = True

        self._write(copy)
        if complete[0]:
            with swap:
                old, info.db, info.compacted = info.db, dst, True
                self.format = FORMAT

            def drop(txn: lmdb.Transaction) -> None:
                txn.drop(old, delete=True)

            self._write(drop)
        return copied[0]

    # -- the older format ------------------------------------------------------

    def v1_records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (digest, record bytes) of a format-1 environment's single tree."""
        with self._env.txn() as txn:
            db = self.env.open_db(b"records", txn=txn, create=False)
            for key, value in txn.cursor(db=db):
                yield bytes(key), bytes(value)

    def drop_v1_trees(self) -> None:
        """Deletes the format-1 record tree and its expiry index (after a conversion)."""

        self._drop_dbs([b"records", b"expiry"])

    def _drop_dbs(self, names: list[bytes]) -> None:
        """Deletes the named databases that exist, in one transaction."""

        def apply(txn: lmdb.Transaction) -> None:
            for name in names:
                _drop_if_present(txn, self.env, name)

        self._write(apply)

    def _write(self, apply: Callable[[lmdb.Transaction], object]) -> None:
        self._env.write(apply)
