"""Tests of the write-ahead log: round trips, torn tails, damage, group commit, crashes, errors."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dedupcore
from dedupcore import hash64
from dedupcore.errors import CorruptFileError, DedupError, UnsupportedFormatError
from dedupcore.wal import (
    MAX_RECORD_BYTES,
    WalFailedError,
    WriteAheadLog,
)
from tests.support.procs import LineProcess, load_script
from tests.support.wal import HEADER_SIZE, segment_frames

CHILD = Path(__file__).with_name("wal_child.py")
wal_child = load_script(CHILD)
payload_for: Callable[[int], bytes] = wal_child.payload_for

Records = list[tuple[int, bytes]]


# ---------------------------------------------------------------- helpers ---


def frame(lsn: int, payload: bytes) -> bytes:
    """A record as the documented format says, built independently of the module."""
    body = struct.pack("<IQ", len(payload), lsn) + payload
    return body + struct.pack("<Q", hash64(body))


def frames(path: Path) -> list[tuple[int, int, int]]:
    """(lsn, start, end) of each record of a segment file, up to the zeros the log
    writes ahead of its appends; nothing but zeros may follow them."""
    found = [(lsn, start, end) for lsn, start, end, _ in segment_frames(path)]
    tail = path.read_bytes()[found[-1][2] if found else HEADER_SIZE :]
    assert not any(tail), "bytes after the records that are not zero"
    return found


def records_end(seg: Path) -> int:
    """Where a segment's last record ends."""
    found = frames(seg)
    return found[-1][2] if found else HEADER_SIZE


def cut_zeros(path: Path) -> None:
    """Cuts every segment of the closed log in ``path`` at the end of its last record:
    the log without the zeros written ahead of its appends, for the tests of the frames
    and of what follows the last record (an older log, or one that synced nothing)."""
    for seg in path.glob("wal-*.log"):
        os.truncate(seg, records_end(seg))


def fill(wal: WriteAheadLog, batches: int, rng: random.Random, max_batch: int = 8) -> Records:
    """Appends ``batches`` batches of payload_for(lsn) records; returns what was appended."""
    out: Records = []
    for _ in range(batches):
        first = wal.last_lsn + 1
        n = rng.randint(1, max_batch)
        payloads = [payload_for(lsn) for lsn in range(first, first + n)]
        last = wal.append(payloads)
        assert last == first + n - 1
        out.extend(zip(range(first, last + 1), payloads, strict=True))
    return out


def replay(path: Path, after: int = 0, **kw: object) -> Records:
    with WriteAheadLog.open(path, **kw) as wal:  # type: ignore[arg-type]
        return list(wal.replay(after))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def cut_warnings(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    """The log's messages at ``level`` (a cut tail's: a warning, a debug message when
    it is all zero)."""
    return [
        r.getMessage() for r in caplog.records if r.name == "dedupcore.wal" and r.levelno == level
    ]


@pytest.fixture
def fdatasyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts os.fdatasync calls (still syncing for real)."""
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    return calls


# ------------------------------------------------------------- round trip ---


def test_round_trip_across_rotations_and_reopen(tmp_path: Path) -> None:
    rng = random.Random(1)
    with WriteAheadLog.open(tmp_path, segment_bytes=600) as wal:
        assert wal.last_lsn == 0
        assert list(wal.replay(0)) == []
        expected = fill(wal, 60, rng)
        assert list(wal.replay(0)) == expected
        segments = wal.segments()
    assert len(segments) > 5
    assert [p.name for p in sorted(tmp_path.iterdir())] == [p.name for p in segments]
    # Every segment but the last was rotated once it reached segment_bytes.
    assert all(p.stat().st_size >= 600 for p in segments[:-1])
    firsts = [int(p.name[4:24]) for p in segments]
    assert firsts[0] == 1 and firsts == sorted(firsts)

    last = expected[-1][0]
    with WriteAheadLog.open(tmp_path, segment_bytes=600) as wal:
        assert wal.last_lsn == last
        cut_points = [0, 1, firsts[2] - 1, firsts[2], last // 2, last - 1, last]
        for after in cut_points:
            assert list(wal.replay(after)) == expected[after:], after
        more = fill(wal, 5, rng)
        assert more[0][0] == last + 1
    assert replay(tmp_path) == expected + more


def test_file_format_is_the_documented_one(tmp_path: Path) -> None:
    xxhash = pytest.importorskip("xxhash")
    with WriteAheadLog.open(tmp_path) as wal:
        wal.append([b"hello", b"", b"x" * 300])
    (seg,) = tmp_path.iterdir()
    assert seg.name == f"wal-{1:020d}.log"
    data = seg.read_bytes()
    assert not any(data[frames(seg)[-1][2] :])  # after the records, zeros only
    cut_zeros(tmp_path)
    data = seg.read_bytes()
    magic, version, algorithm, reserved, first, checksum = struct.unpack_from("<8sHHIQQ", data)
    assert (magic, version, algorithm, reserved, first) == (b"DDCWAL01", 1, 1, 0, 1)
    assert checksum == xxhash.xxh64_intdigest(data[:24], 0)
    pos, seen = HEADER_SIZE, []
    while pos < len(data):
        length, lsn = struct.unpack_from("<IQ", data, pos)
        end = pos + 12 + length
        assert struct.unpack_from("<Q", data, end)[0] == xxhash.xxh64_intdigest(data[pos:end], 0)
        seen.append((lsn, data[pos + 12 : end]))
        pos = end + 8
    assert seen == [(1, b"hello"), (2, b""), (3, b"x" * 300)]


def test_empty_payloads_and_buffer_types_round_trip(tmp_path: Path) -> None:
    """Empty payloads are valid records: their framing still carries an LSN and a checksum."""
    with WriteAheadLog.open(tmp_path) as wal:
        assert wal.append([b"", bytearray(b"ba"), memoryview(b"mv"), b""]) == 4
        assert wal.append([]) == 4  # nothing to append
        assert wal.append((_Bytes(b"sub"), memoryview(b"xmvx")[1:3])) == 6  # not a list
        assert wal.append([_Bytes(b"sub2"), b"plain"]) == 8  # framed from copies
    assert replay(tmp_path) == [
        (1, b""),
        (2, b"ba"),
        (3, b"mv"),
        (4, b""),
        (5, b"sub"),
        (6, b"mv"),
        (7, b"sub2"),
        (8, b"plain"),
    ]


class _Bytes(bytes):
    """A bytes subclass: the native framing takes exact bytes only, the log any bytes."""


def _framed(payloads: list[bytes], first: int) -> bytes:
    out = b""
    for lsn, p in enumerate(payloads, first):
        body = struct.pack("<IQ", len(p), lsn) + p
        out += body + struct.pack("<Q", hash64(body))
    return out


@given(
    st.lists(st.binary(max_size=300), max_size=20),
    st.integers(1, 2**64 - 30),
    st.binary(max_size=40),
)
def test_native_framing_is_the_documented_format(
    payloads: list[bytes], first: int, before: bytes
) -> None:
    out = bytearray(before)  # framing appends to what is queued
    mixed: list[object] = [bytearray(p) if i % 2 else p for i, p in enumerate(payloads)]
    assert dedupcore._core.frame_records(out, mixed, first, 1 << 20) == -1
    assert bytes(out) == before + _framed(payloads, first)


def test_native_framing_refuses_what_it_does_not_take_and_appends_nothing() -> None:
    frame = dedupcore._core.frame_records
    for bad, index in (
        ([b"a", "text"], 1),
        ([memoryview(b"m")], 0),
        ([b"a", b"b", _Bytes(b"c")], 2),
        ([b"ok", None], 1),
        ([b"x" * 11], 0),  # over max_bytes
    ):
        out = bytearray(b"queued")
        assert frame(out, bad, 1, 10) == index
        assert out == b"queued"
    out = bytearray(b"self")
    assert frame(out, [b"a", out], 1, 10) == 1  # resized while framed: refused
    assert out == b"self"
    assert frame(bytearray(), [b"x" * 10], 1, 10) == -1  # at the limit


def test_write_then_sync_is_the_split_append(tmp_path: Path, fdatasyncs: list[int]) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        assert wal.write([b"a", b"b"]) == 2
        assert wal.write([b"c"]) == 3
        assert wal.last_lsn == 0 and fdatasyncs == []  # queued, not acknowledged
        assert wal.sync(2) == 3  # one commit covers everything queued
        assert len(fdatasyncs) == 1
        assert wal.sync(1) == 3 and wal.sync() == 3
        assert len(fdatasyncs) == 1
        with pytest.raises(ValueError, match="last record written is 3"):
            wal.sync(4)
        wal.write([b"d"])  # committed by close
    assert replay(tmp_path) == [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]


def test_rotate_and_drop_through(tmp_path: Path) -> None:
    rng = random.Random(2)
    with WriteAheadLog.open(tmp_path) as wal:
        a = fill(wal, 3, rng)
        assert wal.rotate() == a[-1][0] + 1
        assert wal.rotate() == a[-1][0] + 1  # an empty segment is not rotated again
        b = fill(wal, 3, rng)
        wal.rotate()
        c = fill(wal, 3, rng)
        assert len(wal.segments()) == 3
        assert wal.drop_through(a[-1][0] - 1) == 0  # a segment with a newer record stays
        assert wal.drop_through(a[-1][0]) == 1
        assert list(wal.replay(a[-1][0])) == b + c
        with pytest.raises(CorruptFileError, match="missing"):
            list(wal.replay(0))  # records 1.. were dropped: a checkpoint cannot be before them
        assert wal.drop_through(c[-1][0]) == 1  # the last segment is never deleted
        assert len(wal.segments()) == 1
        with pytest.raises(ValueError, match="last record"):
            wal.drop_through(c[-1][0] + 1)
        assert wal.rotate() == c[-1][0] + 1
        assert wal.drop_through(c[-1][0]) == 1
        assert list(wal.replay(c[-1][0])) == []
    with WriteAheadLog.open(tmp_path) as wal:
        assert wal.last_lsn == c[-1][0]  # kept by the empty last segment's header
        assert wal.append([b"next"]) == c[-1][0] + 1


def test_replay_after_the_end_is_an_error(tmp_path: Path) -> None:
    """A checkpoint past the log's end means acknowledged records are missing."""
    with WriteAheadLog.open(tmp_path) as wal:
        wal.append([b"a", b"b"])
        assert list(wal.replay(2)) == []
        with pytest.raises(CorruptFileError, match="ends at LSN 2"):
            list(wal.replay(3))


# -------------------------------------------------------------- torn tail ---


def _log_with_last_record(tmp_path: Path, segment_bytes: int = 64 << 20) -> tuple[Path, Records]:
    src = tmp_path / "src"
    with WriteAheadLog.open(src, segment_bytes=segment_bytes) as wal:
        records = fill(wal, 12, random.Random(3))
        records.append((wal.append([b"L" * 45]), b"L" * 45))
    cut_zeros(src)
    return src, records


def test_torn_tail_at_every_offset_of_the_last_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, records = _log_with_last_record(tmp_path, segment_bytes=400)
    seg = sorted(src.iterdir())[-1]
    lsn, start, end = frames(seg)[-1]
    assert lsn == records[-1][0] and end == seg.stat().st_size
    assert int(sorted(src.iterdir())[0].name[4:24]) == 1
    for offset in range(start, end):
        work = tmp_path / f"cut{offset}"
        shutil.copytree(src, work)
        os.truncate(work / seg.name, offset)
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="dedupcore.wal"),
            WriteAheadLog.open(work, segment_bytes=400) as wal,
        ):
            assert wal.last_lsn == lsn - 1
            assert list(wal.replay(0)) == records[:-1]
            assert wal.append([b"after"]) == lsn
            assert list(wal.replay(lsn - 1)) == [(lsn, b"after")]
        if offset > start:
            (msg,) = cut_warnings(caplog)
            assert f"dropped {offset - start} bytes" in msg
        else:
            assert cut_warnings(caplog) == []  # a cut at a record boundary is a clean end
        assert replay(work) == [*records[:-1], (lsn, b"after")]
        shutil.rmtree(work)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.lists(st.binary(max_size=40), min_size=1, max_size=5), min_size=1, max_size=8
    ),
    cut=st.floats(min_value=0.0, max_value=1.0),
)
def test_any_truncation_replays_exactly_the_whole_records(
    batches: list[list[bytes]], cut: float
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        with WriteAheadLog.open(path) as wal:
            for batch in batches:
                wal.append(batch)
        cut_zeros(path)
        (seg,) = path.iterdir()
        size = seg.stat().st_size
        offset = HEADER_SIZE + round((size - HEADER_SIZE) * cut)
        os.truncate(seg, offset)
        whole = [lsn for lsn, _, _, _ in segment_frames(seg, offset)]
        flat = [p for batch in batches for p in batch]
        assert replay(path) == list(zip(whole, flat[: len(whole)], strict=True))


def _segment_damages() -> list[tuple[str, Callable[[Path], None]]]:
    """Ways a segment in place can lose its header: emptied, cut short, zeroed, overwritten."""

    def cut(size: int) -> Callable[[Path], None]:
        return lambda seg: os.truncate(seg, size)

    def zero(size: int) -> Callable[[Path], None]:
        return lambda seg: seg.write_bytes(bytes(size))

    def zero_keep_size(seg: Path) -> None:
        seg.write_bytes(bytes(seg.stat().st_size))

    def garbage(seg: Path) -> None:
        seg.write_bytes(random.Random(8).randbytes(seg.stat().st_size))

    return [
        ("empty", cut(0)),
        ("1 byte", cut(1)),
        ("31 bytes", cut(31)),
        ("32 zero bytes", zero(32)),
        ("4096 zero bytes", zero(4096)),
        ("zeroed in place", zero_keep_size),
        ("garbage in place", garbage),
    ]


@pytest.mark.parametrize("only", [False, True], ids=["after-another", "only-segment"])
def test_segment_in_place_without_a_valid_header_is_damage(tmp_path: Path, only: bool) -> None:
    """A segment is renamed into place only once its header is synced: whatever its size
    or content, a segment without a valid header is damage, never an interrupted creation
    to delete (that dropped every acknowledged record in it)."""
    src = tmp_path / "src"
    with WriteAheadLog.open(src) as wal:
        records = fill(wal, 4, random.Random(4))
        nxt = wal.rotate()
        records += fill(wal, 30, random.Random(5))
        if only:
            wal.rotate()
            wal.drop_through(nxt - 1)
    seg = src / f"wal-{nxt:020d}.log"
    assert seg.exists() and seg.stat().st_size > 4096
    for name, damage in _segment_damages():
        work = tmp_path / name.replace(" ", "-")
        shutil.copytree(src, work)
        if only:  # the segment holding the log's records is the only one left
            (work / f"wal-{records[-1][0] + 1:020d}.log").unlink()
        damage(work / seg.name)
        before = sorted((p.name, p.read_bytes()) for p in work.iterdir())
        with pytest.raises(CorruptFileError) as info:
            WriteAheadLog.open(work)
        assert seg.name in str(info.value) and "not an interrupted creation" in str(info.value)
        assert sorted((p.name, p.read_bytes()) for p in work.iterdir()) == before, name
        with pytest.raises(CorruptFileError):
            WriteAheadLog.open(work, readonly=True)
    after = nxt - 1 if only else 0
    assert replay(src, after) == records[after:]  # the undamaged log


def test_interrupted_segment_creation_leaves_only_a_temporary_file(tmp_path: Path) -> None:
    """What an interrupted creation can leave (any prefix of the header, zeros after it)
    is a temporary file; opening removes it and the log goes on where it was."""
    with WriteAheadLog.open(tmp_path) as wal:
        records = fill(wal, 3, random.Random(9))
    nxt = records[-1][0] + 1
    for content in (b"", b"DDCW", bytes(32), bytes(4096)):
        (tmp_path / f".wal-{nxt:020d}.log.tmp").write_bytes(content)
        with WriteAheadLog.open(tmp_path) as wal:
            assert wal.last_lsn == nxt - 1
            assert list(wal.replay(0)) == records
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"wal-{1:020d}.log"]


def test_flipped_byte_in_the_last_record_cuts_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    lsn, start, end = frames(seg)[-1]
    for offset in range(start, end):
        work = tmp_path / f"flip{offset}"
        shutil.copytree(src, work)
        flip(work / seg.name, offset)
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="dedupcore.wal"),
            WriteAheadLog.open(work) as wal,
        ):
            assert list(wal.replay(0)) == records[:-1], offset
            assert wal.append([b"again"]) == lsn
        (msg,) = cut_warnings(caplog)
        assert f"dropped {end - start} bytes" in msg
        # Cut at the record's start, then "again" appended there (and zeros after it).
        assert records_end(work / seg.name) == start + len(frame(lsn, b"again"))
        shutil.rmtree(work)


def test_damage_in_the_last_segment_followed_by_valid_records_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torn tail has no valid record continuing the log after it; damage inside the last
    segment does: refuse to open, naming the file and the offset, and change nothing."""
    import dedupcore.wal.segments as segments

    monkeypatch.setattr(segments, "READONLY_RESCAN_PAUSE", 0.0)  # its rescans find the same
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    lsn, start, end = frames(seg)[5]
    for offset in range(start, end):
        work = tmp_path / f"flip{offset}"
        shutil.copytree(src, work)
        flip(work / seg.name, offset)
        before = (work / seg.name).read_bytes()
        with pytest.raises(CorruptFileError) as info:
            WriteAheadLog.open(work)
        message = str(info.value)
        assert seg.name in message and f"at offset {start}," in message, message
        assert f"of LSN {lsn + 1} follows at offset {end}" in message, message
        assert (work / seg.name).read_bytes() == before
        with pytest.raises(CorruptFileError):
            WriteAheadLog.open(work, readonly=True)
        shutil.rmtree(work)
    # Zeros over a whole page of records, the rest intact: damage too.
    work = tmp_path / "zero-page"
    shutil.copytree(src, work)
    data = bytearray((work / seg.name).read_bytes())
    data[start : start + 100] = bytes(100)
    (work / seg.name).write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="not a torn tail"):
        WriteAheadLog.open(work)
    # The same bytes as a tail, with nothing valid after them, are no record: zeros,
    # kept quietly (zeros are what the log writes ahead of its appends).
    os.truncate(work / seg.name, start + 100)
    with caplog.at_level(logging.DEBUG, logger="dedupcore.wal"):
        assert replay(work) == records[: lsn - 1]
    assert not cut_warnings(caplog)
    (msg,) = cut_warnings(caplog, logging.DEBUG)
    assert f"100 bytes of zeros after LSN {lsn - 1} at offset {start}" in msg


def test_record_with_a_later_lsn_after_damage_is_found_at_any_lsn(tmp_path: Path) -> None:
    """Any later LSN counts (damage may span many records), small or past 2**32."""
    for first in (1, 255, 256, 65536, 2**32 - 3, 2**40 + 7):
        path = tmp_path / f"log{first}"
        path.mkdir()
        header = struct.pack("<8sHHIQ", b"DDCWAL01", 1, 1, 0, first)
        good = frame(first, b"a") + frame(first + 1, b"b")
        tail = b"\x00" * 7 + frame(first + 9, b"\x00" * 30)
        seg = path / f"wal-{first:020d}.log"
        seg.write_bytes(header + struct.pack("<Q", hash64(header)) + good + tail)
        with pytest.raises(CorruptFileError, match=f"of LSN {first + 9} follows at offset"):
            WriteAheadLog.open(path)
        os.truncate(seg, seg.stat().st_size - 1)  # the later record is invalid now
        with WriteAheadLog.open(path) as wal:
            assert list(wal.replay(first - 1)) == [(first, b"a"), (first + 1, b"b")]


def _multi_segment_log(tmp_path: Path) -> tuple[Path, Records, list[Path]]:
    path = tmp_path / "log"
    with WriteAheadLog.open(path, segment_bytes=500) as wal:
        records = fill(wal, 40, random.Random(6), max_batch=3)
        segs = wal.segments()
    assert len(segs) >= 4
    return path, records, segs


def test_damaged_record_in_an_earlier_segment_is_an_error(tmp_path: Path) -> None:
    """Damage in a segment followed by another one is not a crash artifact: CorruptFileError.

    A segment is created only after the previous one was synced complete, so
    invalid bytes inside it are damage to acknowledged records. Cutting there
    would silently drop every later segment's acknowledged records.
    """
    path, records, segs = _multi_segment_log(tmp_path)
    victim = segs[1]
    recs = frames(victim)
    lsn, start, _ = recs[len(recs) // 2]
    flip(victim, start + 13)
    with WriteAheadLog.open(path, segment_bytes=500) as wal:  # the last segment is fine
        with pytest.raises(CorruptFileError) as info:
            list(wal.replay(0))
        message = str(info.value)
        assert victim.name in message and f"offset {start}" in message
        assert f"LSN {lsn}" in message
        # A checkpoint past the damaged segment does not need it.
        second_first = int(segs[2].name[4:24])
        assert list(wal.replay(second_first - 1)) == records[second_first - 1 :]
        nxt = wal.append([b"still appends"])
        assert nxt == records[-1][0] + 1
    # Nothing was cut or deleted.
    assert [p.name for p in sorted(path.iterdir())] == [p.name for p in segs]


def test_truncated_earlier_segment_is_an_error(tmp_path: Path) -> None:
    path, _records, segs = _multi_segment_log(tmp_path)
    _, start, _ = frames(segs[0])[-1]
    os.truncate(segs[0], start)  # a clean record boundary, but LSNs go missing
    with (
        WriteAheadLog.open(path) as wal,
        pytest.raises(CorruptFileError, match="records are missing"),
    ):
        list(wal.replay(0))


def test_damaged_header_of_the_first_needed_segment_is_an_error(tmp_path: Path) -> None:
    path, records, segs = _multi_segment_log(tmp_path)
    flip(segs[1], 20)  # inside the first-LSN field
    first1 = int(segs[1].name[4:24])
    first2 = int(segs[2].name[4:24])
    with WriteAheadLog.open(path) as wal:
        with pytest.raises(CorruptFileError, match="header checksum mismatch"):
            list(wal.replay(first1))  # the first segment needed
        with pytest.raises(CorruptFileError, match="header checksum mismatch"):
            list(wal.replay(0))  # needed in the middle
        assert list(wal.replay(first2 - 1)) == records[first2 - 1 :]  # not needed


def test_damaged_header_of_the_last_segment_refuses_to_open(tmp_path: Path) -> None:
    path, _records, segs = _multi_segment_log(tmp_path)
    flip(segs[-1], 3)
    with pytest.raises(CorruptFileError, match="not a dedupcore write-ahead log"):
        WriteAheadLog.open(path)
    data = bytearray(segs[-1].read_bytes())
    data[0:8] = b"DDCWAL01"
    data[8:10] = struct.pack("<H", 2)
    segs[-1].write_bytes(bytes(data))
    with pytest.raises(UnsupportedFormatError, match="version 2"):
        WriteAheadLog.open(path)


def test_garbage_after_the_last_record_is_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    nxt = records[-1][0] + 1
    garbage = random.Random(7).randbytes(1000)
    with open(seg, "ab") as fh:
        fh.write(garbage)
    with caplog.at_level(logging.WARNING, logger="dedupcore.wal"), WriteAheadLog.open(src) as wal:
        assert list(wal.replay(0)) == records
        assert wal.last_lsn == nxt - 1
    (msg,) = cut_warnings(caplog)
    assert "dropped 1000 bytes" in msg
    # A valid record continuing the log after garbage is damage, not a torn tail.
    with open(seg, "ab") as fh:
        fh.write(garbage[:5] + frame(nxt, b"ghost"))
    with pytest.raises(CorruptFileError, match=f"valid record of LSN {nxt} follows"):
        WriteAheadLog.open(src)


def test_zero_filled_tail_is_kept_for_the_appends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash leaves the zeros the log wrote ahead of its appends (or, on some
    filesystems, a longer file whose new part reads as zeros): kept, and written over."""
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    end = seg.stat().st_size
    with open(seg, "ab") as fh:
        fh.write(bytes(8192))
    with caplog.at_level(logging.DEBUG, logger="dedupcore.wal"), WriteAheadLog.open(src) as wal:
        assert seg.stat().st_size == end + 8192  # nothing changed on disk
        assert list(wal.replay(0)) == records
        assert wal.append([b"z"]) == records[-1][0] + 1
        assert seg.stat().st_size == end + 8192  # the record went on the zeros
    assert not cut_warnings(caplog)
    (msg,) = cut_warnings(caplog, logging.DEBUG)
    assert f"8192 bytes of zeros after LSN {records[-1][0]}" in msg and "kept" in msg
    assert records_end(seg) == end + len(frame(records[-1][0] + 1, b"z"))
    assert replay(src) == [*records, (records[-1][0] + 1, b"z")]
    assert replay(src) == [*records, (records[-1][0] + 1, b"z")]


def test_length_field_over_the_maximum_is_invalid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    nxt = records[-1][0] + 1
    with open(seg, "ab") as fh:
        fh.write(struct.pack("<IQ", MAX_RECORD_BYTES + 1, nxt) + b"\x01" * 64)
    with caplog.at_level(logging.WARNING, logger="dedupcore.wal"):
        assert replay(src) == records
    (msg,) = cut_warnings(caplog)
    assert "exceeds the maximum" in msg


def test_wrong_lsn_in_a_valid_frame_is_invalid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    nxt = records[-1][0] + 1
    end = seg.stat().st_size
    with open(seg, "ab") as fh:
        fh.write(frame(nxt - 3, b"stale"))
    with caplog.at_level(logging.WARNING, logger="dedupcore.wal"):
        assert replay(src) == records
    (msg,) = cut_warnings(caplog)
    assert f"LSN {nxt - 3} where {nxt} was expected" in msg
    # The cut tail is zeros now, the file as long as it was.
    assert seg.read_bytes()[end:] == bytes(len(frame(nxt - 3, b"stale")))
    # A valid record skipping an LSN: the record before it is missing, not torn.
    with open(seg, "r+b") as fh:
        fh.seek(end)
        fh.write(frame(nxt + 1, b"skips one"))
    with pytest.raises(CorruptFileError, match=f"LSN {nxt + 1} where {nxt} was expected"):
        WriteAheadLog.open(src)


def test_leftover_temporary_segment_is_removed(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        wal.append([b"a"])
    (tmp_path / f".wal-{2:020d}.log.tmp").write_bytes(b"DDCW")
    with WriteAheadLog.open(tmp_path) as wal:
        assert wal.append([b"b"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"wal-{1:020d}.log"]


def test_must_exist_refuses_a_missing_or_empty_log(tmp_path: Path) -> None:
    """A log that records were taken from (the store passes must_exist once it has a
    checkpoint) is never silently replaced by an empty one."""
    missing = tmp_path / "missing"
    for readonly in (False, True):
        with pytest.raises(CorruptFileError, match="directory is missing"):
            WriteAheadLog.open(missing, must_exist=True, readonly=readonly)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorruptFileError, match="no write-ahead log segment"):
        WriteAheadLog.open(empty, must_exist=True)
    assert list(empty.iterdir()) == []
    with WriteAheadLog.open(empty) as wal:  # a new log: created
        wal.append([b"a"])
    with WriteAheadLog.open(empty, must_exist=True) as wal:
        assert list(wal.replay(0)) == [(1, b"a")]


def test_readonly_open_changes_nothing(tmp_path: Path) -> None:
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    with open(seg, "ab") as fh:
        fh.write(b"torn")
    before = seg.read_bytes()
    with WriteAheadLog.open(src, readonly=True) as wal:
        assert wal.last_lsn == records[-1][0]
        assert list(wal.replay(0)) == records
        for call in (
            lambda: wal.append([b"x"]),
            lambda: wal.write([b"x"]),
            wal.rotate,
            wal.sync,
            lambda: wal.drop_through(1),
        ):
            with pytest.raises(ValueError, match="read-only"):
                call()
    assert seg.read_bytes() == before
    with pytest.raises(FileNotFoundError):
        WriteAheadLog.open(tmp_path / "missing", readonly=True)


# ---------------------------------------------------------- group commit ---


def test_group_commit_batches_waiting_appends_into_one_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one commit syncs, 7 threads queue up; the next leader commits all 7 at once."""
    real = os.fdatasync
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def blocking(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            entered.set()
            assert release.wait(30)
        real(fd)

    with WriteAheadLog.open(tmp_path) as wal:
        monkeypatch.setattr(os, "fdatasync", blocking)
        results: dict[int, int] = {}

        def run(i: int) -> None:
            results[i] = wal.append([f"t{i}".encode()])

        first = threading.Thread(target=run, args=(0,))
        first.start()
        assert entered.wait(30)
        others = [threading.Thread(target=run, args=(i,)) for i in range(1, 8)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while wal._pending_records < 7:  # all 7 queued behind the running commit
            assert time.monotonic() < deadline, "followers did not queue"
            time.sleep(0.001)
        release.set()
        for t in [first, *others]:
            t.join(30)
        assert len(calls) == 2
        assert sorted(results.values()) == list(range(1, 9))
        got = dict(wal.replay(0))
        assert all(got[lsn] == f"t{i}".encode() for i, lsn in results.items())


def test_concurrent_appends_from_8_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdatasync
    calls: list[int] = []

    def slow_counting(fd: int) -> None:
        calls.append(fd)
        real(fd)
        time.sleep(0.0005)  # a disk slower than this one widens the window; no timing asserted

    monkeypatch.setattr(os, "fdatasync", slow_counting)
    threads, appends = 8, 40
    acks: dict[int, list[tuple[int, list[bytes]]]] = {i: [] for i in range(threads)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)
    with WriteAheadLog.open(tmp_path, segment_bytes=2048) as wal:

        def run(t: int) -> None:
            try:
                rng = random.Random(t)
                barrier.wait()
                for j in range(appends):
                    batch = [
                        f"{t}:{j}:{k}".encode() * rng.randint(0, 3)
                        for k in range(rng.randint(1, 4))
                    ]
                    acks[t].append((wal.append(batch), batch))
            except BaseException as exc:  # reported below
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors
        assert all(len(a) == appends for a in acks.values())  # every append returned
        expected: dict[int, bytes] = {}
        for entries in acks.values():
            for last, batch in entries:
                for lsn, payload in zip(range(last - len(batch) + 1, last + 1), batch, strict=True):
                    assert lsn not in expected  # unique LSNs
                    expected[lsn] = payload
        assert sorted(expected) == list(range(1, len(expected) + 1))
        assert dict(wal.replay(0)) == expected
        assert len(wal.segments()) > 1
        assert len(calls) < threads * appends  # group commit: fewer syncs than appends
    assert dict(replay(tmp_path)) == expected


def test_sync_none_skips_fdatasync_but_rotation_and_close_sync(
    tmp_path: Path, fdatasyncs: list[int]
) -> None:
    with WriteAheadLog.open(tmp_path, sync="none") as wal:
        records = fill(wal, 20, random.Random(8))
        assert fdatasyncs == []
        wal.rotate()  # the previous segment is synced complete before the next exists
        assert len(fdatasyncs) == 1
        more = fill(wal, 3, random.Random(9))
        assert len(fdatasyncs) == 1
        wal.sync()  # acknowledged already: nothing to wait for, no sync
        assert len(fdatasyncs) == 1
        wal.sync(force=True)
        assert len(fdatasyncs) == 2
        wal.append([b"last"])
    assert len(fdatasyncs) == 3  # close syncs
    assert replay(tmp_path) == [*records, *more, (more[-1][0] + 1, b"last")]


# ------------------------------------------------------------ real crash ---


def test_sigkill_during_appends_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """A child appends in a loop and prints each acknowledged LSN; SIGKILL; reopen; check."""
    path = tmp_path / "log"
    acked = 0
    # The acks read before each round's kill: fixed, so that every run kills alike (the
    # child goes on appending while the parent reads, so the kill lands mid-loop).
    targets = [20, 150, 73, 41, 118, 96]
    for round_no, target in enumerate(targets):
        mode = "fdatasync" if round_no % 2 == 0 else "none"  # both survive a process crash
        argv = [sys.executable, str(CHILD), str(path), mode, str(round_no)]
        with LineProcess(argv, name="wal_child.py") as child:
            ready = child.next_line(60)
            assert ready is not None and ready.startswith("ready"), child.stderr()
            assert int(ready.split()[1]) >= acked  # the child's reopen kept every ack
            for _ in range(target):
                line = child.next_line(60)
                assert line is not None, child.stderr()
                acked = max(acked, int(line))
            # Every line printed whole was printed after append returned: acknowledged.
            for line in child.sigkill():
                acked = max(acked, int(line))
        got = replay(path)
        assert [lsn for lsn, _ in got] == list(range(1, len(got) + 1))
        assert len(got) >= acked
        assert all(payload == payload_for(lsn) for lsn, payload in got)
    assert acked > 0


# -------------------------------------------------------------- failures ---


def test_enospc_on_write_fails_the_log_and_reopen_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 5, random.Random(11))
        real_write = os.write

        def full(fd: int, data: object) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", full)
        with pytest.raises(OSError) as info:
            wal.append([b"lost"])
        assert info.value.errno == errno.ENOSPC
        assert not isinstance(info.value, WalFailedError)
        monkeypatch.setattr(os, "write", real_write)  # the disk has room again...
        for call in (
            lambda: wal.append([b"x"]),
            lambda: wal.write([b"x"]),
            wal.rotate,
            lambda: wal.sync(acked[-1][0], force=True),
        ):
            with pytest.raises(WalFailedError, match="reopen") as failed:
                call()  # ...but the log's tail is unknown: never acknowledge again
            assert isinstance(failed.value, OSError) and isinstance(failed.value, DedupError)
        # Waiting for the failed record (write + sync) reports that record's failure;
        # records acknowledged before it stay acknowledged.
        with pytest.raises(OSError) as info:
            wal.sync()
        assert info.value.errno == errno.ENOSPC
        assert not isinstance(info.value, WalFailedError)
        assert wal.sync(acked[-1][0]) == acked[-1][0]
        assert wal.last_lsn == acked[-1][0]
        assert list(wal.replay(0)) == acked
    with WriteAheadLog.open(tmp_path) as wal:
        assert list(wal.replay(0)) == acked
        assert wal.append([b"ok"]) == acked[-1][0] + 1


def test_partial_write_then_enospc_leaves_a_tail_that_reopen_cuts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 5, random.Random(12))
        real_write = os.write
        state = {"written": False}

        def partial(fd: int, data: bytes) -> int:
            if not state["written"]:
                state["written"] = True  # the first record and 10 bytes of the second
                return real_write(fd, bytes(data)[: len(data) // 2 + 10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", partial)
        lsn = wal.last_lsn + 1
        with pytest.raises(OSError, match="No space"):
            wal.append([b"p" * 100, b"q" * 100])
        monkeypatch.setattr(os, "write", real_write)
    with caplog.at_level(logging.WARNING, logger="dedupcore.wal"):
        # The whole first record of the failed batch may be replayed (never acknowledged,
        # like a commit whose reply was lost); the partial second one is cut.
        assert replay(tmp_path) == [*acked, (lsn, b"p" * 100)]
    (msg,) = cut_warnings(caplog)
    # The 10 bytes, and the zeros written ahead of the appends after them: cut where the
    # first record of the failed batch ends.
    assert "torn tail cut" in msg and "all zero" not in msg
    (seg,) = tmp_path.glob("wal-*.log")
    end = frames(seg)[-1][2]
    assert frames(seg)[-1][0] == lsn
    data = seg.read_bytes()  # the cut tail is zeros, and the file keeps its length
    assert len(data) > end and not any(data[end:])


@pytest.mark.parametrize("where", ["write", "fdatasync"])
def test_an_interrupt_in_a_commit_reaches_its_caller_and_fails_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A KeyboardInterrupt (any BaseException that is no Exception) raised while the
    leader writes or syncs is raised on to the caller as it is, and the log is failed
    like after an I/O error: the tail is unknown, nothing is acknowledged after it."""
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 4, random.Random(17))

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(os, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            wal.append([b"interrupted"])
        monkeypatch.undo()
        with pytest.raises(WalFailedError, match="reopen"):
            wal.append([b"after"])
        assert wal.sync(acked[-1][0]) == acked[-1][0]
    got = replay(tmp_path)
    assert got[: len(acked)] == acked and len(got) <= len(acked) + 1


def test_eio_on_fdatasync_raises_to_every_waiter_of_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit's failure reaches each caller whose records were in it; later callers get
    WalFailedError; reopening keeps every acknowledged record (the failed batch's records
    may or may not be there, as for a commit whose reply was lost)."""
    real = os.fdatasync
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def flaky(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            entered.set()
            assert release.wait(30)
            real(fd)
            return
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 3, random.Random(13))
        monkeypatch.setattr(os, "fdatasync", flaky)
        outcome: dict[int, object] = {}

        def run(i: int) -> None:
            try:
                outcome[i] = wal.append([f"w{i}".encode()])
            except OSError as exc:
                outcome[i] = exc

        first = threading.Thread(target=run, args=(0,))
        first.start()
        assert entered.wait(30)
        others = [threading.Thread(target=run, args=(i,)) for i in range(1, 6)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while wal._pending_records < 5:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        release.set()
        for t in [first, *others]:
            t.join(30)
        assert outcome[0] == acked[-1][0] + 1  # committed before the failure
        for i in range(1, 6):
            err = outcome[i]
            assert isinstance(err, OSError) and err.errno == errno.EIO, err
            assert not isinstance(err, WalFailedError)
        assert len(calls) == 2  # the failed sync was not retried
        with pytest.raises(WalFailedError):
            wal.append([b"after"])
        monkeypatch.setattr(os, "fdatasync", real)
    got = replay(tmp_path)
    good = [*acked, (acked[-1][0] + 1, b"w0")]
    assert got[: len(good)] == good
    assert len(got) in (len(good), len(good) + 5)  # the failed batch is all or nothing


def _fail_once(
    monkeypatch: pytest.MonkeyPatch, name: str, when: Callable[..., bool], err: int
) -> list[object]:
    """Makes the first call of ``os.<name>`` for which ``when(*args)`` holds raise ``err``."""
    real = getattr(os, name)
    failed: list[object] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if not failed and when(*args):
            failed.append(args)
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)
    return failed


def _is_temp(target: object, *_: object) -> bool:
    return str(target).endswith(".tmp")


def _fd_is_temp(fd: int, *_: object) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp")


SEGMENT_CREATION_FAILURES = {
    "EMFILE-opening-the-directory": ("open", lambda p, *_: not _is_temp(p), errno.EMFILE),
    "EMFILE-opening-the-temp-file": ("open", _is_temp, errno.EMFILE),
    "ENOSPC-writing-the-header": ("write", _fd_is_temp, errno.ENOSPC),
    "ENOSPC-syncing-the-temp-file": ("fsync", _fd_is_temp, errno.ENOSPC),
    "ENOSPC-renaming": ("rename", lambda *_: True, errno.ENOSPC),
}


@pytest.mark.parametrize("failure", sorted(SEGMENT_CREATION_FAILURES))
def test_segment_that_cannot_be_created_does_not_fail_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    """No byte of a record was written: rotate raises, but appends go on in the current
    segment, and a later rotation creates the segment."""
    name, when, err = SEGMENT_CREATION_FAILURES[failure]
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 3, random.Random(14))
        with monkeypatch.context() as m:
            failed = _fail_once(m, name, when, err)
            with (
                caplog.at_level(logging.WARNING, logger="dedupcore.wal"),
                pytest.raises(OSError) as info,
            ):
                wal.rotate()
            assert info.value.errno == err and len(failed) == 1
            assert not isinstance(info.value, WalFailedError)
            assert any("cannot create a new segment" in msg for msg in cut_warnings(caplog))
            # Still in the first segment, no temporary file left, still appending.
            assert [p.name for p in tmp_path.iterdir()] == [f"wal-{1:020d}.log"]
            acked += fill(wal, 2, random.Random(15))
            nxt = wal.rotate()  # the failure was once: this one works
        assert nxt == acked[-1][0] + 1
        assert [p.name for p in wal.segments()] == [f"wal-{1:020d}.log", f"wal-{nxt:020d}.log"]
        acked += fill(wal, 2, random.Random(16))
        assert list(wal.replay(0)) == acked
    assert replay(tmp_path) == acked


def test_automatic_rotation_that_fails_is_retried_at_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with WriteAheadLog.open(tmp_path, segment_bytes=256) as wal:
        acked = fill(wal, 1, random.Random(17), max_batch=1)
        while frames(wal.segments()[-1])[-1][2] < 256:  # the records' end, not the zeros
            acked += fill(wal, 1, random.Random(18), max_batch=1)
        with monkeypatch.context() as m:
            failed = _fail_once(m, "open", _is_temp, errno.EMFILE)
            acked += fill(wal, 1, random.Random(19))  # acknowledged, in the full segment
            assert len(failed) == 1
            assert len(wal.segments()) == 1
            acked += fill(wal, 1, random.Random(20))  # rotates first now
        assert len(wal.segments()) == 2
        seg2 = wal.segments()[1]
        assert frames(seg2)[0][0] == int(seg2.name[4:24])  # the last batch, whole
        assert frames(seg2)[-1][0] == acked[-1][0]
        assert list(wal.replay(0)) == acked
    assert replay(tmp_path) == acked


RLIMIT_CHILD = """
import errno, os, resource, sys
from dedupcore.wal import WriteAheadLog

wal = WriteAheadLog.open(sys.argv[1], segment_bytes=4096)
wal.append([b"a" * 100] * 50)  # past segment_bytes: the next commit starts a new segment
# Every descriptor below the limit in use: the next open fails with EMFILE.
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
held = [os.open(os.devnull, os.O_RDONLY)]
while held[-1] < highest:
    held.append(os.open(os.devnull, os.O_RDONLY))
top = held[-1]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
print("appended", wal.append([b"b"]), len(wal.segments()))
try:
    wal.rotate()
except OSError as exc:
    print("rotate", errno.errorcode[exc.errno])
print("appended", wal.append([b"c"]), len(wal.segments()))
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("appended", wal.append([b"d"]), len(wal.segments()))
wal.close()
"""


def test_out_of_file_descriptors_for_a_new_segment_keeps_the_log_appending(
    tmp_path: Path,
) -> None:
    """A real RLIMIT_NOFILE in a child process: no descriptor for the new segment."""
    proc = subprocess.run(
        [sys.executable, "-c", RLIMIT_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(dedupcore.__file__).parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:4] == [
        "appended 51 1",  # acknowledged in the full segment
        "rotate EMFILE",  # an explicit rotation says why, without failing the log
        "appended 52 1",
        "appended 53 2",  # descriptors again: the next commit starts the segment
    ], (proc.stdout, proc.stderr)
    assert "cannot create a new segment" in proc.stderr
    records = replay(tmp_path)
    assert [lsn for lsn, _ in records] == list(range(1, 54))
    assert [p for _, p in records[-3:]] == [b"b", b"c", b"d"]


def test_rename_that_reports_an_error_but_happened_fails_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records must never go to the current segment behind a new one claiming their LSNs."""
    real_rename = os.rename

    def rename_then_eio(src: Any, dst: Any) -> None:
        real_rename(src, dst)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 3, random.Random(22))
        with monkeypatch.context() as m:
            m.setattr(os, "rename", rename_then_eio)
            with pytest.raises(OSError, match="Input/output"):
                wal.rotate()
        with pytest.raises(WalFailedError):
            wal.append([b"x"])
    assert replay(tmp_path) == acked


def test_failed_directory_sync_after_the_rename_fails_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the segment is in place, a failed directory fsync leaves its entry's durability
    unknown: records must not go into it, so the log fails."""
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 3, random.Random(21))
        with monkeypatch.context() as m:
            _fail_once(m, "fsync", lambda fd: stat.S_ISDIR(os.fstat(fd).st_mode), errno.EIO)
            with pytest.raises(OSError, match="Input/output"):
                wal.rotate()
        with pytest.raises(WalFailedError):
            wal.append([b"x"])
    nxt = acked[-1][0] + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"wal-{1:020d}.log",
        f"wal-{nxt:020d}.log",
    ]
    with WriteAheadLog.open(tmp_path) as wal:
        assert list(wal.replay(0)) == acked
        assert wal.append([b"x"]) == nxt
    assert replay(tmp_path) == [*acked, (nxt, b"x")]


# ------------------------------------------------------------- bad input ---


def test_bad_payloads_are_refused_before_anything_is_queued(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        wal.append([b"ok"])
        with pytest.raises(TypeError, match=r"payload 1 .*not str .*encode"):
            wal.append([b"a", "text"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"payload 0 .*not int"):
            wal.append([1])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="not NoneType"):
            wal.append([None])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="single bytes"):
            wal.append(b"abc")
        with pytest.raises(TypeError, match="single str"):
            wal.append("abc")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not int"):
            wal.append(5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"payload 1 is {MAX_RECORD_BYTES + 1} bytes"):
            wal.append([b"a", bytes(MAX_RECORD_BYTES + 1)])
        assert wal.last_lsn == 1
        assert wal.append([b"next"]) == 2
    assert replay(tmp_path) == [(1, b"ok"), (2, b"next")]


def test_a_bad_payload_is_named_before_a_closed_log(tmp_path: Path) -> None:
    # The payload's fault comes first, as the caller's bug, whatever the log's state.
    wal = WriteAheadLog.open(tmp_path)
    wal.close()
    for call in (wal.append, wal.write):
        with pytest.raises(TypeError, match=r"payload 1 .*not int"):
            call([b"ok", 5])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"payload 0 .*not str"):
            call(("text",))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="closed"):
            call([b"ok"])
    with WriteAheadLog.open(tmp_path, readonly=True) as ro:
        with pytest.raises(TypeError, match=r"payload 0 .*not NoneType"):
            ro.write([None])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="read-only"):
            ro.write([b"ok"])


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'fdatasync'.*'none'"):
        WriteAheadLog.open(tmp_path, sync="fsync")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sync must be a str"):
        WriteAheadLog.open(tmp_path, sync=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="segment_bytes"):
        WriteAheadLog.open(tmp_path, segment_bytes=10)
    with WriteAheadLog.open(tmp_path) as wal:
        with pytest.raises(ValueError, match="after_lsn"):
            wal.replay(-1)
        with pytest.raises(TypeError, match="after_lsn must be an int"):
            wal.replay("1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="lsn must be an int"):
            wal.drop_through(1.0)  # type: ignore[arg-type]


def test_closed_log_refuses_calls_and_close_is_idempotent(tmp_path: Path) -> None:
    wal = WriteAheadLog.open(tmp_path / "new" / "nested")
    assert (tmp_path / "new" / "nested").is_dir()
    wal.append([b"a"])
    wal.close()
    wal.close()
    assert wal.closed
    for call in (lambda: wal.append([b"x"]), lambda: wal.replay(0), wal.rotate, wal.sync):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert "closed" in repr(wal)


# ------------------------------------------------------- the zero-filled tail ---
# dedupcore/wal/__init__.py, "The zero-filled tail".

ZERO_FILL_MIN = 64 << 10


def test_small_commits_land_on_zeros_written_ahead_of_them(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        acked = fill(wal, 1, random.Random(30), max_batch=1)
        (seg,) = wal.segments()
        # The first commit wrote zeros from the header to 64 KiB past the records' start.
        length = seg.stat().st_size
        assert length == HEADER_SIZE + ZERO_FILL_MIN
        end = records_end(seg)
        assert end < length and not any(seg.read_bytes()[end:])
        # The commits after it overwrite those zeros: the file does not grow...
        while records_end(seg) + 200 < length:
            acked += fill(wal, 1, random.Random(len(acked)), max_batch=1)
            assert seg.stat().st_size == length
        # ...until they pass them: then the next fill, as large as the segment holds.
        while seg.stat().st_size == length:
            acked += fill(wal, 1, random.Random(len(acked)), max_batch=1)
        end = records_end(seg)
        assert seg.stat().st_size > end and not any(seg.read_bytes()[end:])
        assert list(wal.replay(0)) == acked
    length = seg.stat().st_size
    assert replay(tmp_path) == acked  # closed, opened again: the zeros stay, quietly
    assert seg.stat().st_size == length


def test_no_zeros_without_fdatasync_nor_for_a_large_commit(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path / "none", sync="none") as wal:
        fill(wal, 3, random.Random(31))
        (seg,) = wal.segments()
        assert seg.stat().st_size == records_end(seg)  # nothing to save without fdatasync
    with WriteAheadLog.open(tmp_path / "large") as wal:
        wal.append([b"L" * (ZERO_FILL_MIN // 2 + 1)])  # more than half a fill
        (seg,) = wal.segments()
        assert seg.stat().st_size == records_end(seg)  # it extended the file itself
        before = records_end(seg)
        wal.append([b"s"])  # a small one after it: zeros as far past as the segment holds
        assert seg.stat().st_size == before + max(before, ZERO_FILL_MIN)


def test_segments_keep_their_zeros_and_replay_through_them(tmp_path: Path) -> None:
    """No file of the log gets shorter while it is in use (a reader may have it mapped):
    a segment keeps the zeros after its last record when the next one is created."""
    with WriteAheadLog.open(tmp_path, segment_bytes=1000) as wal:
        acked = fill(wal, 40, random.Random(32), max_batch=3)
        segs = wal.segments()
        assert len(segs) > 3
        for seg in segs:
            end = records_end(seg)
            assert seg.stat().st_size > end and not any(seg.read_bytes()[end:]), seg.name
        nxt = wal.rotate()
        later = fill(wal, 2, random.Random(33))
        assert later[0][0] == nxt
        acked += later
        assert list(wal.replay(0)) == acked
    assert replay(tmp_path) == acked


def test_the_native_commit_thread_writes_on_zeros_too(tmp_path: Path) -> None:
    with WriteAheadLog.open(tmp_path) as wal:
        lsn = wal.write([b"n" * 40])
        assert wal.start_commit()
        assert wal.sync(lsn) == lsn
        (seg,) = wal.segments()
        assert seg.stat().st_size == HEADER_SIZE + ZERO_FILL_MIN
        assert wal.finish_commit()
        lsn = wal.write([b"m" * 40])
        assert wal.start_commit()
        assert wal.sync(lsn) == lsn and wal.finish_commit()
        assert seg.stat().st_size == HEADER_SIZE + ZERO_FILL_MIN  # it landed on the zeros
    assert replay(tmp_path) == [(1, b"n" * 40), (2, b"m" * 40)]


def test_a_crash_leaves_zeros_that_opening_keeps_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed with its log open leaves the last segment ending in zeros: they
    hold nothing of a record, so opening keeps them (a debug message, no warning), and
    the appends go on over them."""
    path = tmp_path / "log"
    script = (
        "import os, sys\n"
        "from dedupcore.wal import WriteAheadLog\n"
        "wal = WriteAheadLog.open(sys.argv[1])\n"
        "for i in range(1, 31):\n"
        "    wal.append([b'r%d' % i])\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], check=False)
    assert done.returncode == -9
    (seg,) = path.glob("wal-*.log")
    length = seg.stat().st_size
    assert length > records_end(seg)  # zeros after the records
    with caplog.at_level(logging.DEBUG, logger="dedupcore.wal"), WriteAheadLog.open(path) as wal:
        assert list(wal.replay(0)) == [(i, b"r%d" % i) for i in range(1, 31)]
        assert seg.stat().st_size == length  # kept
        assert wal.append([b"after"]) == 31
        assert seg.stat().st_size == length  # on the zeros
    assert not cut_warnings(caplog)
    (msg,) = cut_warnings(caplog, logging.DEBUG)
    assert "zeros after LSN 30" in msg and "kept for the appends" in msg
    assert replay(path)[-1] == (31, b"after")


def test_a_zero_fill_that_fails_is_given_up_for_the_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def full(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with WriteAheadLog.open(tmp_path, segment_bytes=2000) as wal:
        monkeypatch.setattr(os, "pwrite", full)
        acked = fill(wal, 5, random.Random(34), max_batch=2)  # acknowledged all the same
        assert len(calls) == 1  # tried once in this segment, not at every commit
        (seg,) = wal.segments()
        assert seg.stat().st_size == records_end(seg)
        while len(wal.segments()) == 1:
            acked += fill(wal, 1, random.Random(len(acked)), max_batch=2)
        assert len(calls) == 2  # a new segment tries again
        monkeypatch.undo()
        acked += fill(wal, 2, random.Random(35))
        assert list(wal.replay(0)) == acked
    assert replay(tmp_path) == acked


def _in_flight(tmp_path: Path) -> tuple[Path, Path, bytes, Records]:
    """A log as a read-only open can catch its owner writing a commit of two records
    over its zeros: the first record's bytes still zero, the second's written."""
    src = tmp_path / "src"
    with WriteAheadLog.open(src) as wal:
        records = fill(wal, 3, random.Random(36))
    cut_zeros(src)
    (seg,) = src.glob("wal-*.log")
    whole = seg.read_bytes()
    nxt = records[-1][0] + 1
    commit = frame(nxt, b"first") + frame(nxt + 1, b"second")
    done = whole + commit + bytes(4096)
    torn = whole + bytes(len(frame(nxt, b"first"))) + frame(nxt + 1, b"second") + bytes(4096)
    seg.write_bytes(torn)
    return src, seg, done, [*records, (nxt, b"first"), (nxt + 1, b"second")]


def test_a_read_only_open_scans_again_past_a_commit_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dedupcore.wal.segments as segments

    src, seg, done, records = _in_flight(tmp_path)
    pauses: list[float] = []

    def owner_finishes(seconds: float) -> None:
        pauses.append(seconds)
        seg.write_bytes(done)  # the owner's write, finished during the pause

    monkeypatch.setattr(segments.time, "sleep", owner_finishes)
    with WriteAheadLog.open(src, readonly=True) as wal:
        assert list(wal.replay(0)) == records
    assert pauses == [segments.READONLY_RESCAN_PAUSE]


def test_damage_that_stays_is_reported_by_a_read_only_open_after_two_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dedupcore.wal.segments as segments

    src, seg, _done, _records = _in_flight(tmp_path)
    before = seg.read_bytes()
    pauses: list[float] = []
    monkeypatch.setattr(segments.time, "sleep", pauses.append)
    with pytest.raises(CorruptFileError, match="not a torn tail"):
        WriteAheadLog.open(src, readonly=True)
    assert len(pauses) == 1  # found alike twice in a row: damage
    pauses.clear()
    with pytest.raises(CorruptFileError, match="not a torn tail"):
        WriteAheadLog.open(src)  # the owner's open: nobody else writes, one scan
    assert pauses == [] and seg.read_bytes() == before


def test_a_read_only_open_does_not_take_a_listing_that_missed_a_segment_for_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory listing need not return an entry added while it runs: while the
    owner rotates, one listing can miss a segment and list a later one. A read-only
    open lists again and keeps what that listing holds up to the newest segment the
    first one saw, so it reads every record of that prefix instead of reporting the
    missed segment's records lost; a segment the second listing adds is left out."""
    import dedupcore.wal.segments as segments

    rng = random.Random(3)
    with WriteAheadLog.open(tmp_path, segment_bytes=600) as wal:
        expected = fill(wal, 60, rng)
        names = sorted(p.name for p in wal.segments())
    assert len(names) > 4
    real = os.listdir
    listings: list[list[str]] = []

    def listdir(path: Any) -> list[str]:
        got = real(path)
        if Path(path) != tmp_path:
            return got
        listings.append(got)
        if len(listings) == 1:  # the first listing missed the third segment
            return [n for n in got if n != names[2]]
        return [*got, "wal-99999999999999999999.log"]  # the owner rotated meanwhile

    monkeypatch.setattr(segments.os, "listdir", listdir)
    with WriteAheadLog.open(tmp_path, readonly=True) as view:
        assert list(view.replay(0)) == expected
        assert [p.name for p in view.segments()] == names
    assert len(listings) == 2
    # The owner lists once: it is the only one that puts segments in place.
    owner_listings: list[str] = []

    def counted(path: Any) -> list[str]:
        owner_listings.append(str(path))
        return real(path)

    monkeypatch.setattr(segments.os, "listdir", counted)
    with WriteAheadLog.open(tmp_path) as wal:
        assert list(wal.replay(0)) == expected
    assert owner_listings.count(str(tmp_path)) == 1


def test_read_only_opens_while_the_owner_appends_over_its_zeros(tmp_path: Path) -> None:
    """A real owner process appends batches (fdatasync, so over zeros written ahead)
    while this process opens the log read-only again and again: every open succeeds
    and reads a prefix of what the owner logs, whole."""
    path = tmp_path / "log"
    argv = [sys.executable, str(CHILD), str(path), "fdatasync", "37"]
    with LineProcess(argv, name="wal_child.py") as child:
        ready = child.next_line(60)
        assert ready is not None and ready.startswith("ready"), child.stderr()
        seen = 0
        for _ in range(20):
            line = child.next_line(60)  # the owner acknowledged more
            assert line is not None, child.stderr()
            with WriteAheadLog.open(path, readonly=True) as wal:
                got = list(wal.replay(0))
            assert [lsn for lsn, _ in got] == list(range(1, len(got) + 1))
            assert all(payload == payload_for(lsn) for lsn, payload in got)
            assert len(got) >= max(seen, int(line))  # what it acknowledged is there
            seen = len(got)
        child.sigkill()


_MAPPING_READER = """
import mmap, sys
with open(sys.argv[1], "rb") as fh:
    view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", len(view), flush=True)
sys.stdin.readline()  # the owner's open has cut the torn tail
print("read", sum(view[i] for i in range(0, len(view), 512)), flush=True)
"""


def test_cutting_a_torn_tail_does_not_pull_the_file_from_under_a_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner's open turns a torn tail into zeros in place: a process that has the
    segment mapped (a read-only open, ``dedupcore check``) reads on to the end it
    mapped; a cut by truncation made that read die of SIGBUS."""
    src, records = _log_with_last_record(tmp_path)
    (seg,) = src.iterdir()
    end = seg.stat().st_size
    with open(seg, "ab") as fh:
        fh.write(b"\xab" * 9000)  # a torn tail over more than one page
    argv = [sys.executable, "-c", _MAPPING_READER, str(seg)]
    with LineProcess(argv, stdin=True, name="mapping reader") as reader:
        assert int(reader.expect("mapped ")) == end + 9000, reader.stderr()
        with caplog.at_level(logging.WARNING, logger="dedupcore.wal"):
            assert replay(src) == records  # the owner's open, which cuts the tail
        (msg,) = cut_warnings(caplog)
        assert "dropped 9000 bytes" in msg
        reader.send("go")
        assert reader.expect("read ").isdigit(), reader.stderr()
        assert reader.wait() == 0, reader.stderr()
    data = seg.read_bytes()
    assert len(data) == end + 9000 and not any(data[end:])


# ----------------------------------------------------- sync="none" write-through ---


def test_without_fdatasync_a_small_write_is_written_and_acknowledged_at_once(
    tmp_path: Path,
) -> None:
    from dedupcore.wal.log import WRITE_THROUGH_BYTES

    with WriteAheadLog.open(tmp_path, sync="none") as wal:
        lsn = wal.write([b"small"])
        assert wal.last_lsn == lsn == 1 and wal.commits == 1  # no commit left to lead
        with WriteAheadLog.open(tmp_path, readonly=True) as reader:  # in the file already
            assert list(reader.replay(0)) == [(1, b"small")]
        big = b"B" * (WRITE_THROUGH_BYTES + 1)
        lsn = wal.write([big])  # a large queue waits for a commit, written outside the lock
        assert wal.last_lsn == 1 and wal.commits == 1
        assert wal.sync(lsn) == lsn == 2 and wal.commits == 2
    with WriteAheadLog.open(tmp_path / "durable") as wal:  # fdatasync: always a commit
        lsn = wal.write([b"small"])
        assert wal.last_lsn == 0
        assert wal.sync(lsn) == 1
    assert replay(tmp_path) == [(1, b"small"), (2, big)]


def test_a_write_through_that_fails_fails_the_log_and_acknowledges_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with WriteAheadLog.open(tmp_path, sync="none") as wal:
        acked = fill(wal, 2, random.Random(40))

        def full(fd: int, data: object) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", full)
        lsn = wal.write([b"lost"])  # queued and tried: the failure shows in sync
        monkeypatch.undo()
        assert wal.last_lsn == acked[-1][0]
        with pytest.raises(OSError, match="not acknowledged") as info:
            wal.sync(lsn)
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(WalFailedError):
            wal.write([b"after"])
    assert replay(tmp_path) == acked
