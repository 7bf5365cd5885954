"""The write-ahead log's files: segments, their creation and rotation, the head file.

A log is a directory of segment files ``wal-<first_lsn:020d>.log``
(dedupcore/wal/framing.py has their layout). A new segment is written as a
temporary file ``.wal-<first_lsn:020d>.log.tmp`` (header, ``fsync``),
renamed into place, and then the directory is ``fsync``-ed; the previous
segment is synced complete before, so every segment but the last is complete
on disk. :class:`Segments` does that I/O and the recovery of the last
segment at open; the log (dedupcore/wal/log.py) decides when, under its lock.

The head file
-------------

A log deleted whole, or the newest segment of it, leaves nothing inside the
log directory to say that records are missing. So a log opened with
``head=PATH`` (a file outside its directory; the store passes
``<data>/WAL_HEAD``) keeps there, durably, the first LSN of the newest
segment it created and whether it was closed clean (40 bytes)::

    offset size field
         0    8 magic b"DDCWALHD"
         8    2 format version (1)
        10    2 state: 0 open (records may follow the last checkpoint), 1 clean
        12    4 reserved, zero
        16    8 first LSN of the newest segment created
        24    8 clean: the log's last LSN at close (0 while open)
        32    8 XXH64 (seed 0) of bytes 0..31

It is written (temporary file, fsync, rename, directory fsync) when a
writable log opens (state open, before any append), after every new segment
is in place and before a record goes into it, and by ``close(checkpointed=
lsn)`` when the caller's checkpoint holds every record of the log (state
clean). Opening then refuses with :class:`CorruptFileError`, changing
nothing, when the log found lacks the newest segment the head names (the
records from that LSN on are lost), or is missing or empty while the head
says open (records after the last checkpoint may have been acknowledged).
After a clean close, a missing log lost nothing: it is started again at the
LSN after the clean one. A damaged head file is :class:`CorruptFileError`;
a missing one is an error only with ``head_required`` (the store records in
LMDB that it keeps one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import dedupcore._files as _files
from dedupcore.errors import CorruptFileError
from dedupcore.wal.framing import (
    HEADER_SIZE,
    Mapped,
    Scan,
    all_zero,
    header_problem,
    later_record,
    pack_header,
)

__all__ = ["HEAD", "HEAD_MAGIC", "HEAD_SIZE", "HEAD_VERSION", "LogHead", "Segments", "read_head"]

log = logging.getLogger("dedupcore.wal")

#: The head file (above), written and checked by dedupcore/_files.py.
_HEAD = _files.FileHeader(
    struct.Struct("<8sHHIQQQ"),
    b"DDCWALHD",
    1,
    "a write-ahead log head file",
    newer="log head version",
    invalid="invalid write-ahead log head fields",
    mismatch="write-ahead log head checksum mismatch",
)
HEAD_MAGIC, HEAD_VERSION = _HEAD.magic, _HEAD.version
HEAD, HEAD_SIZE = _HEAD.layout, _HEAD.size  # 40 bytes
_HEAD_OPEN, _HEAD_CLEAN = 0, 1

#: The zeros :meth:`Segments.zero_ahead` writes past the records, at least and at most
#: (dedupcore/wal/__init__.py, "The zero-filled tail").
ZERO_FILL_MIN = 64 << 10
ZERO_FILL_MAX = 1 << 20
_ZEROS = memoryview(bytes(ZERO_FILL_MAX))


def _write_zeros(fd: int, start: int, end: int) -> None:
    """Writes zeros over bytes ``start`` to ``end`` of the file (OSError as it comes)."""
    while start < end:
        start += os.pwrite(fd, _ZEROS[: end - start], start)


#: A read-only open that finds damage in the last segment scans it again after a pause,
#: up to this many scans in all, and reports it once two scans in a row find it alike
#: (the owner may be writing over the zeros meanwhile: :meth:`Segments._recover_last`).
READONLY_SCANS = 4
READONLY_RESCAN_PAUSE = 0.05

_SEGMENT_RE = re.compile(r"wal-(\d{20})\.log")
_TMP_RE = re.compile(r"\.wal-\d{20}\.log\.[^/]*tmp")


def _segment_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:020d}.log"


@dataclasses.dataclass(frozen=True)
class LogHead:
    """What a log's head file says (above, "The head file")."""

    newest_segment: int  #: first LSN of the newest segment the log created
    clean: bool  #: closed with every record checkpointed
    last_lsn: int  #: the log's last LSN at that clean close (0 while open)


def _pack_head(head: LogHead) -> bytes:
    state = _HEAD_CLEAN if head.clean else _HEAD_OPEN
    return _HEAD.pack(state, 0, head.newest_segment, head.last_lsn)


def read_head(path: str | os.PathLike[str]) -> LogHead | None:
    """The head file at ``path`` (None if there is none); CorruptFileError if it is
    damaged, UnsupportedFormatError if a newer version wrote it."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            raw = fh.read(HEAD_SIZE + 1)
    except FileNotFoundError:
        return None
    if len(raw) != HEAD_SIZE:
        raise CorruptFileError(
            f"{source}: write-ahead log head file is {len(raw)} bytes, not {HEAD_SIZE}"
        )
    state, _reserved, newest, last = _HEAD.unpack(raw, source)
    if state not in (_HEAD_OPEN, _HEAD_CLEAN) or newest < 1:
        raise CorruptFileError(f"{source}: invalid write-ahead log head fields")
    return LogHead(newest, state == _HEAD_CLEAN, last)


class Segments:
    """The segment files of one log directory, the last one open for appending, and
    the log's head file.

    The log (dedupcore/wal/log.py) serialises the I/O: one thread at a time
    calls the methods that touch the last segment (``append``, ``sync``,
    ``rotate``), and ``firsts`` changes under the log's lock only.
    """

    def __init__(self, path: Path, *, readonly: bool, head: Path | None) -> None:
        self.path = path
        self.readonly = readonly
        self.head_path = head
        self.firsts: list[int] = []  # first LSN of each segment, ascending
        self.fd = -1  # the last segment, open for writing
        self.size = 0  # bytes of records (and header) in the last segment
        #: The last segment's length on disk: past ``size``, zeros written ahead of
        #: the appends (:meth:`zero_ahead`).
        self.length = 0
        self.unsynced = False  # the last segment has writes not yet fdatasynced
        self._zero_failed = False  # a zero fill failed in the last segment: none until the next
        self._rotation_failures = 0  # new segments that could not be created in a row

    def file(self, first_lsn: int) -> Path:
        """The path of segment ``first_lsn``."""
        return self.path / _segment_name(first_lsn)

    def recover(self, must_exist: bool, head_required: bool) -> int:
        """Lists the segments, cuts a torn tail of the last one and opens it for appending;
        returns the LSN of the log's last valid record.

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
        firsts, stale = self._listing() if exists else ([], [])
        if readonly and firsts:
            # The owner may put segments in place while the directory is listed, and
            # a listing need not return an entry added during it: it can miss one
            # segment and list a later one, a gap that reads as lost records. Every
            # segment up to the newest listed was in place before a second listing
            # began, so that one lists them all; what it adds past them is left out
            # (a read-only view is a prefix of the log).
            newest = firsts[-1]
            firsts = [first for first in self._listing()[0] if first <= newest]
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
        self.firsts = firsts
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
            if readonly:
                return start - 1
            if not exists:
                self.path.mkdir(mode=_files.DIR_MODE, parents=True, exist_ok=True)
                _files.fsync_dir(self.path.parent)
            self._create(start)
            self.firsts.append(start)
            return start - 1
        if not readonly:
            for entry in stale:
                # A segment whose creation stopped before its rename: it never held a record.
                os.unlink(self.path / entry)
        end, last_lsn, zeros = self._recover_last(self.firsts[-1])
        if readonly:
            return last_lsn
        fd = os.open(self.file(self.firsts[-1]), os.O_WRONLY | os.O_CLOEXEC)
        try:
            length = os.fstat(fd).st_size
            if length > end and not zeros:
                # The torn tail becomes zeros, which the appends overwrite: the file
                # keeps its length, so a reader that has it mapped reads zeros there
                # instead of dying of SIGBUS past a new end of file.
                _write_zeros(fd, end, length)
                os.fsync(fd)
            os.lseek(fd, end, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size, self.length = end, length
        # Open from now on: records may follow the caller's last checkpoint.
        self.write_head(self.firsts[-1], None)
        return last_lsn

    def _listing(self) -> tuple[list[int], list[str]]:
        """The first LSNs of the segments in the directory, ascending, and the names of
        segments whose creation stopped before their rename."""
        firsts = []
        stale = []
        for entry in os.listdir(self.path):
            match = _SEGMENT_RE.fullmatch(entry)
            if match:
                firsts.append(int(match.group(1)))
            elif _TMP_RE.fullmatch(entry):
                stale.append(entry)
        firsts.sort()
        return firsts, stale

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

    def write_head(self, newest: int, clean_through: int | None) -> None:
        """Writes the head file durably (no-op without one)."""
        if self.head_path is None or self.readonly:
            return
        head = LogHead(newest, clean_through is not None, clean_through or 0)
        _files.atomic_write(self.head_path, [_pack_head(head)])

    def _recover_last(self, first: int) -> tuple[int, int, bool]:
        """Scans the last segment: (end offset of its last valid record, the record's LSN,
        whether only zeros follow it).

        Logs the cut of a torn tail (the caller writes zeros over it; zeros alone are kept for
        the appends: dedupcore/wal/__init__.py, "The zero-filled tail"). Raises
        :class:`CorruptFileError` for an invalid header (a segment is renamed
        into place only with a synced header) and for invalid bytes followed
        by a valid record carrying the next LSN or a later one; read-only, only
        once two scans in a row, a pause apart, find those alike (the owner may be
        writing a commit over its zeros meanwhile).
        """
        path = self.file(first)
        seen: tuple[int, tuple[int, int]] | None = None
        for scans_left in range(READONLY_SCANS - 1 if self.readonly else 0, -1, -1):
            with Mapped(path) as data:
                buf = data.view
                problem = header_problem(buf, first, str(path))
                if problem is not None:
                    zero = ", all zero" if len(buf) and all_zero(buf) else ""
                    raise CorruptFileError(
                        f"{path}: {problem} ({len(buf)} bytes{zero}): a segment is renamed "
                        "into place only once its header is synced, so this is damage, not "
                        "an interrupted creation; its records are unreadable (restore the file)"
                    )
                scan = Scan(buf, first)
                for _ in scan.records():
                    pass
                if scan.problem is None:
                    return scan.pos, scan.next_lsn - 1, True
                later = later_record(buf, scan.pos, scan.next_lsn)
                if later is not None:
                    if scans_left and seen != (scan.pos, later):
                        # Read-only, the owner may be writing a commit over the zeros
                        # ahead of its appends: a scan can meet its first bytes still
                        # zero and its later ones written. Damage stays where it is.
                        seen = (scan.pos, later)
                        time.sleep(READONLY_RESCAN_PAUSE)
                        continue
                    offset, lsn = later
                    raise CorruptFileError(
                        f"{path}: {scan.problem} at offset {scan.pos}, but a valid record "
                        f"of LSN {lsn} follows at offset {offset}: records from LSN "
                        f"{scan.next_lsn} on are damaged, not a torn tail (restore the file; "
                        f"or, to accept losing them, truncate it at offset {scan.pos})"
                    )
                dropped = len(buf) - scan.pos
                if all_zero(buf[scan.pos :]):
                    # The zeros written ahead of the appends (zero_ahead), or a
                    # filesystem's unwritten tail: nothing of a record, and nothing a
                    # later record could be mistaken for. Kept, said quietly.
                    log.debug(
                        "%s: %d bytes of zeros after LSN %d at offset %d: %s",
                        path,
                        dropped,
                        scan.next_lsn - 1,
                        scan.pos,
                        "ignored (read-only)" if self.readonly else "kept for the appends",
                    )
                    return scan.pos, scan.next_lsn - 1, True
                log.warning(
                    "%s: torn tail %s at offset %d after LSN %d: %s; %s %d bytes",
                    path,
                    "skipped (read-only)" if self.readonly else "cut",
                    scan.pos,
                    scan.next_lsn - 1,
                    scan.problem,
                    "ignored" if self.readonly else "dropped",
                    dropped,
                )
                return scan.pos, scan.next_lsn - 1, False
        raise AssertionError("the last scan returns or raises")

    def _new_file(self, first_lsn: int) -> tuple[int, int]:
        """Puts segment ``first_lsn`` in place; returns (its fd, the directory's fd).

        Written under a temporary name, fsynced and renamed into place: the
        segment appears whole or not at all. The directory is opened first, so
        that running out of file descriptors shows here. An ``OSError`` here
        leaves no new segment in place (the temporary file is removed) and no
        byte of a record written: nothing changed, the creation can be retried.
        """
        final = self.file(first_lsn)
        if final.exists():
            raise CorruptFileError(f"{final}: segment already exists")
        dir_fd = _files.open_dir(self.path)
        tmp = self.path / f".{final.name}.tmp"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _files.FILE_MODE
            )
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            _files.write_all(fd, pack_header(first_lsn))
            os.fsync(fd)
            os.rename(tmp, final)
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        return fd, dir_fd

    def _install(self, fd: int, dir_fd: int) -> None:
        """Fsyncs the directory (so the new segment stays after a power loss) and
        makes the new segment the one appended to. The caller adds it to
        ``firsts`` (under the log's lock). A failure here fails the log: the
        segment is in place, its directory entry maybe not durable."""
        try:
            os.fsync(dir_fd)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(dir_fd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        self.size = self.length = HEADER_SIZE
        self.unsynced = False
        self._zero_failed = False

    def _create(self, first_lsn: int) -> None:
        """Creates segment ``first_lsn`` durably, makes it the one appended to and
        names it in the head file."""
        self._install(*self._new_file(first_lsn))
        self.write_head(first_lsn, None)

    def rotate(self, first_lsn: int) -> OSError | None:
        """Syncs the last segment complete (in any sync mode), then creates the next one.

        Returns the error that kept the new segment from being put in place
        (out of file descriptors, a full disk): the last segment then stays
        the one appended to, and the log is fine. A failed sync, or a failure
        once the segment is in place, raises (and fails the log).
        """
        if self.unsynced:
            _files.fdatasync(self.fd)
            self.unsynced = False
        try:
            fd, dir_fd = self._new_file(first_lsn)
        except OSError as exc:
            if self.file(first_lsn).exists():
                # A rename that reported an error but happened (an I/O error): records
                # appended to the current segment would sit behind a segment claiming
                # their LSNs.
                raise
            return exc
        self._install(fd, dir_fd)
        # Before a record goes into it: a head that names it makes its loss an error.
        # A failure here fails the log (the segment is in place, the head behind it).
        self.write_head(first_lsn, None)
        return None

    def rotated(self, first_lsn: int, error: OSError | None) -> None:
        """Records the outcome of a rotation (lock held)."""
        if error is None:
            self.firsts.append(first_lsn)
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

    def sync(self) -> None:
        """Flushes the last segment's data (dedupcore/_files.py, ``fdatasync``)."""
        _files.fdatasync(self.fd)
        self.unsynced = False

    def replay(
        self, after_lsn: int, segments: list[int], through: int
    ) -> Iterator[tuple[int, bytes]]:
        """Yields (lsn, payload) of the records after ``after_lsn`` through ``through``
        from the segments ``segments`` (the log's ``replay`` documents the errors)."""
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
            path = self.file(first)
            if first != expected:
                raise CorruptFileError(
                    f"{path}: starts at LSN {first} but the previous segment ends at LSN "
                    f"{expected - 1}; records are missing"
                )
            with Mapped(path) as data:
                problem = header_problem(data.view, first, str(path))
                if problem is not None:
                    raise CorruptFileError(f"{path}: {problem}")
                scan = Scan(data.view, first)
                for lsn, start, end in scan.records(through):
                    if lsn > after_lsn:
                        yield lsn, bytes(data.view[start:end])
                last = index == len(segments) - 1
                if scan.problem is not None and (last or not all_zero(data.view[scan.pos :])):
                    # A segment before the last may end in the zeros written ahead of its
                    # appends; the next one's first LSN says whether records are missing.
                    where = (
                        "before the last acknowledged record"
                        if last
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

    # -- appending and dropping ---------------------------------------------------

    def append(self, batch: bytes | bytearray) -> None:
        """Writes framed records at the end of the last segment (not synced)."""
        _files.write_all(self.fd, batch)
        self.appended(len(batch), synced=False)

    def appended(self, n: int, *, synced: bool) -> None:
        """Counts ``n`` bytes written at the end of the last segment by other code (the
        native commit thread), synced with them or not."""
        self.size += n
        self.length = max(self.length, self.size)
        self.unsynced = not synced

    def zero_fill_end(self, n: int) -> int:
        """Where :meth:`zero_ahead` would end its fill for an append of ``n`` bytes; 0
        when it writes none (the zeros already reach past it, a large append, or a
        fill failed in this segment)."""
        if self.size + n <= self.length or self._zero_failed:
            return 0
        fill = min(max(self.size, ZERO_FILL_MIN), ZERO_FILL_MAX)
        if n > fill // 2:
            return 0  # a large append extends the file itself
        return self.size + fill

    def zero_ahead(self, n: int) -> None:
        """Makes room of zeros for an append of ``n`` bytes (dedupcore/wal/__init__.py,
        "The zero-filled tail"): when the records would pass the zeros already
        written, and ``n`` is small, writes zeros from the end of the file to
        ``size`` + a fill (as many bytes as the segment holds, 64 KiB to 1 MiB).
        The commit's ``fdatasync`` then makes them part of the file, and the
        commits after it overwrite blocks the file already has: their
        ``fdatasync`` writes the data and nothing of the file's metadata.

        Nothing depends on it: a fill that fails (a full disk) is given up for the
        rest of the segment, and appends extend the file themselves."""
        end = self.zero_fill_end(n)
        if not end:
            return
        try:
            _write_zeros(self.fd, self.length, end)
        except OSError as exc:
            self.zeroed(end, exc.errno or errno.EIO)
        else:
            self.zeroed(end, 0)

    def zeroed(self, end: int, err: int) -> None:
        """Records a zero fill up to ``end`` (0: none was written) made by
        :meth:`zero_ahead` or by other code (the native commit thread), which failed
        with errno ``err`` unless it is 0."""
        if not end:
            return
        if err:
            self._zero_failed = True
            log.debug("%s: zero fill ahead of the appends failed: %s", self.path, os.strerror(err))
        else:
            self.length = max(self.length, end)

    def detach_through(self, lsn: int) -> list[int]:
        """Takes the segments all of whose records are <= ``lsn`` off the list (the
        last one stays); returns their first LSNs for :meth:`delete`."""
        doomed = []
        while len(self.firsts) > 1 and self.firsts[1] - 1 <= lsn:
            doomed.append(self.firsts.pop(0))
        return doomed

    def delete(self, firsts: list[int]) -> None:
        """Deletes detached segments, then fsyncs the directory so that the deletes stick."""
        for first in firsts:
            self.file(first).unlink(missing_ok=True)
        if firsts:
            _files.fsync_dir(self.path)

    def close(self) -> None:
        """Closes the last segment."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
