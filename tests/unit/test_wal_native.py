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
    assert syncer.take() == (0, 100_000)
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
    assert syncer.take() == (0, 3)
    data.extend(b"d")


def test_one_job_at_a_time(syncer: Syncer, file_fd: int) -> None:
    syncer.start(file_fd, b"one")
    with pytest.raises(RuntimeError, match="under way"):
        syncer.start(file_fd, b"two")
    syncer.wait()
    with pytest.raises(RuntimeError, match="under way"):
        syncer.start(file_fd, b"two")  # done, not yet taken
    assert syncer.take() == (0, 3)
    syncer.start(file_fd, b"two")
    syncer.wait()
    assert syncer.take() == (0, 3)
    assert os.pread(file_fd, 10, 0) == b"onetwo"


def test_a_failed_write_is_reported_with_its_errno(syncer: Syncer, tmp_path: Path) -> None:
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        syncer.start(ro, b"data")
        syncer.wait()
        assert syncer.take() == (errno.EBADF, 0)
    finally:
        os.close(ro)
    syncer.start(-1, b"")  # nothing to write, a sync of no file
    syncer.wait()
    assert syncer.take() == (errno.EBADF, 0)


def test_bad_arguments_are_refused_before_anything_starts(syncer: Syncer, file_fd: int) -> None:
    with pytest.raises(TypeError):
        syncer.start(file_fd, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        syncer.start("3", b"x")  # type: ignore[arg-type]
    assert not syncer.busy()
    syncer.start(file_fd, memoryview(b"view"))
    syncer.wait()
    assert syncer.take() == (0, 4)


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
