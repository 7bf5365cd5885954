"""LmdbTier: the warm, exact records of the embedded authority, in LMDB (py-lmdb).

The tier is written only in large, sorted, durable batches (checkpoints) from
the store's recent records; acknowledgements never wait for it (a durable
LMDB commit of random keys costs about one page write per key; see
docs/architecture.md, "Performance"). Sub-databases:

- ``records``: 16-byte digest -> the record in the stored format of
  docs/engine.md (a handful of bytes and a checksum; see dedupcore.record).
- ``expiry``: 8-byte big-endian expiry time in ms + digest -> b"" for every
  PROCESSED record and tombstone, so retention is a range scan, not a full one.
- ``inflight``: digest -> b"" for PROCESSING records, loaded at open.
- ``meta``: ``checkpoint_lsn`` (the write-ahead log position LMDB holds
  everything up to), ``format`` (b"2"; b"1" is the older record format,
  migrated at open by the store), and namespace names <-> 16-bit ids.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from dedupcore.errors import CorruptFileError, DedupError, UnsupportedFormatError

__all__ = ["FORMAT", "LmdbTier"]

FORMAT = b"2"
_KNOWN_FORMATS = (b"1", FORMAT)
_U64 = struct.Struct(">Q")
_MIN_DATA_BYTES = 2 * 4096  # the two meta pages of any LMDB environment


class LmdbTier:
    """The LMDB environment of one data directory."""

    def __init__(
        self, path: str | os.PathLike[str], *, map_size: int, readonly: bool, sync: bool
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        # Growing the map invalidates every open transaction (LMDB forbids it
        # while any is open), so transactions pass a gate that a resize closes.
        self._gate = threading.Condition()
        self._open_txns = 0
        self._resizing = False
        data = self.path / "data.mdb"
        if not readonly:
            # Records hold results: only the owner may list or read them.
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not data.exists():
            raise CorruptFileError(f"{self.path}: no LMDB environment to open read-only")
        if data.exists() and data.stat().st_size < _MIN_DATA_BYTES:
            # LMDB would silently start a new, empty environment in a cut-off file.
            raise CorruptFileError(
                f"{data}: truncated to {data.stat().st_size} bytes; refusing to replace it "
                "with an empty store"
            )
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=8,
                readonly=readonly,
                sync=sync,
                metasync=sync,
                lock=True,
                mode=0o700,  # data.mdb and lock.mdb get 0o600 (LMDB drops the execute bits)
                readahead=False,
                meminit=False,
            )
        except lmdb.Error as exc:
            raise CorruptFileError(
                f"{self.path}: cannot open the LMDB environment ({exc}); it is refused "
                "rather than replaced by an empty one"
            ) from exc
        # Check before reading any page: LMDB maps the file, and a page past its
        # end is a SIGBUS, not an error.
        used = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        if data.stat().st_size < used:
            self.env.close()
            raise CorruptFileError(
                f"{data}: truncated: {data.stat().st_size} bytes, but its pages reach {used}"
            )
        try:
            self.records = self.env.open_db(b"records", create=not readonly)
            self.expiry = self.env.open_db(b"expiry", create=not readonly)
            self.inflight = self.env.open_db(b"inflight", create=not readonly)
            self.meta = self.env.open_db(b"meta", create=not readonly)
        except lmdb.Error as exc:
            self.env.close()
            raise CorruptFileError(f"{self.path}: damaged LMDB environment: {exc}") from exc
        if not readonly:
            # Readers that died without closing their transaction pin old pages.
            self.env.reader_check()
            with self._txn(write=True) as txn:
                fmt = txn.get(b"format", db=self.meta)
                if fmt is None:
                    txn.put(b"format", FORMAT, db=self.meta)
                    fmt = FORMAT
        else:
            with self._txn(db=self.meta) as txn:
                fmt = txn.get(b"format") or FORMAT
        self.format = bytes(fmt)
        if self.format not in _KNOWN_FORMATS:
            self.env.close()
            raise UnsupportedFormatError(
                f"{self.path}: record format {self.format!r} is newer than this version of "
                f"dedupcore knows ({FORMAT!r}); open it with the version that wrote it"
            )

    def close(self) -> None:
        """Closes the environment."""
        self.env.close()

    @contextmanager
    def _txn(self, **kwargs: Any) -> Iterator[lmdb.Transaction]:
        """A transaction that a map resize waits for (and that waits for a resize)."""
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._open_txns += 1
        try:
            with self.env.begin(**kwargs) as txn:
                yield txn
        finally:
            with self._gate:
                self._open_txns -= 1
                if not self._open_txns:
                    self._gate.notify_all()

    def _grow(self) -> None:
        with self._gate:
            self._resizing = True
            try:
                while self._open_txns:
                    self._gate.wait()
                # The map is only address space; doubling it costs nothing on disk.
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            finally:
                self._resizing = False
                self._gate.notify_all()

    # -- reads ---------------------------------------------------------------

    def get_many(self, digests: Iterable[bytes]) -> list[bytes | None]:
        """Stored bytes of each digest's record (None where absent), in one read transaction."""
        with self._txn(db=self.records, buffers=False) as txn:
            get = txn.get
            return [get(d) for d in digests]  # type: ignore[misc]  # buffers=False: bytes

    def checkpoint_lsn(self) -> int:
        """The log position LMDB is complete up to."""
        with self._txn(db=self.meta) as txn:
            raw = txn.get(b"checkpoint_lsn")
        return _U64.unpack(raw)[0] if raw else 0

    def inflight_digests(self) -> list[bytes]:
        """Digests of PROCESSING records."""
        with self._txn(db=self.inflight) as txn:
            return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]

    def iter_records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (digest, record bytes), in digest order."""
        with self._txn(db=self.records) as txn:
            for key, value in txn.cursor():
                yield bytes(key), bytes(value)

    def expired(self, now_ms: int, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` (expiry key, digest) pairs whose expiry time is <= now_ms."""
        out: list[tuple[bytes, bytes]] = []
        with self._txn(db=self.expiry) as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                key = bytes(key)
                if _U64.unpack_from(key)[0] > now_ms or len(out) >= limit:
                    break
                out.append((key, key[8:]))
        return out

    def record_count(self) -> int:
        """Number of records."""
        with self._txn() as txn:
            return int(txn.stat(self.records)["entries"])

    def disk_bytes(self) -> int:
        """Bytes of the environment's data file in use (pages used)."""
        info = self.env.info()
        stat = self.env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])

    # -- namespaces ----------------------------------------------------------

    def namespaces(self) -> dict[bytes, int]:
        """Namespace name -> id."""
        out = {}
        with self._txn(db=self.meta) as txn:
            cur = txn.cursor()
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

    def checkpoint(
        self,
        items: list[tuple[bytes, bytes]],
        expiry_keys: list[bytes],
        inflight: list[bytes],
        settled: list[bytes],
        lsn: int,
        *,
        fmt: bytes | None = None,
    ) -> None:
        """Writes records and their index entries and records ``lsn``, in one durable
        transaction. ``items`` are (digest, value) sorted by digest; ``expiry_keys``
        sorted; ``inflight`` digests are PROCESSING, ``settled`` ones are not (any
        in-flight entry goes). ``fmt`` also sets the format (a migration)."""

        def apply(txn: lmdb.Transaction) -> None:
            with txn.cursor(db=self.records) as cur:
                cur.putmulti(items)
            with txn.cursor(db=self.expiry) as cur:
                cur.putmulti([(k, b"") for k in expiry_keys])
            if inflight:
                with txn.cursor(db=self.inflight) as cur:
                    cur.putmulti([(d, b"") for d in inflight])
            if settled and txn.stat(self.inflight)["entries"]:
                for d in settled:
                    txn.delete(d, db=self.inflight)
            txn.put(b"checkpoint_lsn", _U64.pack(lsn), db=self.meta)
            if fmt is not None:
                txn.put(b"format", fmt, db=self.meta)

        self._write(apply)

    def delete_expired(self, entries: list[tuple[bytes, bytes | None]]) -> None:
        """Deletes expiry entries and, where a digest is given, their records; one transaction.

        A record whose expiry entry is stale (the key was claimed again after
        a release) is passed with digest None: only the entry goes.
        """

        def apply(txn: lmdb.Transaction) -> None:
            for expiry_key, digest in entries:
                txn.delete(expiry_key, db=self.expiry)
                if digest is not None:
                    txn.delete(digest, db=self.records)

        self._write(apply)

    def _write(self, apply: Callable[[lmdb.Transaction], object]) -> None:
        if self.readonly:
            raise DedupError("the store is open read-only")
        while True:
            try:
                with self._txn(write=True) as txn:
                    apply(txn)
                return
            except lmdb.MapFullError:
                self._grow()
