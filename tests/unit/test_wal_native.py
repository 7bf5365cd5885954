"""Tests of the log's native commit thread: the Syncer of ext/dc_sync.h and the log's
start_commit / finish_commit, which the daemon's group commit drives (docs/daemon.md,
"Group commit")."""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupcore._core import Syncer
from dedupcore.wal import MIN_SEGMENT_BYTES, WalFailedError, WriteAheadLog

PATIENCE = 60.0  # seconds a test waits for the thread before it fails (never a timing check)


def readable(fd: int) -> bool:
    """Waits until ``fd`` is readable; False if it is not within PATIENCE."""
    r, _, _ = select.select([fd], [], [], PATIENCE)
    return bool(r)


def payloads(first: int, n: int) -> list[bytes]:
    return [b"record %d" % i for i in range(first, first + n)]


@pytest.fixture
def syncer() -> Iterator[Syncer]:
    s = Syncer()
    yield s
    s.close()


@pytest.fixture
def file_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    yield fd
    os.close(fd)


# ---------------------------------------------------------------- the Syncer ---


def test_the_syncer_writes_syncs_then_says_so_on_its_eventfd(syncer: Syncer, file_fd: int) -> None:
    data = bytearray(b"x" * 100_000)
    syncer.start(file_fd, data)
    assert syncer.busy()
    assert readable(syncer.fileno())
    assert syncer.take() == (0, 100_000, 0)
    assert syncer.take() is None  # taken once
    assert not syncer.busy()
    assert os.pread(file_fd, 200_000, 0) == bytes(data)
    syncer.drain()
    assert select.select([syncer.fileno()], [], [], 0)[0] == []


def test_the_buffer_is_held_until_the_job_is_taken(syncer: Syncer, file_fd: int) -> None:
    data = bytearray(b"abc")
    syncer.start(file_fd, data)
    syncer.wait()
    with pytest.raises(BufferError):
        data.extend(b"d")  # the thread may still be reading it, as far as Python knows
    assert syncer.take() == (0, 3, 0)
    data.extend(b"d")


def test_one_job_at_a_time(syncer: Syncer, file_fd: int) -> None:
    syncer.start(file_fd, b"one")
    with pytest.raises(RuntimeError, match="under way"):
        syncer.start(file_fd, b"two")
    syncer.wait()
    with pytest.raises(RuntimeError, match="under way"):
        syncer.start(file_fd, b"two")  # done, not yet taken
    assert syncer.take() == (0, 3, 0)
    syncer.start(file_fd, b"two")
    syncer.wait()
    assert syncer.take() == (0, 3, 0)
    assert os.pread(file_fd, 10, 0) == b"onetwo"


def test_a_failed_write_is_reported_with_its_errno(syncer: Syncer, tmp_path: Path) -> None:
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        syncer.start(ro, b"data")
        syncer.wait()
        assert syncer.take() == (errno.EBADF, 0, 0)
    finally:
        os.close(ro)
    syncer.start(-1, b"")  # nothing to write, a sync of no file
    syncer.wait()
    assert syncer.take() == (errno.EBADF, 0, 0)


def test_bad_arguments_are_refused_before_anything_starts(syncer: Syncer, file_fd: int) -> None:
    with pytest.raises(TypeError):
        syncer.start(file_fd, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        syncer.start("3", b"x")  # type: ignore[arg-type]
    assert not syncer.busy()
    syncer.start(file_fd, memoryview(b"view"))
    syncer.wait()
    assert syncer.take() == (0, 4, 0)


def test_a_job_writes_its_zeros_ahead_before_its_data(syncer: Syncer, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "z", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"h" * 10)  # the data goes at the position: 10
        os.pwrite(fd, b"\xff" * 700_000, 10)  # what the zeros must cover
        syncer.start(fd, b"data", True, (10, 600_000))  # more than one chunk of zeros
        syncer.wait()
        assert syncer.take() == (0, 4, 0)
        # Zeros first, then the data over their start: nothing of the data is lost.
        assert os.pread(fd, 14, 0) == b"h" * 10 + b"data"
        assert os.pread(fd, 600_000 - 14, 14) == bytes(600_000 - 14)
        assert os.pread(fd, 10, 600_000) == b"\xff" * 10  # past the fill: untouched
    finally:
        os.close(fd)


def test_a_failed_zero_fill_is_reported_apart_and_the_data_still_written(
    syncer: Syncer,
) -> None:
    r, w = os.pipe()  # a pipe takes a write but no write at an offset (ESPIPE)
    try:
        syncer.start(w, b"data", False, (0, 4096))
        syncer.wait()
        assert syncer.take() == (0, 4, errno.ESPIPE)
        assert os.read(r, 10) == b"data"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("zeros", [(-1, 10), (10, 5), (0, -1)])
def test_a_bad_zero_fill_is_refused_before_anything_starts(
    syncer: Syncer, file_fd: int, zeros: tuple[int, int]
) -> None:
    with pytest.raises(ValueError, match="zeros must be"):
        syncer.start(file_fd, b"x", True, zeros)
    assert not syncer.busy()
    with pytest.raises(ValueError):
        syncer.start(file_fd, b"x", True, (0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        syncer.start(file_fd, b"x", True, ("0", "9"))  # type: ignore[arg-type]
    assert not syncer.busy()
    syncer.start(file_fd, b"x", True, (0, 0))  # an empty fill: none
    syncer.wait()
    assert syncer.take() == (0, 1, 0)


def test_close_finishes_the_job_under_way_and_is_final(tmp_path: Path, file_fd: int) -> None:
    s = Syncer()
    s.start(file_fd, b"z" * 4096)
    s.close()
    s.close()  # twice is fine
    assert os.pread(file_fd, 8192, 0) == b"z" * 4096
    with pytest.raises(ValueError, match="closed"):
        s.fileno()
    with pytest.raises(ValueError, match="closed"):
        s.start(file_fd, b"x")
    assert s.take() is None
    s.wait()  # returns at once


# ------------------------------------------------------------ the log's side ---


def test_a_commit_started_on_the_thread_is_durable_once_finished(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with WriteAheadLog.open(path) as wal:
        lsn = wal.write(payloads(1, 50))
        assert wal.last_lsn == 0
        assert wal.start_commit()
        fd = wal.commit_fd()
        assert fd is not None and readable(fd)
        assert wal.finish_commit()
        assert wal.last_lsn == lsn == 50
        assert wal.commits == 1
        assert wal.finish_commit()  # nothing under way: nothing more to record
    with WriteAheadLog.open(path) as wal:
        assert list(wal.replay(0)) == list(enumerate(payloads(1, 50), 1))


def test_a_thread_that_waits_for_the_log_records_the_commit_and_the_loop_still_hears(
    tmp_path: Path,
) -> None:
    with WriteAheadLog.open(tmp_path / "log") as wal:
        lsn = wal.write(payloads(1, 3))
        assert wal.start_commit()
        assert wal.sync(lsn) == lsn  # waits for the thread's commit and records it
        fd = wal.commit_fd()
        assert fd is not None and readable(fd)  # the one watching the descriptor is told
        assert wal.finish_commit()  # nothing left under way
        assert select.select([fd], [], [], 0)[0] == []  # cleared


def test_start_commit_declines_what_it_cannot_start(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path / "log") as wal:
        assert not wal.start_commit()  # nothing queued
        assert wal.commit_fd() is None
        wal.write(payloads(1, 1))
        assert wal.start_commit()
        wal.write(payloads(2, 1))
        assert not wal.start_commit()  # one under way
        fd = wal.commit_fd()
        assert fd is not None and readable(fd)
        assert wal.finish_commit()
        assert wal.last_lsn == 1
        assert wal.start_commit()  # the record queued meanwhile
        assert fd is not None and readable(fd)
        assert wal.finish_commit() and wal.last_lsn == 2
    with WriteAheadLog.open(tmp_path / "unsynced", sync="none") as wal:
        wal.write(payloads(1, 1))
        assert not wal.start_commit()  # nothing to sync: written the usual way
        assert wal.sync() == 1


def test_a_rotation_due_comes_before_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with WriteAheadLog.open(path, segment_bytes=MIN_SEGMENT_BYTES) as wal:
        wal.append(payloads(1, 5))
        assert len(wal.segments()) == 1
        wal.write(payloads(6, 5))
        assert wal.start_commit()
        assert len(wal.segments()) == 2
        assert wal.sync(10) == 10
    with WriteAheadLog.open(path) as wal:
        assert list(wal.replay(0)) == list(enumerate(payloads(1, 10), 1))


def test_the_thread_writes_the_zeros_ahead_of_the_appends(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with WriteAheadLog.open(path) as wal:
        segments = wal._segments
        # A new segment has no zeros yet: the first small commit asks for a fill.
        wal.write(payloads(1, 10))
        end = segments.zero_fill_end(len(wal._pending))
        assert end > segments.size
        assert wal.start_commit()
        fd = wal.commit_fd()
        assert fd is not None and readable(fd)
        assert wal.finish_commit() and wal.last_lsn == 10
        seg = segments.file(segments.firsts[-1])
        assert segments.length == end == seg.stat().st_size  # the thread's zeros, recorded
        assert not any(seg.read_bytes()[segments.size :])
        # The next commit lands on them: no fill.
        wal.write(payloads(11, 1))
        assert segments.zero_fill_end(len(wal._pending)) == 0
        assert wal.start_commit() and wal.sync(11) == 11
        assert segments.length == end == seg.stat().st_size
    with WriteAheadLog.open(path) as wal:
        assert list(wal.replay(0)) == list(enumerate(payloads(1, 11), 1))


def test_a_zero_fill_the_thread_could_not_make_is_given_up(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path / "log") as wal:
        segments = wal._segments
        wal.write(payloads(1, 2))
        # The thread reports the fill's failure (a full disk, say): recorded as a fill
        # made by the log itself would be, and the commit itself goes on.
        segments.zeroed(segments.size + 4096, errno.ENOSPC)
        assert segments.zero_fill_end(100) == 0  # given up for the segment
        assert wal.start_commit() and wal.sync(2) == 2


def test_close_waits_for_the_commit_under_way(tmp_path: Path) -> None:
    path = tmp_path / "log"
    wal = WriteAheadLog.open(path)
    wal.write(payloads(1, 1000))
    assert wal.start_commit()
    wal.close()
    with WriteAheadLog.open(path) as reopened:
        assert reopened.last_lsn == 1000


def test_a_failed_commit_fails_the_log_and_acknowledges_nothing(tmp_path: Path) -> None:
    path = tmp_path / "log"
    wal = WriteAheadLog.open(path)
    wal.append(payloads(1, 2))
    segments = wal._segments
    real_fd = segments.fd
    # The commit writes to a descriptor the kernel refuses writes on (EBADF).
    segments.fd = os.open(segments.file(segments.firsts[-1]), os.O_RDONLY)
    try:
        lsn = wal.write(payloads(3, 2))
        assert wal.start_commit()
        fd = wal.commit_fd()
        assert fd is not None and readable(fd)
        assert wal.finish_commit()
        assert wal.last_lsn == 2
        with pytest.raises(OSError, match="not acknowledged") as caught:
            wal.sync(lsn)
        assert caught.value.errno == errno.EBADF
        with pytest.raises(WalFailedError):
            wal.append(payloads(5, 1))
        assert not wal.start_commit()
    finally:
        os.close(real_fd)
        wal.close()
    with WriteAheadLog.open(path) as reopened:
        assert list(reopened.replay(0)) == list(enumerate(payloads(1, 2), 1))
