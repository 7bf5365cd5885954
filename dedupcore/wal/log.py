"""The write-ahead log itself: group commit, appends, the single-writer rule.

:class:`WriteAheadLog` queues framed records under its lock and lets one
thread at a time do the I/O: a leader writes everything queued and syncs
once for all waiters (group commit), rotations, syncs and the head file's
updates run the same way, and a failed write or sync fails the log. The
files themselves are dedupcore/wal/segments.py's, the frames
dedupcore/wal/framing.py's; what is durable when, and what opening
recovers, is in the package's documentation (dedupcore/wal/__init__.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import dedupcore._core as _core
from dedupcore.errors import WalFailedError
from dedupcore.wal.framing import MAX_LSN, MAX_RECORD_BYTES, check_lsn, check_payloads, payload_list
from dedupcore.wal.segments import Segments

__all__ = ["DEFAULT_SEGMENT_BYTES", "MIN_SEGMENT_BYTES", "SYNC_MODES", "SyncMode", "WriteAheadLog"]

log = logging.getLogger("dedupcore.wal")

DEFAULT_SEGMENT_BYTES = 64 << 20
#: With ``sync="none"``, :meth:`WriteAheadLog.write` writes a queue of at most this many
#: bytes at once (a small write under the lock; larger ones wait for a commit, which
#: writes them outside it).
WRITE_THROUGH_BYTES = 16 << 10
MIN_SEGMENT_BYTES = 64
SYNC_MODES = ("fdatasync", "none")
SyncMode = Literal["fdatasync", "none"]
T = TypeVar("T")


class WriteAheadLog:
    """An append-only, checksummed, group-committed log of opaque records in a directory.

    Open it with :meth:`open`. Records get consecutive LSNs (log sequence
    numbers) starting at 1. ``append`` returns once its records are durable
    (``write`` + ``sync(lsn)`` is the same in two steps); ``replay(after_lsn)``
    yields the records after a checkpoint; ``rotate`` starts a new segment;
    ``drop_through(lsn)`` deletes segments made obsolete by a checkpoint.

    Thread-safe. A directory must be used by one open log at a time (the
    store's lock file guarantees one owner process).

    After a failed write or sync the log refuses every further append with
    :class:`WalFailedError` (an ``OSError``): the bytes on disk after the
    last acknowledged record are unknown, and an ``fsync`` that failed once
    cannot be retried safely (the kernel may have dropped the dirty pages and
    report success next time). Reopen the log to recover.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync: SyncMode = "fdatasync",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        readonly: bool = False,
        must_exist: bool = False,
        head: str | os.PathLike[str] | None = None,
        head_required: bool = False,
    ) -> None:
        """Opens (creating if needed) the log in directory ``path`` and recovers its tail.

        ``sync="fdatasync"`` (default): an acknowledged append survives a
        process crash and a power loss. ``sync="none"``: no ``fdatasync`` on
        append; acknowledged appends survive a process crash but may be lost
        on power loss or kernel crash (call ``sync(force=True)`` before a
        checkpoint).
        A segment is rotated once it holds ``segment_bytes`` or more (a batch
        is never split, so a segment may exceed it by one batch).

        Recovery cuts a torn tail of the last segment (dedupcore/wal/__init__.py,
        "Recovery: torn tail versus damage"), so ``append`` right after ``open`` is safe with or
        without a ``replay``. Damage to the last segment (an invalid header,
        or invalid bytes followed by a valid record continuing the log)
        raises :class:`CorruptFileError` and changes nothing.

        ``readonly=True`` is for inspection (possibly while the owner process
        appends): the directory must exist, nothing on disk is changed (a torn
        tail is skipped, not cut), and only ``replay``, ``last_lsn``,
        ``segments`` and ``close`` work.

        ``must_exist=True`` says that records were logged here before (the
        store passes it once a checkpoint was taken from this log): a missing
        directory, or one without a segment, then raises
        :class:`CorruptFileError` instead of starting an empty log.

        ``head`` is the path of the log's head file, outside ``path``
        (dedupcore/wal/segments.py, "The head file"): a log deleted whole or missing its
        newest segment is then refused instead of opened short, and a log
        closed clean may be deleted without loss. ``head_required``: a missing
        head file is :class:`CorruptFileError` (the caller knows one was kept).
        """
        if not isinstance(sync, str):
            raise TypeError(f"sync must be a str, not {type(sync).__name__}")
        if sync not in SYNC_MODES:
            raise ValueError(
                f"sync must be 'fdatasync' (survives power loss) or 'none' "
                f"(survives a process crash, not a power loss), got {sync!r}"
            )
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int):
            raise TypeError(f"segment_bytes must be an int, not {type(segment_bytes).__name__}")
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be >= {MIN_SEGMENT_BYTES}, got {segment_bytes}")
        self.path = Path(path)
        self.readonly = bool(readonly)
        self.sync_mode: SyncMode = sync
        self.segment_bytes = segment_bytes
        self._cond = threading.Condition(threading.Lock())
        #: Commits made (one write, and one fdatasync in that mode, each): with
        #: group commit, fewer than the appends they acknowledged.
        self.commits = 0
        self._pending = bytearray()  # framed records queued for the next leader
        self._pending_records = 0
        self._busy = False  # a thread does I/O on the last segment
        self._closing = False  # close() began: no new appends
        self._closed = False
        self._failure: BaseException | None = None
        self._failed_batch = (0, -1)  # LSN range of the batch whose write failed
        # The native commit thread (made on the first start_commit) and the first and
        # last LSN of the commit it runs, and where its zero fill ends (0: none).
        self._syncer: _core.Syncer | None = None
        self._native: tuple[int, int, int] | None = None
        #: The head file outside the log's directory (dedupcore/wal/segments.py), or None.
        self.head_path = None if head is None else Path(head)
        # The files; their list changes under the lock, their I/O runs one thread at a time.
        self._segments = Segments(self.path, readonly=self.readonly, head=self.head_path)
        # The last acknowledged record, then the LSN the next queued record gets.
        self._durable_lsn = self._segments.recover(must_exist, head_required)
        self._next_lsn = self._durable_lsn + 1

    @classmethod
    def open(cls, path: str | os.PathLike[str], **options: Any) -> WriteAheadLog:
        """Opens (creating if needed) the log in directory ``path`` and recovers its tail;
        ``options`` are those of the class (see ``__init__``)."""
        return cls(path, **options)

    # -- appending -----------------------------------------------------------

    @property
    def last_lsn(self) -> int:
        """LSN of the last acknowledged record (the first segment's first LSN - 1 if none)."""
        # No lock: one int attribute, read whole, that only grows once the log is
        # open (every claim asks whether its answer is durable already).
        return self._durable_lsn

    @property
    def commit_bytes(self) -> int:
        """Bytes the next commit writes before it can return: those queued, plus
        (a commit or other I/O is under way) that I/O, counted as unbounded."""
        with self._cond:
            return (1 << 62) if self._busy else len(self._pending)

    def append(self, payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Appends records and returns the LSN of the last, once all of them are durable.

        ``payloads`` is a sequence of bytes-like payloads, each at most
        ``MAX_RECORD_BYTES``; an empty payload is a valid record (its framing
        still carries an LSN and a checksum). A payload of the wrong type or
        size rejects the whole batch before anything is queued. An empty
        sequence appends nothing and returns ``last_lsn``.

        The batch gets consecutive LSNs and is committed with whatever else
        is queued in one ``write`` and one ``fdatasync`` (group commit): the
        first waiting thread that finds no commit running becomes the leader
        and commits everything queued while the others wait on a condition.

        Raises ``OSError`` if the write or sync of the batch holding these
        records failed (they are not acknowledged; after a reopen they may or
        may not be in the log, like a commit whose reply was lost), and
        :class:`WalFailedError` once the log has failed.
        """
        items = payload_list(payloads)
        with self._cond:
            self._check_open(items)
            if not items:
                return self._durable_lsn
            target = self._enqueue(items)
            self._wait_durable(target)
            return target

    def write(self, payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Queues records for the next commit and returns the LSN of the last, without waiting.

        The split form of :meth:`append` for a caller that orders records under
        its own lock and waits outside it: the records are NOT acknowledged
        until ``sync(lsn)`` (or a later ``append``) returns, or ``last_lsn``
        reaches ``lsn``. Same checks as ``append``; an empty sequence returns
        the last queued LSN. With ``sync="none"`` a small queue is written
        here and then (when no other I/O runs and no rotation is due), which
        is all that mode's commit does: ``last_lsn`` then covers it already.
        """
        items = payload_list(payloads)
        with self._cond:
            self._check_open(items)
            if not items:
                return self._next_lsn - 1
            target = self._enqueue(items)
            if (
                self.sync_mode == "none"
                and not self._busy
                and len(self._pending) <= WRITE_THROUGH_BYTES
                and self._segments.size < self.segment_bytes
            ):
                self._write_through()
            return target

    def _write_through(self) -> None:
        """Writes the queue now, lock held (``sync="none"``, small, no I/O running, no
        rotation due): the write is that mode's whole commit, so the records are
        acknowledged when :meth:`write` returns and nobody has to lead a commit for
        them. A failure fails the log as a failed commit does; the caller learns
        of it from ``sync`` (the records are not acknowledged)."""
        batch, first, last, _ = self._take_queue()
        failure: BaseException | None = None
        try:
            self._segments.append(batch)
        except BaseException as exc:
            failure = exc
        self._led(first, last, failure, False, None)

    def _enqueue(self, items: list[Any]) -> int:
        """Frames records onto the queue (lock held; payloads not yet checked, see
        :func:`payload_list`); returns the last LSN given."""
        first = self._next_lsn
        target = first + len(items) - 1
        if target > MAX_LSN:
            raise OverflowError("write-ahead log LSNs exhausted")
        if _core.frame_records(self._pending, items, first, MAX_RECORD_BYTES) >= 0:
            # A payload it does not take: named here (TypeError, ValueError, with
            # nothing queued), or a contiguous memoryview or a subclass of bytes,
            # framed from a copy.
            checked = [
                p if type(p) in (bytes, bytearray) else bytes(p) for p in check_payloads(items)
            ]
            if _core.frame_records(self._pending, checked, first, MAX_RECORD_BYTES) >= 0:
                raise AssertionError("checked payloads were refused")
        self._pending_records += len(items)
        self._next_lsn = target + 1
        return target

    def _check_open(self, payloads: list[Any] | None = None) -> None:
        """Raises unless appends are allowed (lock held); a bad payload among
        ``payloads`` (checked as they are framed) is named first, as it was
        always the first error an append reported."""
        if payloads and (self._closing or self.readonly or self._failure is not None):
            check_payloads(payloads)
        if self._closing:
            raise ValueError(f"write-ahead log {self.path} is closed")
        if self.readonly:
            raise ValueError(f"write-ahead log {self.path} is open read-only")
        if self._failure is not None:
            raise self._failed_error()

    def _failed_error(self) -> WalFailedError:
        err = WalFailedError(
            f"write-ahead log {self.path} failed earlier ({self._failure!r}); its tail is "
            "unknown, so it accepts no more appends: close and reopen it"
        )
        err.__cause__ = self._failure
        return err

    def _wait_durable(self, target: int) -> None:
        """Waits (lock held; leads commits when nobody else does) until ``target`` is durable."""
        while True:
            if self._durable_lsn >= target:
                return
            if self._failure is not None:
                low, high = self._failed_batch
                failure = self._failure
                if low <= target <= high and isinstance(failure, OSError):
                    message = (
                        "write-ahead log append failed, records not acknowledged: "
                        f"{failure.strerror or failure}"
                    )
                    err = OSError(failure.errno, message) if failure.errno else OSError(message)
                    if failure.filename is not None:
                        err.filename = failure.filename
                    raise err from failure
                raise self._failed_error()
            if not self._busy and self._pending_records:
                self._lead()
                continue
            self._await_io()

    def _lead(self) -> None:
        """Commits everything queued: one write and one fdatasync, lock released meanwhile.

        Called with the lock held and no other I/O running. Rotates first when
        the last segment has reached ``segment_bytes``.
        """
        batch, first, last, rotate = self._take_queue()
        self._cond.release()
        failure: BaseException | None = None
        rotated = False
        not_created: OSError | None = None
        try:
            if rotate:
                # A segment that cannot be created (no file descriptor, no space)
                # costs nothing acknowledged: the batch goes to the current one.
                not_created = self._segments.rotate(first)
                rotated = True
            if self.sync_mode == "fdatasync":
                self._segments.zero_ahead(len(batch))
            self._segments.append(batch)
            if self.sync_mode == "fdatasync":
                self._segments.sync()
        except BaseException as exc:
            failure = exc
        finally:
            self._cond.acquire()
        self._led(first, last, failure, rotated, not_created)

    def _take_queue(self) -> tuple[bytearray, int, int, bool]:
        """Takes the queued records for a commit (lock held, no I/O running): their
        bytes, first and last LSN, and whether the last segment is to be rotated
        first; marks the log busy until :meth:`_led`."""
        batch, self._pending = self._pending, bytearray()
        count, self._pending_records = self._pending_records, 0
        last = self._next_lsn - 1
        first = last - count + 1
        files = self._segments
        self._busy = True
        return batch, first, last, files.size >= self.segment_bytes and files.firsts[-1] < first

    def _led(
        self,
        first: int,
        last: int,
        failure: BaseException | None,
        rotated: bool,
        not_created: OSError | None,
    ) -> None:
        """Records the outcome of a commit of LSNs ``first..last`` (lock held). A failure
        that is no Exception (KeyboardInterrupt and the like) is raised on to the
        leader's caller once recorded."""
        self._busy = False
        if rotated:
            self._segments.rotated(first, not_created)
        if failure is None:
            self._durable_lsn = last
            self.commits += 1
        else:
            self._fail(failure, first, last)
        self._cond.notify_all()
        if failure is not None and not isinstance(failure, Exception):
            raise failure

    # -- the native commit thread -----------------------------------------------

    def start_commit(self) -> bool:
        """Starts a commit of the queued records on the native commit thread and returns
        at once; False (nothing started) when nothing is queued, another commit or
        other I/O runs, the log syncs nothing (``sync="none"``), or it failed or closes.

        The thread writes and fdatasyncs without the GIL, then makes
        :meth:`commit_fd` readable; :meth:`finish_commit` records the outcome
        (an event loop calls it when the descriptor is readable). A thread that
        waits for those records meanwhile (``sync``, ``append``) waits for the
        thread's commit and records it itself, so nothing waits on the loop.
        A rotation due first is done here, on the caller's thread; the zeros
        written ahead of the appends (above, "The zero-filled tail" in
        dedupcore/wal/__init__.py) by the thread, before the records.
        """
        with self._cond:
            if (
                self._busy
                or not self._pending_records
                or self.sync_mode != "fdatasync"
                or self._failure is not None
                or self._closing
            ):
                return False
            if self._syncer is None:
                self._syncer = _core.Syncer()
            batch, first, last, rotate = self._take_queue()
            files = self._segments
            if rotate:
                # A rotation before the thread's write, with the lock let go: the log
                # is busy meanwhile.
                self._cond.release()
                failure: BaseException | None = None
                not_created: OSError | None = None
                try:
                    not_created = files.rotate(first)
                except BaseException as exc:
                    failure = exc
                finally:
                    self._cond.acquire()
                if failure is not None:
                    self._led(first, last, failure, False, None)
                    return True  # started and failed: its waiters get the error
                files.rotated(first, not_created)
            # The zeros ahead of the appends are written by the thread too, before
            # the records: nothing of the commit's I/O is left to the caller.
            zero_end = files.zero_fill_end(len(batch))
            zeros = (files.length, zero_end) if zero_end else None
            self._syncer.start(files.fd, batch, True, zeros)
            self._native = (first, last, zero_end)
            # A thread that began waiting during the rotation waits for the thread's
            # commit now (it records it itself: nothing depends on the loop).
            self._cond.notify_all()
            return True

    def commit_fd(self) -> int | None:
        """The descriptor that becomes readable when a commit started by
        :meth:`start_commit` is done (None before the first)."""
        with self._cond:
            return None if self._syncer is None else self._syncer.fileno()

    def finish_commit(self) -> bool:
        """Clears :meth:`commit_fd` and records the outcome of the native thread's commit
        if it is done; True once no native commit is under way (it was recorded, here
        or by a thread that waited for it: its records are durable, or the log
        failed). Only the one watching the descriptor calls it."""
        with self._cond:
            if self._syncer is not None:
                self._syncer.drain()
            self._finish_native()
            return self._native is None

    def _finish_native(self) -> None:
        """Records the native thread's commit if it is done (lock held)."""
        if self._native is None or self._syncer is None:
            return
        outcome = self._syncer.take()
        if outcome is None:
            return
        first, last, zero_end = self._native
        self._native = None
        err, written, zero_err = outcome
        self._segments.zeroed(zero_end, zero_err)
        self._segments.appended(written, synced=not err)
        failure = None
        if err:
            failure = OSError(
                err, os.strerror(err), str(self._segments.file(self._segments.firsts[-1]))
            )
        self._led(first, last, failure, False, None)

    def _await_io(self) -> None:
        """Waits (lock held) for the I/O under way to end: the native thread's commit,
        which is then recorded here, or another thread's."""
        if self._native is None or self._syncer is None:
            self._cond.wait()
            return
        syncer = self._syncer
        self._cond.release()
        try:
            syncer.wait()
        finally:
            self._cond.acquire()
        self._finish_native()

    def _fail(self, failure: BaseException, first: int, last: int) -> None:
        """Marks the log failed (lock held): the bytes after the last acknowledged are unknown."""
        self._failure = failure
        self._failed_batch = (first, last)
        self._pending = bytearray()
        self._pending_records = 0
        lost = f" (LSNs {first}..{last} not acknowledged)" if first <= last else ""
        log.error(
            "%s: write-ahead log failed%s: %r; refusing further appends until reopened",
            self.path,
            lost,
            failure,
        )

    def _exclusive_io(self, *, closing: bool = False) -> None:
        """Waits (lock held) until no I/O runs and nothing is queued, committing the queue."""
        while True:
            if not closing:
                self._check_open()
            elif self._failure is not None:
                raise self._failed_error()
            if self._busy:
                self._await_io()
            elif self._pending_records:
                self._lead()
            else:
                return

    def _io(self, op: Callable[[], T]) -> T:
        """Runs ``op`` with the lock released and I/O exclusive; a failure fails the log.

        Called with the lock held, after ``_exclusive_io``.
        """
        self._busy = True
        self._cond.release()
        failure: BaseException | None = None
        try:
            return op()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._cond.acquire()
            self._busy = False
            if failure is not None:
                self._fail(failure, 0, -1)
            self._cond.notify_all()

    def rotate(self) -> int:
        """Starts a new segment and returns its first LSN; queued records are committed first.

        The current segment is synced complete first, in either sync mode. If
        it holds no record yet, it stays the one appended to and its first LSN
        is returned.

        If the new segment cannot be created (out of file descriptors, a full
        disk), raises that ``OSError`` without failing the log: nothing
        acknowledged is in doubt, appends go on in the current segment, and
        a later ``rotate`` (or an append past ``segment_bytes``) tries again.
        """
        with self._cond:
            self._exclusive_io()
            first = self._durable_lsn + 1
            if self._segments.firsts[-1] != first:
                error = self._io(lambda: self._segments.rotate(first))
                self._segments.rotated(first, error)
                if error is not None:
                    raise error
            return first

    def sync(self, lsn: int | None = None, *, force: bool = False) -> int:
        """Waits until the records through ``lsn`` are acknowledged; returns last_lsn.

        ``lsn`` defaults to the last record queued. Acknowledged means what
        ``append`` waits for: fdatasynced, or with ``sync="none"`` written to
        the operating system; the first waiter commits the queue (group
        commit). Raises ``OSError`` like ``append`` if the commit of ``lsn``
        failed.

        ``force=True`` also fdatasyncs with ``sync="none"``. Call it so before
        making a checkpoint durable in that mode: otherwise a power loss can
        leave the log ending before the checkpoint, and ``replay`` then
        raises :class:`CorruptFileError`.
        """
        with self._cond:
            if self._closing:
                raise ValueError(f"write-ahead log {self.path} is closed")
            if self.readonly:
                raise ValueError(f"write-ahead log {self.path} is open read-only")
            target = self._next_lsn - 1 if lsn is None else check_lsn("lsn", lsn)
            if target >= self._next_lsn:
                raise ValueError(
                    f"cannot sync through LSN {target}: the last record written is "
                    f"{self._next_lsn - 1}"
                )
            self._wait_durable(target)
            if force:
                self._exclusive_io()
                if self._segments.unsynced:
                    self._io(self._segments.sync)
            return self._durable_lsn

    def drop_through(self, lsn: int) -> int:
        """Deletes the segments all of whose records are <= ``lsn``; returns how many.

        Call it after a checkpoint made LMDB durable through ``lsn``. The last
        segment is never deleted (``rotate()`` first to drop its records too):
        it keeps the log's position. The directory is fsynced after the
        deletes so that they stick.
        """
        lsn = check_lsn("lsn", lsn)
        with self._cond:
            if self._closing:
                raise ValueError(f"write-ahead log {self.path} is closed")
            if self.readonly:
                raise ValueError(f"write-ahead log {self.path} is open read-only")
            if lsn > self._durable_lsn:
                raise ValueError(
                    f"cannot drop through LSN {lsn}: the log's last record is {self._durable_lsn}"
                )
            doomed = self._segments.detach_through(lsn)
        self._segments.delete(doomed)
        return len(doomed)

    def segments(self) -> list[Path]:
        """Paths of the segment files, oldest first."""
        with self._cond:
            return [self._segments.file(first) for first in self._segments.firsts]

    # -- replay --------------------------------------------------------------

    def replay(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yields (lsn, payload) of every acknowledged record with lsn > ``after_lsn``, in order.

        Reads the records acknowledged when it is called; segments whose
        records are all <= ``after_lsn`` are not read. A torn tail never
        reaches replay: opening cut it. While iterating, raises
        :class:`CorruptFileError` when a needed record cannot be read: a
        damaged header of a needed segment, an invalid record in a segment
        followed by another one or before the last acknowledged record,
        missing LSNs between segments, or ``after_lsn`` outside the log
        (records between the checkpoint and the log's start, or the log ending
        before the checkpoint). Records yielded before such an error were
        valid, but the caller should treat the whole replay as failed.
        """
        after_lsn = check_lsn("after_lsn", after_lsn)
        with self._cond:
            if self._closing:
                raise ValueError(f"write-ahead log {self.path} is closed")
            segments = list(self._segments.firsts)
            through = self._durable_lsn
        return self._segments.replay(after_lsn, segments, through)

    # -- closing -------------------------------------------------------------

    def close(self, *, checkpointed: int | None = None) -> None:
        """Commits queued records, syncs the last segment (in any mode) and closes. Idempotent.

        Appends started after ``close`` began raise ``ValueError``. A failed
        log is closed without a sync. ``checkpointed``: the caller's durable
        checkpoint holds every record through that LSN; if that is the last
        record of the log, the head file records a clean close (a log then
        deleted lost nothing: dedupcore/wal/segments.py, "The head file").
        """
        with self._cond:
            if self._closing:
                while not self._closed:
                    self._cond.wait()
                return
            self._closing = True
            try:
                if self._failure is None:
                    self._exclusive_io(closing=True)
                    if self._segments.unsynced:
                        self._io(self._segments.sync)
                    if (
                        checkpointed is not None
                        and checkpointed == self._durable_lsn
                        and not self.readonly
                    ):
                        last = self._segments.firsts[-1]
                        self._io(lambda: self._segments.write_head(last, checkpointed))
            finally:
                while self._busy:
                    self._await_io()
                if self._syncer is not None:
                    self._syncer.close()
                self._closed = True
                self._segments.close()
                self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run."""
        return self._closed

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failure else "open"
        return (
            f"<WriteAheadLog {str(self.path)!r} sync={self.sync_mode} last_lsn="
            f"{self._durable_lsn} segments={len(self._segments.firsts)} {state}>"
        )
