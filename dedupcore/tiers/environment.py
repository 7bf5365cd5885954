"""Environment: the LMDB environment of a data directory, shared by threads
(docs/warm-tier.md, "The environment").

It owns what every use of LMDB in the warm tier goes through, apart from what
the tier keeps in it (:class:`~dedupcore.tiers.lmdb.LmdbTier`):

- The open: a missing or cut-off ``data.mdb`` is refused, never replaced by
  an empty environment, and a file shorter than its pages reach is refused
  before a page is read (LMDB maps the file: a page past its end is a SIGBUS).
- A gate: a map resize and a reopen may not happen under an open transaction,
  and py-lmdb refuses any call on an environment while another thread resizes
  its map. Every transaction and call passes :meth:`Environment.using`;
  :meth:`Environment.alone` waits for those under way and holds new ones.
- Writes: :meth:`Environment.write` grows the map when it is full and tries
  again, then extends the file over the pages LMDB counts but never wrote.
- A reopen (:meth:`Environment.reopen`), which gives back the pages LMDB keeps
  of its write transactions (docs/warm-tier.md, "Memory after a checkpoint").
- Batch lookups in native code (:meth:`Environment.read_sorted`): the B-tree of
  a database walked in a read-only mapping of ``data.mdb`` without the GIL
  (``_engine.PageReader``, ext/dc_mdb.h), LMDB's own ``getmulti`` wherever that
  walk cannot answer (docs/warm-tier.md, "Lookups in native code").
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, cast

import lmdb

import dedupcore._engine as _engine
from dedupcore._files import DIR_MODE, resize_durably
from dedupcore.errors import CorruptFileError, DedupError

__all__ = ["Environment"]

_MIN_DATA_BYTES = 2 * 4096  # the two meta pages of any LMDB environment


class _Use:
    """:meth:`Environment.using` as a plain context manager: every lookup takes one.
    An empty read transaction costs 4.7-5.5 µs so, against 8.7-10.6 µs through
    two generator-based ones that also notified the gate at every end (a one-key
    claim that reads LMDB pays it once)."""

    __slots__ = ("_env",)

    def __init__(self, env: Environment) -> None:
        self._env = env

    def __enter__(self) -> None:
        self._env._enter()

    def __exit__(self, *exc: object) -> None:
        self._env._leave()


class _Txn:
    """:meth:`Environment.txn`: a use of the environment around an LMDB transaction."""

    __slots__ = ("_env", "_kwargs", "_txn")

    def __init__(self, env: Environment, kwargs: dict[str, Any]) -> None:
        self._env = env
        self._kwargs = kwargs

    def __enter__(self) -> lmdb.Transaction:
        env = self._env
        env._enter()
        try:
            self._txn = env.lmdb.begin(**self._kwargs)
        except BaseException:
            env._leave()
            raise
        return self._txn

    def __exit__(self, *exc: Any) -> None:
        try:
            self._txn.__exit__(*exc)  # commits, or aborts when the block raised
        finally:
            self._env._leave()


def open_dbs(env: lmdb.Environment, names: list[bytes], *, create: bool) -> list[Any]:
    """Handles of the named databases of ``env``. Where the environment is
    writable, they are opened in one write transaction begun here, which waits
    for LMDB's writer without the GIL. py-lmdb's ``open_db`` without a
    transaction begins a write transaction of its own while holding the GIL, so
    while another thread's write transaction ran, that thread could never take
    the GIL back to end it, and the whole process stopped (docs/warm-tier.md,
    "The environment"). A read-only environment takes no writer lock, and a
    handle opened in one of py-lmdb's read transactions ends with it: py-lmdb
    opens those itself."""
    if env.flags()["readonly"]:
        return [env.open_db(name, create=create) for name in names]
    with env.begin(write=True) as txn:
        return [env.open_db(name, txn=txn, create=create) for name in names]


class Environment:
    """The LMDB environment of one directory, its gate, and its native lookups."""

    def __init__(
        self, path: Path, *, map_size: int, readonly: bool, sync: bool, max_dbs: int
    ) -> None:
        self.path = path
        self.readonly = readonly
        self._gate = threading.Condition()
        self._open_txns = 0
        self._alone_now = False
        #: Keys a walk over a database's pages gave (:meth:`keys`).
        self.native_keys = 0
        #: Lookups that the native walk answered, and those it left to LMDB.
        self.native_probes = 0
        self.lmdb_probes = 0
        data = path / "data.mdb"
        if not readonly:
            # Records hold results: only the owner may list or read them.
            path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        elif not data.exists():
            raise CorruptFileError(f"{path}: no LMDB environment to open read-only")
        if data.exists() and data.stat().st_size < _MIN_DATA_BYTES:
            # LMDB would silently start a new, empty environment in a cut-off file.
            raise CorruptFileError(
                f"{data}: truncated to {data.stat().st_size} bytes; refusing to replace it "
                "with an empty store"
            )
        self._options: dict[str, Any] = {
            "max_dbs": max_dbs,
            "readonly": readonly,
            "sync": sync,
            "metasync": sync,
            "lock": True,
            "mode": DIR_MODE,  # data.mdb and lock.mdb get 0o600 (LMDB drops the execute bits)
            "readahead": False,
            "meminit": False,
        }
        try:
            self.lmdb = lmdb.open(str(path), map_size=map_size, **self._options)
        except lmdb.Error as exc:
            raise CorruptFileError(
                f"{path}: cannot open the LMDB environment ({exc}); it is refused "
                "rather than replaced by an empty one"
            ) from exc
        # Check before reading any page: LMDB maps the file, and a page past its
        # end is a SIGBUS, not an error.
        used = self.used_bytes()
        if data.stat().st_size < used:
            self.lmdb.close()
            raise CorruptFileError(
                f"{data}: truncated: {data.stat().st_size} bytes, but its pages reach {used}"
            )
        self._pages: _engine.PageReader | None = None
        self._map_pages()

    def close(self) -> None:
        self._pages = None
        self.lmdb.close()

    # -- the gate ------------------------------------------------------------------

    def using(self) -> AbstractContextManager[None]:
        """A use of the environment that a map resize or a reopen waits for (and
        that waits for them): a transaction, and every call on the environment
        itself. py-lmdb refuses any call on an environment while another thread
        resizes its map (EINVAL), and a resize may not happen under an open
        transaction."""
        return _Use(self)

    def _enter(self) -> None:
        with self._gate:
            while self._alone_now:
                self._gate.wait()
            self._open_txns += 1

    def _leave(self) -> None:
        with self._gate:
            self._open_txns -= 1
            if not self._open_txns and self._alone_now:
                self._gate.notify_all()  # the use alone() waits for ended

    @contextmanager
    def alone(self) -> Iterator[None]:
        """No other use of the environment (:meth:`using`), and no other
        :meth:`alone`, until this ends: the ones under way end first, new ones
        wait."""
        with self._gate:
            while self._alone_now:
                self._gate.wait()
            self._alone_now = True
            try:
                while self._open_txns:
                    self._gate.wait()
                yield
            finally:
                self._alone_now = False
                self._gate.notify_all()

    def txn(self, **kwargs: Any) -> AbstractContextManager[lmdb.Transaction]:
        """A transaction that a map resize waits for (and that waits for a resize),
        committed at the end of the ``with`` block, or aborted if it raises. A
        database handle is read inside it (``txn.cursor(db=tier.meta)``), not
        passed to it: :meth:`reopen` makes the handles anew, and a handle read
        before the transaction began may be of the environment it closed."""
        return _Txn(self, kwargs)

    def open_db(self, name: bytes, *, create: bool) -> Any:
        """A named database of the environment (see :meth:`using`), opened in a
        transaction of its own (:func:`open_dbs`)."""
        with self.using():
            return open_dbs(self.lmdb, [name], create=create)[0]

    def used_bytes(self) -> int:
        """Bytes of data.mdb that LMDB's pages reach (see :meth:`using`)."""
        with self.using():
            return int((self.lmdb.info()["last_pgno"] + 1) * self.lmdb.stat()["psize"])

    # -- writes --------------------------------------------------------------------

    def write(self, apply: Callable[[lmdb.Transaction], object]) -> None:
        """Runs ``apply`` in a write transaction and commits it; a full map is doubled
        and the transaction made again."""
        if self.readonly:
            raise DedupError("the store is open read-only")
        while True:
            try:
                with self.txn(write=True) as txn:
                    apply(txn)
                self._cover_last_page()
                return
            except lmdb.MapFullError:
                self._grow()

    def _grow(self) -> None:
        with self.alone():
            # The map is only address space; doubling it costs nothing on disk.
            self.lmdb.set_mapsize(self.lmdb.info()["map_size"] * 2)

    def _cover_last_page(self) -> None:
        """Extends data.mdb over the pages LMDB counts but never wrote.

        LMDB's last page number also counts pages a transaction allocated and
        freed again (never written), which can leave the file shorter than
        that number says; the open refuses such a file as truncated. The file
        is extended over them (zero pages nothing refers to) and synced.
        """
        data = self.path / "data.mdb"
        used = self.used_bytes()
        if data.stat().st_size >= used:
            return
        resize_durably(data, used)

    def reopen(self) -> None:
        """Closes the environment and opens it again with the same map size (inside
        :meth:`alone`): LMDB gives back the pages it kept of its write transactions
        only when it closes. Every database handle must then be opened again; an
        ``lmdb.Error`` leaves the environment unusable."""
        map_size = self.lmdb.info()["map_size"]
        self.lmdb.close()
        self.lmdb = lmdb.open(str(self.path), map_size=map_size, **self._options)
        self._map_pages()

    # -- lookups in native code ----------------------------------------------------

    def _map_pages(self) -> None:
        """Maps data.mdb read-only for :meth:`read_sorted` (again, after the file
        grew). Left unmapped on a 32-bit host, whose page format the walk does not
        read, or when the mapping fails: LMDB then answers every lookup."""
        self._pages = None
        if sys.maxsize <= 2**32:
            return
        try:
            fd = os.open(self.path / "data.mdb", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._pages = _engine.PageReader(mapping, int(self.lmdb.stat()["psize"]))
        except (OSError, ValueError):
            self._pages = None

    def keys(self, txn: lmdb.Transaction, name: bytes, db: Any, batch: int) -> Iterator[bytes]:
        """Every key of the named database ``db`` in key order, concatenated, in
        batches of up to ``batch`` keys, read in ``txn`` (opened with
        ``buffers=False``; it pins the snapshot the walk reads). The keys are the
        warm tier's 16-byte digests.

        The pages are walked in native code without the GIL (sealing a slice of
        millions of records holds the GIL for none of it). A page past the
        mapping (the file grew since it was mapped) maps the file again and
        walks again, skipping the keys already given; where the walk cannot go
        on still (anything it does not read), LMDB's cursor gives the rest, from
        after the last key given."""
        last = b""
        for _ in range(2):
            pages = self._pages
            record = txn.get(name) if pages is not None else None
            if pages is None or record is None:
                break
            walk = pages.walk(bytes(record), 16)
            stopped = walk if isinstance(walk, int) else None  # why the walk stopped
            while isinstance(walk, _engine.KeyWalk):
                got = walk.next(batch)
                if isinstance(got, int):
                    stopped = got
                    break
                if not got:
                    return
                if last:  # a walk again: the keys up to the last one given were given
                    got = _after(got, last)
                    if not got:
                        continue
                self.native_keys += len(got) // 16
                last = got[-16:]
                yield got
            if stopped != _engine.PAGES_BEYOND:
                break
            self._map_pages()
        cursor = txn.cursor(db=db)
        more = cursor.set_range(last) if last else cursor.first()
        if more and last and cursor.key() == last:
            more = cursor.next()
        keys: list[bytes] = []
        while more:
            keys.append(bytes(cursor.key()))
            if len(keys) >= batch:
                yield b"".join(keys)
                keys.clear()
            more = cursor.next()
        if keys:
            yield b"".join(keys)

    def read_sorted(
        self, txn: lmdb.Transaction, name: bytes, db: Any, digests: bytes
    ) -> _engine.PackedRecords:
        """The records (digest and value) of the concatenated, sorted ``digests``
        that the named database ``db`` holds, in their order, read in ``txn``
        (opened with ``buffers=False``; it pins the snapshot the walk reads).

        The walk in native code reads the database's record in the main database
        (its root page as of this snapshot) and the pages under it; LMDB's
        ``getmulti`` answers where the walk cannot (a page past the mapping that
        a remap does not bring in, or anything the walk does not read)."""
        for _ in range(2):
            pages = self._pages
            if pages is None:
                break
            record = txn.get(name)
            if record is None:
                break
            got = pages.get_many(bytes(record), digests)
            if isinstance(got, _engine.PackedRecords):
                self.native_probes += len(digests) // 16
                return got
            if got != _engine.PAGES_BEYOND:
                break
            self._map_pages()  # the file grew since it was mapped
        self.lmdb_probes += len(digests) // 16
        # bytes, not buffers: the transaction is opened with buffers=False.
        pairs = cast(
            "list[tuple[bytes, bytes]]",
            txn.cursor(db=db).getmulti(_engine.split_digests(digests)),
        )
        return _engine.pack_records(pairs)


def _after(keys: bytes, last: bytes) -> bytes:
    """The 16-byte keys of ``keys`` (concatenated, in order) that come after ``last``."""
    at = bisect.bisect_right(range(len(keys) // 16), last, key=lambda i: keys[16 * i : 16 * i + 16])
    return keys[16 * at :]
