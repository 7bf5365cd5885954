"""The write-ahead log itself: group commit, appends, rotation, replay, closing.

The formats, the durability rules and the recovery are in the package's
documentation (``dedupcore/wal/__init__.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import dedupcore._core as _core
import dedupcore._platform as _platform
from dedupcore.bloom import atomic_write
from dedupcore.errors import CorruptFileError, WalFailedError
from dedupcore.wal.framing import (
    DEFAULT_SEGMENT_BYTES,
    HEADER_SIZE,
    MAX_LSN,
    MAX_RECORD_BYTES,
    MIN_SEGMENT_BYTES,
    SYNC_MODES,
    SyncMode,
    T,
    _all_zero,
    _check_lsn,
    _check_payloads,
    _header_problem,
    _later_record,
    _Mapped,
    _pack_header,
    _payload_list,
    _Scan,
    _write_all,
)
from dedupcore.wal.segments import (
    _SEGMENT_RE,
    _TMP_RE,
    LogHead,
    _fsync_dir,
    _pack_head,
    _segment_name,
    read_head,
)

__all__ = ["WriteAheadLog"]

log = logging.getLogger("dedupcore.wal")


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
        self._segments: list[int] = []  # first LSN of each segment, ascending
        self._fd = -1  # the last segment, open for writing
        self._seg_size = 0  # bytes in the last segment
        self._unsynced = False  # the last segment has writes not yet fdatasynced
        #: Commits made (one write, and one fdatasync in that mode, each): with
        #: group commit, fewer than the appends they acknowledged.
        self.commits = 0
        self._durable_lsn = 0  # last acknowledged record
        self._next_lsn = 1  # LSN the next queued record gets
        self._pending = bytearray()  # framed records queued for the next leader
        self._pending_records = 0
        self._busy = False  # a thread does I/O on the last segment
        self._closing = False  # close() began: no new appends
        self._closed = False
        self._failure: BaseException | None = None
        self._failed_batch = (0, -1)  # LSN range of the batch whose write failed
        self._rotation_failures = 0  # new segments that could not be created in a row
        #: The head file outside the log's directory (module documentation), or None.
        self.head_path = None if head is None else Path(head)
        self._recover(must_exist, head_required)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        sync: SyncMode = "fdatasync",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        readonly: bool = False,
        must_exist: bool = False,
        head: str | os.PathLike[str] | None = None,
        head_required: bool = False,
    ) -> WriteAheadLog:
        """Opens (creating if needed) the log in directory ``path`` and recovers its tail.

        ``sync="fdatasync"`` (default): an acknowledged append survives a
        process crash and a power loss. ``sync="none"``: no ``fdatasync`` on
        append; acknowledged appends survive a process crash but may be lost
        on power loss or kernel crash (call ``sync(force=True)`` before a
        checkpoint).
        A segment is rotated once it holds ``segment_bytes`` or more (a batch
        is never split, so a segment may exceed it by one batch).

        Recovery cuts a torn tail of the last segment (see the module
        documentation), so ``append`` right after ``open`` is safe with or
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

        ``head`` is the path of the log's head file, outside ``path`` (module
        documentation, "The head file"): a log deleted whole or missing its
        newest segment is then refused instead of opened short, and a log
        closed clean may be deleted without loss. ``head_required``: a missing
        head file is :class:`CorruptFileError` (the caller knows one was kept).
        """
        return cls(
            path,
            sync=sync,
            segment_bytes=segment_bytes,
            readonly=readonly,
            must_exist=must_exist,
            head=head,
            head_required=head_required,
        )

    # -- opening -------------------------------------------------------------

    def _file(self, first_lsn: int) -> Path:
        return self.path / _segment_name(first_lsn)

    def _recover(self, must_exist: bool, head_required: bool) -> None:
        """Lists the segments, cuts a torn tail of the last one and opens it for appending.

        Every check that can refuse runs before anything on disk is changed."""
        readonly = self.readonly
        # The head first: a segment created after it was read is listed below, and a
        # head read after the listing could name a segment the listing missed.
        head = None if self.head_path is None else read_head(self.head_path)
        if head is None and head_required:
            raise CorruptFileError(
                f"{self.head_path}: the write-ahead log's head file is missing, but it was "
                f"kept: without it the store cannot tell whether {self.path} lacks "
                "acknowledged records (restore it from where the directory was copied)"
            )
        exists = self.path.is_dir()
        firsts = []
        stale = []
        if exists:
            for entry in os.listdir(self.path):
                match = _SEGMENT_RE.fullmatch(entry)
                if match:
                    firsts.append(int(match.group(1)))
                elif _TMP_RE.fullmatch(entry):
                    stale.append(entry)
        firsts.sort()
        self._check_against_head(head, firsts, exists)
        if not firsts and must_exist and head is None:
            if not exists:
                raise CorruptFileError(
                    f"{self.path}: the write-ahead log directory is missing, but records "
                    "were logged in it (restore it; an empty log would forget every "
                    "acknowledged record after the last checkpoint)"
                )
            raise CorruptFileError(
                f"{self.path}: no write-ahead log segment, but records were logged here "
                "(the last segment is never deleted): restore the segments"
            )
        if not exists and readonly and head is None:
            raise FileNotFoundError(f"{self.path}: no write-ahead log to open read-only")
        self._segments = firsts
        if not firsts:
            # A new log, or one deleted after a clean close (nothing was lost): it
            # goes on after the last LSN it had.
            start = head.last_lsn + 1 if head is not None else 1
            if head is not None and start > 1:
                log.warning(
                    "%s: the write-ahead log is missing; it was closed clean at LSN %d "
                    "(every record checkpointed), so nothing is lost: %s at LSN %d",
                    self.path,
                    start - 1,
                    "reading it as empty" if readonly else "starting it again",
                    start,
                )
            self._durable_lsn = start - 1
            self._next_lsn = start
            if readonly:
                return
            if not exists:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                _fsync_dir(self.path.parent)
            self._create_segment(start)
            self._segments.append(start)
            return
        if not readonly:
            for entry in stale:
                # A segment whose creation stopped before its rename: it never held a record.
                os.unlink(self.path / entry)
        end, last_lsn = self._recover_last(self._segments[-1])
        self._durable_lsn = last_lsn
        self._next_lsn = last_lsn + 1
        if readonly:
            return
        fd = os.open(self._file(self._segments[-1]), os.O_WRONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
                os.fsync(fd)
            os.lseek(fd, end, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._seg_size = end
        # Open from now on: records may follow the caller's last checkpoint.
        self._write_head(self._segments[-1], None)

    def _check_against_head(self, head: LogHead | None, firsts: list[int], exists: bool) -> None:
        """CorruptFileError if the segments found lack records the head says were logged."""
        if head is None or self.head_path is None:
            return
        newest = head.newest_segment
        if not firsts and not head.clean:
            what = "directory is missing" if not exists else "directory holds no segment"
            raise CorruptFileError(
                f"{self.path}: the write-ahead log {what}, but its head ({self.head_path}) "
                f"says segment {_segment_name(newest)} was written and the log was not "
                f"closed clean: records from LSN {newest} on (every record after the last "
                "checkpoint) may have been acknowledged and would come back NEW; restore "
                "the log directory (nothing was changed)"
            )
        if firsts and firsts[-1] < newest:
            raise CorruptFileError(
                f"{self.path}: segment {_segment_name(newest)} is missing (the newest "
                f"segment here starts at LSN {firsts[-1]}, and the log's head "
                f"{self.head_path} says {_segment_name(newest)} was created): records "
                f"from LSN {newest} on are lost; restore the segment (nothing was changed)"
            )

    def _write_head(self, newest: int, clean_through: int | None) -> None:
        """Writes the head file durably (no-op without one)."""
        if self.head_path is None or self.readonly:
            return
        head = LogHead(newest, clean_through is not None, clean_through or 0)
        atomic_write(self.head_path, [_pack_head(head)])

    def _recover_last(self, first: int) -> tuple[int, int]:
        """Scans the last segment: (end offset of its last valid record, the record's LSN).

        Logs the cut of a torn tail (the caller truncates). Raises
        :class:`CorruptFileError` for an invalid header (a segment is renamed
        into place only with a synced header) and for invalid bytes followed
        by a valid record carrying the next LSN or a later one.
        """
        path = self._file(first)
        with _Mapped(path) as data:
            buf = data.view
            problem = _header_problem(buf, first, str(path))
            if problem is not None:
                zero = ", all zero" if len(buf) and _all_zero(buf) else ""
                raise CorruptFileError(
                    f"{path}: {problem} ({len(buf)} bytes{zero}): a segment is renamed into "
                    "place only once its header is synced, so this is damage, not an "
                    "interrupted creation; its records are unreadable (restore the file)"
                )
            scan = _Scan(buf, first)
            for _ in scan.records():
                pass
            if scan.problem is not None:
                later = _later_record(buf, scan.pos, scan.next_lsn)
                if later is not None:
                    offset, lsn = later
                    raise CorruptFileError(
                        f"{path}: {scan.problem} at offset {scan.pos}, but a valid record "
                        f"of LSN {lsn} follows at offset {offset}: records from LSN "
                        f"{scan.next_lsn} on are damaged, not a torn tail (restore the file; "
                        f"or, to accept losing them, truncate it at offset {scan.pos})"
                    )
                dropped = len(buf) - scan.pos
                zero = ", all zero" if _all_zero(buf[scan.pos :]) else ""
                log.warning(
                    "%s: torn tail %s at offset %d after LSN %d: %s; %s %d bytes%s",
                    path,
                    "skipped (read-only)" if self.readonly else "cut",
                    scan.pos,
                    scan.next_lsn - 1,
                    scan.problem,
                    "ignored" if self.readonly else "dropped",
                    dropped,
                    zero,
                )
            return scan.pos, scan.next_lsn - 1

    def _new_segment_file(self, first_lsn: int) -> tuple[int, int]:
        """Puts segment ``first_lsn`` in place; returns (its fd, the directory's fd).

        Written under a temporary name, fsynced and renamed into place: the
        segment appears whole or not at all. The directory is opened first, so
        that running out of file descriptors shows here. An ``OSError`` here
        leaves no new segment in place (the temporary file is removed) and no
        byte of a record written: nothing changed, the creation can be retried.
        """
        final = self._file(first_lsn)
        if final.exists():
            raise CorruptFileError(f"{final}: segment already exists")
        dir_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        tmp = self.path / f".{final.name}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            _write_all(fd, _pack_header(first_lsn))
            os.fsync(fd)
            os.rename(tmp, final)
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        return fd, dir_fd

    def _install_segment(self, fd: int, dir_fd: int) -> None:
        """Fsyncs the directory (so the new segment stays after a power loss) and
        makes the new segment the one appended to. The caller adds it to
        ``_segments`` (under the lock). A failure here fails the log: the
        segment is in place, its directory entry maybe not durable."""
        try:
            os.fsync(dir_fd)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(dir_fd)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._seg_size = HEADER_SIZE
        self._unsynced = False

    def _create_segment(self, first_lsn: int) -> None:
        """Creates segment ``first_lsn`` durably, makes it the one appended to and
        names it in the head file."""
        self._install_segment(*self._new_segment_file(first_lsn))
        self._write_head(first_lsn, None)

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
        items = _payload_list(payloads)
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
        until ``sync(lsn)`` (or a later ``append``) returns. Same checks as
        ``append``; an empty sequence returns the last queued LSN.
        """
        items = _payload_list(payloads)
        with self._cond:
            self._check_open(items)
            if not items:
                return self._next_lsn - 1
            return self._enqueue(items)

    def _enqueue(self, items: list[Any]) -> int:
        """Frames records onto the queue (lock held; payloads not yet checked, see
        :func:`_payload_list`); returns the last LSN given."""
        first = self._next_lsn
        target = first + len(items) - 1
        if target > MAX_LSN:
            raise OverflowError("write-ahead log LSNs exhausted")
        if _core.frame_records(self._pending, items, first, MAX_RECORD_BYTES) >= 0:
            # A payload it does not take: named here (TypeError, ValueError, with
            # nothing queued), or a contiguous memoryview or a subclass of bytes,
            # framed from a copy.
            checked = [
                p if type(p) in (bytes, bytearray) else bytes(p) for p in _check_payloads(items)
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
            _check_payloads(payloads)
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
            self._cond.wait()

    def _lead(self) -> None:
        """Commits everything queued: one write and one fdatasync, lock released meanwhile.

        Called with the lock held and no other I/O running. Rotates first when
        the last segment has reached ``segment_bytes``.
        """
        batch, self._pending = self._pending, bytearray()
        count, self._pending_records = self._pending_records, 0
        last = self._next_lsn - 1
        first = last - count + 1
        rotate = self._seg_size >= self.segment_bytes and self._segments[-1] < first
        self._busy = True
        self._cond.release()
        failure: BaseException | None = None
        rotated = False
        not_created: OSError | None = None
        try:
            if rotate:
                # A segment that cannot be created (no file descriptor, no space)
                # costs nothing acknowledged: the batch goes to the current one.
                not_created = self._rotate_io(first)
                rotated = True
            _write_all(self._fd, batch)
            self._seg_size += len(batch)
            self._unsynced = True
            if self.sync_mode == "fdatasync":
                _platform.fdatasync(self._fd)
                self._unsynced = False
        except BaseException as exc:
            failure = exc
        finally:
            self._cond.acquire()
            self._busy = False
        if rotated:
            self._rotated(first, not_created)
        if failure is None:
            self._durable_lsn = last
            self.commits += 1
        else:
            self._fail(failure, first, last)
        self._cond.notify_all()
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt and the like reach the leader's caller

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
                self._cond.wait()
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

    def _rotate_io(self, first_lsn: int) -> OSError | None:
        """Syncs the last segment complete (in any sync mode), then creates the next one.

        Returns the error that kept the new segment from being put in place
        (out of file descriptors, a full disk): the last segment then stays
        the one appended to, and the log is fine. A failed sync, or a failure
        once the segment is in place, raises (and fails the log).
        """
        if self._unsynced:
            _platform.fdatasync(self._fd)
            self._unsynced = False
        try:
            fd, dir_fd = self._new_segment_file(first_lsn)
        except OSError as exc:
            if self._file(first_lsn).exists():
                # A rename that reported an error but happened (an I/O error): records
                # appended to the current segment would sit behind a segment claiming
                # their LSNs.
                raise
            return exc
        self._install_segment(fd, dir_fd)
        # Before a record goes into it: a head that names it makes its loss an error.
        # A failure here fails the log (the segment is in place, the head behind it).
        self._write_head(first_lsn, None)
        return None

    def _rotated(self, first_lsn: int, error: OSError | None) -> None:
        """Records the outcome of a rotation (lock held)."""
        if error is None:
            self._segments.append(first_lsn)
            if self._rotation_failures:
                log.info(
                    "%s: new segment at LSN %d created after %d failed attempts",
                    self.path,
                    first_lsn,
                    self._rotation_failures,
                )
                self._rotation_failures = 0
            return
        self._rotation_failures += 1
        log.log(
            logging.WARNING if self._rotation_failures == 1 else logging.DEBUG,
            "%s: cannot create a new segment at LSN %d (%s); appending to the current "
            "segment and trying again later (attempt %d)",
            self.path,
            first_lsn,
            error,
            self._rotation_failures,
        )

    def _sync_io(self) -> None:
        _platform.fdatasync(self._fd)
        self._unsynced = False

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
            if self._segments[-1] != first:
                error = self._io(lambda: self._rotate_io(first))
                self._rotated(first, error)
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
            target = self._next_lsn - 1 if lsn is None else _check_lsn("lsn", lsn)
            if target >= self._next_lsn:
                raise ValueError(
                    f"cannot sync through LSN {target}: the last record written is "
                    f"{self._next_lsn - 1}"
                )
            self._wait_durable(target)
            if force:
                self._exclusive_io()
                if self._unsynced:
                    self._io(self._sync_io)
            return self._durable_lsn

    def drop_through(self, lsn: int) -> int:
        """Deletes the segments all of whose records are <= ``lsn``; returns how many.

        Call it after a checkpoint made LMDB durable through ``lsn``. The last
        segment is never deleted (``rotate()`` first to drop its records too):
        it keeps the log's position. The directory is fsynced after the
        deletes so that they stick.
        """
        lsn = _check_lsn("lsn", lsn)
        with self._cond:
            if self._closing:
                raise ValueError(f"write-ahead log {self.path} is closed")
            if self.readonly:
                raise ValueError(f"write-ahead log {self.path} is open read-only")
            if lsn > self._durable_lsn:
                raise ValueError(
                    f"cannot drop through LSN {lsn}: the log's last record is {self._durable_lsn}"
                )
            doomed = []
            while len(self._segments) > 1 and self._segments[1] - 1 <= lsn:
                doomed.append(self._segments.pop(0))
        for first in doomed:
            self._file(first).unlink(missing_ok=True)
        if doomed:
            _fsync_dir(self.path)
        return len(doomed)

    def segments(self) -> list[Path]:
        """Paths of the segment files, oldest first."""
        with self._cond:
            return [self._file(first) for first in self._segments]

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
        after_lsn = _check_lsn("after_lsn", after_lsn)
        with self._cond:
            if self._closing:
                raise ValueError(f"write-ahead log {self.path} is closed")
            segments = list(self._segments)
            through = self._durable_lsn
        return self._replay(after_lsn, segments, through)

    def _replay(
        self, after_lsn: int, segments: list[int], through: int
    ) -> Iterator[tuple[int, bytes]]:
        if after_lsn > through:
            raise CorruptFileError(
                f"{self.path}: the log ends at LSN {through} but replay starts after "
                f"{after_lsn}: records up to the checkpoint are missing (with sync='none', "
                "sync(force=True) must run before a checkpoint is made durable)"
            )
        if after_lsn == through:
            return
        if not segments:
            raise CorruptFileError(
                f"{self.path}: no segment, but records {after_lsn + 1}..{through} were logged"
            )
        needed = [i for i, first in enumerate(segments) if first <= after_lsn + 1]
        if not needed:
            raise CorruptFileError(
                f"{self.path}: the log starts at LSN {segments[0]}; records "
                f"{after_lsn + 1}..{segments[0] - 1} after the checkpoint are missing"
            )
        expected = segments[needed[-1]]
        for index in range(needed[-1], len(segments)):
            first = segments[index]
            path = self._file(first)
            if first != expected:
                raise CorruptFileError(
                    f"{path}: starts at LSN {first} but the previous segment ends at LSN "
                    f"{expected - 1}; records are missing"
                )
            with _Mapped(path) as data:
                problem = _header_problem(data.view, first, str(path))
                if problem is not None:
                    raise CorruptFileError(f"{path}: {problem}")
                scan = _Scan(data.view, first)
                for lsn, start, end in scan.records(through):
                    if lsn > after_lsn:
                        yield lsn, bytes(data.view[start:end])
                if scan.problem is not None:
                    where = (
                        "before the last acknowledged record"
                        if index == len(segments) - 1
                        else "in a segment that was complete when the next one was created"
                    )
                    raise CorruptFileError(
                        f"{path}: {scan.problem} at offset {scan.pos}, {where}: records "
                        f"from LSN {scan.next_lsn} on are damaged (restore the file, or "
                        f"truncate it at offset {scan.pos} and delete later segments to "
                        "accept their loss)"
                    )
                expected = scan.next_lsn
            if expected > through:
                return
        raise CorruptFileError(
            f"{self.path}: the log ends at LSN {expected - 1}, before LSN {through}"
        )

    # -- closing -------------------------------------------------------------

    def close(self, *, checkpointed: int | None = None) -> None:
        """Commits queued records, syncs the last segment (in any mode) and closes. Idempotent.

        Appends started after ``close`` began raise ``ValueError``. A failed
        log is closed without a sync. ``checkpointed``: the caller's durable
        checkpoint holds every record through that LSN; if that is the last
        record of the log, the head file records a clean close (a log then
        deleted lost nothing: module documentation, "The head file").
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
                    if self._unsynced:
                        self._io(self._sync_io)
                    if (
                        checkpointed is not None
                        and checkpointed == self._durable_lsn
                        and not self.readonly
                    ):
                        last = self._segments[-1]
                        self._io(lambda: self._write_head(last, checkpointed))
            finally:
                while self._busy:
                    self._cond.wait()
                self._closed = True
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1
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
            f"{self._durable_lsn} segments={len(self._segments)} {state}>"
        )
