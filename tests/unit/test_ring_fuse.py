"""BloomRing.compact: sealed slices rebuilt as binary fuse filters from their key logs.

The rebuild must never lose a key: a damaged, short or missing key log leaves
the slice's Bloom filters in place, a crash at any step leaves a ring that
opens and holds every key it acknowledged, and a read-only open touches
nothing on disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dedupcore import BloomRing
from dedupcore.errors import CorruptFileError, UnsupportedFormatError
from dedupcore.fuse import FUSE_HEADER_SIZE, LOG_HEAD, KeyLog, fuse_file_params, open_fuse
from dedupcore.tiers.archive import ColdArchive

Keys = Callable[..., list[bytes]]


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def kinds(ring: BloomRing) -> list[tuple[int, str]]:
    return [(s.bucket, s.kind) for s in ring.slices()]


def _ring(path: Path | None, capacity: int = 500) -> BloomRing:
    return BloomRing(
        window=10.0,
        slice_seconds=2.0,
        slice_capacity=capacity,
        error_rate=0.001,
        seed=7,
        path=path,
        key_logs=True,
    )


def _filled(path: Path | None, make_keys: Keys) -> tuple[BloomRing, list[bytes]]:
    """Buckets 0 (grown into two sub-filters), 1 and 2 (the head), saved."""
    ring = _ring(path)
    keys: list[bytes] = []
    for now, n in ((0.0, 700), (0.5, 100), (3.0, 200), (5.5, 300)):
        batch = make_keys(n, f"t{now}")
        ring.add_many(batch, now=now)
        keys += batch
        if path is not None:
            ring.save()
    return ring, keys


def test_compact_rebuilds_sealed_slices_and_keeps_every_key(
    tmp_path: Path, make_keys: Keys
) -> None:
    ring, keys = _filled(tmp_path, make_keys)
    before = [s.nbytes for s in ring.slices()]
    assert ring.compact() == 2  # buckets 0 and 1; the head (2) takes keys still
    assert kinds(ring) == [(0, "fuse"), (1, "fuse"), (2, "bloom")]
    assert all(ring.contains_many(keys))
    assert all(k in ring for k in keys)
    infos = ring.slices()
    assert [s.count for s in infos[:2]] == [800, 200]
    assert infos[0].subfilters == 0 and infos[0].sealed
    assert infos[0].nbytes < before[0] and infos[1].nbytes < before[1]
    assert infos[0].estimated_fpr == 2.0**-16
    assert (tmp_path / "slice-2.keys").stat().st_mode & 0o777 == 0o600
    assert files(tmp_path) == [
        "ring.json",
        "slice-0.fuse",
        "slice-1.fuse",
        "slice-2-0.bloom",
        "slice-2.keys",
    ]
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    assert manifest["slices"][0] == {"bucket": 0, "kind": "fuse", "sealed": True}
    assert ring.compact() == 0  # nothing left to rebuild

    reopened = BloomRing.open(tmp_path)
    assert kinds(reopened) == kinds(ring)
    assert all(reopened.contains_many(keys))
    assert [s.count for s in reopened.slices()] == [s.count for s in infos]


def test_rebuilt_slice_takes_no_keys_and_answers_add_many(tmp_path: Path, make_keys: Keys) -> None:
    ring, keys = _filled(tmp_path, make_keys)
    ring.compact()
    old = make_keys(700, "t0.0")  # held by the rebuilt slice 0
    fresh = make_keys(50, "fresh")
    flags = ring.add_many(old[:20] + fresh, now=5.9)
    assert list(flags) == [False] * 20 + [True] * 50
    assert ring.add(old[0], now=5.9) is False
    assert all(ring.contains_many(keys + fresh))


def test_rebuilt_slices_expire_with_their_files(tmp_path: Path, make_keys: Keys) -> None:
    ring, _ = _filled(tmp_path, make_keys)
    ring.compact()
    assert ring.expire(12.0) == 1  # bucket 0: (0 + 1) * 2 + 10 <= 12
    assert "slice-0.fuse" not in files(tmp_path)
    assert kinds(BloomRing.open(tmp_path)) == [(1, "fuse"), (2, "bloom")]


def test_memory_ring_and_head_are_never_rebuilt(make_keys: Keys, tmp_path: Path) -> None:
    ring, _ = _filled(None, make_keys)
    assert ring.compact() == 0
    assert {k for _, k in kinds(ring)} == {"bloom"}
    # A persisted ring keeps key logs only when asked (the front filter does not).
    plain = BloomRing(window=10.0, slice_seconds=2.0, slice_capacity=100, path=tmp_path / "plain")
    plain.add_many(make_keys(10), now=0.0)
    plain.add_many(make_keys(10, "b"), now=3.0)
    plain.save()
    assert not list((tmp_path / "plain").glob("*.keys")) and plain.compact() == 0
    assert BloomRing.open(tmp_path / "plain").key_logs is False
    assert BloomRing.open(tmp_path / "plain", key_logs=True).key_logs is True
    single = _ring(tmp_path / "single")
    single.add_many(make_keys(100), now=0.0)
    single.save()
    assert single.compact() == 0
    assert kinds(single) == [(0, "bloom")]


def _two_slice_ring(path: Path) -> BloomRing:
    """A persisted ring of slices of 5 s over a window of 10 s, with key logs."""
    return BloomRing(
        window=10.0,
        slice_seconds=5.0,
        slice_capacity=1000,
        error_rate=0.001,
        path=path,
        key_logs=True,
    )


def test_bytes_per_key_of_a_large_rebuilt_slice(tmp_path: Path) -> None:
    ring = _two_slice_ring(tmp_path)
    rng = np.random.default_rng(11)
    hashes = rng.integers(0, 2**64, size=300_000, dtype=np.uint64)
    ring.insert_many(memoryview(hashes), now=0.0, expected=len(hashes))
    ring.insert_many(memoryview(hashes[:10]), now=6.0)
    ring.save()
    bloom = ring.slices()[0].nbytes / 300_000
    assert ring.compact() == 1
    fuse = ring.slices()[0].nbytes / 300_000
    assert fuse <= 2.4 < bloom, (fuse, bloom)
    assert all(ring.contains_many(memoryview(hashes)))
    absent = rng.integers(0, 2**64, size=200_000, dtype=np.uint64)
    hits = sum(ring.contains_many(memoryview(absent)))
    # Both slices answer: the fuse slice at 2**-16, the head's Bloom filter its share.
    assert hits / len(absent) < 0.001


# -- a key log that cannot vouch for its keys -----------------------------------


def _chunk_bounds(path: Path) -> list[tuple[int, int]]:
    """(start, end) of each chunk of a key log."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        _, _, n = LOG_HEAD.unpack_from(data, pos)
        end = pos + LOG_HEAD.size + 8 * n + 8
        out.append((pos, end))
        pos = end
    return out


@pytest.mark.parametrize("damage", ["flip-first-chunk", "truncate-committed", "delete"])
def test_damaged_key_log_leaves_the_bloom_slice(
    tmp_path: Path, make_keys: Keys, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    ring, keys = _filled(first, make_keys)
    log_file = first / "slice-0.keys"
    assert len(_chunk_bounds(log_file)) == 2  # two batches went into bucket 0
    if damage == "flip-first-chunk":
        data = bytearray(log_file.read_bytes())
        data[LOG_HEAD.size + 3] ^= 0x01
        log_file.write_bytes(bytes(data))
    elif damage == "truncate-committed":
        start, _ = _chunk_bounds(log_file)[1]
        with open(log_file, "r+b") as fh:
            fh.truncate(start + 20)
    else:
        log_file.unlink()
    shutil.copytree(first, second)
    for subject in (ring, BloomRing.open(second)):
        with caplog.at_level(logging.WARNING, logger="dedupcore.bloom"):
            assert subject.compact() == 1  # bucket 1 only
        assert kinds(subject) == [(0, "bloom"), (1, "fuse"), (2, "bloom")]
        assert all(subject.contains_many(keys))
        if damage != "delete":  # a reopened ring without the file has no log to try
            assert "stays a Bloom filter" in caplog.text
        caplog.clear()
    for root in (first, second):
        assert "slice-0-0.bloom" in files(root)
        assert all(BloomRing.open(root).contains_many(keys))


def test_torn_tail_of_the_head_log_is_cut_at_open(tmp_path: Path, make_keys: Keys) -> None:
    _, keys = _filled(tmp_path, make_keys)
    head_log = tmp_path / "slice-2.keys"
    good = head_log.read_bytes()
    with open(head_log, "ab") as fh:  # a crash in the middle of an append
        fh.write(LOG_HEAD.pack(b"DKLG", 0, 100) + b"\x01" * 50)
    reopened = BloomRing.open(tmp_path)
    assert head_log.read_bytes() == good
    more = make_keys(40, "after")
    reopened.add_many(more, now=5.8)
    reopened.save()
    reopened.add_many(make_keys(5, "next"), now=6.5)  # seals bucket 2
    reopened.save()
    assert reopened.compact() == 3
    assert all(reopened.contains_many(keys + more))


def test_head_log_shorter_than_the_manifest_says(
    tmp_path: Path, make_keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    _, keys = _filled(tmp_path, make_keys)
    head_log = tmp_path / "slice-2.keys"
    with open(head_log, "r+b") as fh:
        fh.truncate(LOG_HEAD.size + 8)
    with caplog.at_level(logging.WARNING, logger="dedupcore.bloom"):
        reopened = BloomRing.open(tmp_path)
    assert "cannot prove" in caplog.text
    reopened.add_many(make_keys(5, "next"), now=6.5)  # seals bucket 2 without a log
    reopened.save()
    assert reopened.compact() == 2
    assert kinds(reopened) == [(0, "fuse"), (1, "fuse"), (2, "bloom"), (3, "bloom")]
    assert all(reopened.contains_many(keys))


# -- fuse files ----------------------------------------------------------------


@pytest.mark.parametrize(
    "damage", ["body", "header", "truncate-body", "truncate-header", "magic", "version"]
)
def test_damaged_fuse_file_is_an_error(tmp_path: Path, make_keys: Keys, damage: str) -> None:
    ring, _ = _filled(tmp_path, make_keys)
    ring.compact()
    path = tmp_path / "slice-1.fuse"
    data = bytearray(path.read_bytes())
    if damage == "body":
        data[FUSE_HEADER_SIZE + 5] ^= 0x10
    elif damage == "header":
        data[24] ^= 0x01  # the count
    elif damage == "truncate-body":
        data = data[:-2]
    elif damage == "truncate-header":
        data = data[:100]
    elif damage == "magic":
        data[:8] = b"NOTAFUSE"
    else:
        data[8] = 9
    path.write_bytes(bytes(data))
    expected = UnsupportedFormatError if damage == "version" else CorruptFileError
    with pytest.raises(expected, match=r"slice-1\.fuse"):
        BloomRing.open(tmp_path)
    if damage == "body":
        BloomRing.open(tmp_path, verify=False)  # the body checksum is read only when asked


def test_missing_fuse_file_is_an_error(tmp_path: Path, make_keys: Keys) -> None:
    ring, _ = _filled(tmp_path, make_keys)
    ring.compact()
    (tmp_path / "slice-0.fuse").unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        BloomRing.open(tmp_path)


def test_fuse_file_round_trip(tmp_path: Path, make_keys: Keys) -> None:
    ring, _ = _filled(tmp_path, make_keys)
    ring.compact()
    fuse, seed = open_fuse(tmp_path / "slice-0.fuse")  # read into memory of its own
    assert seed == 7 and fuse.count == 800
    mapped, _ = open_fuse(tmp_path / "slice-0.fuse", mmap=True)
    assert bytes(memoryview(mapped)) == bytes(memoryview(fuse))
    assert fuse_file_params(tmp_path / "slice-0.fuse") == (fuse.params, 800)
    (tmp_path / "bad.fuse").write_bytes(b"DEDUPFUS" + bytes(200))
    with pytest.raises(CorruptFileError):
        fuse_file_params(tmp_path / "bad.fuse")
    ring2 = BloomRing.open(tmp_path)
    assert ring2.slices()[0].nbytes == fuse.nbytes


@pytest.mark.parametrize(
    "entry",
    [
        {"bucket": 0, "kind": "fuse", "sealed": False},
        {"bucket": 0, "kind": "cuckoo", "sealed": True},
        {"bucket": 0, "subfilters": 2, "sealed": True, "keys": -1},
        {"bucket": 0, "subfilters": 2, "sealed": True, "keys": "800"},
    ],
)
def test_damaged_manifest_entries(
    tmp_path: Path, make_keys: Keys, entry: dict[str, object]
) -> None:
    _filled(tmp_path, make_keys)
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    manifest["slices"][0] = entry
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError, match="ring manifest"):
        BloomRing.open(tmp_path)


def test_format_1_manifest_opens_without_key_logs(tmp_path: Path, make_keys: Keys) -> None:
    _, keys = _filled(tmp_path, make_keys)
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    manifest["format"] = 1
    for entry in manifest["slices"]:
        entry.pop("keys")
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    for name in ("slice-0.keys", "slice-1.keys", "slice-2.keys"):
        (tmp_path / name).unlink()
    reopened = BloomRing.open(tmp_path)
    assert all(reopened.contains_many(keys))
    assert reopened.compact() == 0  # no log: the slices stay Bloom filters
    reopened.add_many(make_keys(5, "late"), now=5.9)
    reopened.save()
    assert json.loads((tmp_path / "ring.json").read_bytes())["format"] == 2


def test_newest_slice_rebuilt_takes_late_keys_in_a_new_slice(
    tmp_path: Path, make_keys: Keys
) -> None:
    ring, keys = _filled(tmp_path, make_keys)
    ring.compact()
    manifest = json.loads((tmp_path / "ring.json").read_bytes())
    manifest["slices"] = manifest["slices"][:2]  # slice 1 (a fuse) is now the newest
    (tmp_path / "ring.json").write_text(json.dumps(manifest))
    reopened = BloomRing.open(tmp_path)
    late = make_keys(10, "late")
    reopened.add_many(late, now=2.5)  # bucket 1, read-only: goes to bucket 2
    assert kinds(reopened) == [(0, "fuse"), (1, "fuse"), (2, "bloom")]
    assert all(reopened.contains_many(late + keys[:1000]))


def test_readonly_open_touches_nothing(tmp_path: Path, make_keys: Keys) -> None:
    ring, keys = _filled(tmp_path, make_keys)
    ring.compact()
    (tmp_path / "slice-1-0.bloom").write_bytes(b"left by a crash")
    with open(tmp_path / "slice-2.keys", "ab") as fh:
        fh.write(b"torn")
    before = {name: (tmp_path / name).read_bytes() for name in files(tmp_path)}
    view = BloomRing.open(tmp_path, readonly=True)
    assert all(view.contains_many(keys))
    assert {name: (tmp_path / name).read_bytes() for name in files(tmp_path)} == before
    archive_root = tmp_path / "archive"
    archive = ColdArchive(archive_root, [10.0])
    archive.add_many(10.0, memoryview(np.arange(1, 100, dtype=np.uint64)), 0.0)
    archive.add_many(10.0, memoryview(np.arange(100, 200, dtype=np.uint64)), 2.0)
    assert ColdArchive(archive_root, [10.0], readonly=True).compact() == 0
    assert archive.compact() == 1
    BloomRing.open(tmp_path)  # a writer cleans up what the crash left
    assert "slice-1-0.bloom" not in files(tmp_path)


def test_probes_go_on_while_a_slice_is_rebuilt(tmp_path: Path) -> None:
    ring = _two_slice_ring(tmp_path)
    hashes = np.random.default_rng(3).integers(0, 2**64, size=400_000, dtype=np.uint64)
    ring.insert_many(memoryview(hashes), now=0.0, expected=len(hashes))
    ring.insert_many(memoryview(hashes[:1]), now=6.0)
    ring.save()
    sample = np.ascontiguousarray(hashes[::97])
    stop = threading.Event()
    misses: list[int] = []
    rounds = [0]

    def probe() -> None:
        while not stop.is_set() or rounds[0] < 3:
            flags = ring.contains_many(memoryview(sample))
            misses.append(len(flags) - sum(flags))
            rounds[0] += 1

    threads = [threading.Thread(target=probe) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        assert ring.compact() == 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert kinds(ring) == [(0, "fuse"), (1, "bloom")]
    assert rounds[0] >= 3 and set(misses) == {0}


# -- stacks: sealed slices side by side ------------------------------------------


def _bucket_hashes(bucket: int, n: int = 20_000) -> np.ndarray:
    """Fixed hashes for a bucket (every rebuild of them works with its first seed)."""
    return np.random.default_rng(bucket).integers(0, 2**64, size=n, dtype=np.uint64)


def _sealed(path: Path, sizes: list[int]) -> tuple[BloomRing, list[np.ndarray]]:
    """A ring (window 10 s, slices of 2 s: at most five sealed slices live) whose
    buckets 0.. took ``sizes`` hashes, the last of them the head, saved."""
    ring = _ring(path)
    sets = []
    for bucket, n in enumerate(sizes):
        hashes = _bucket_hashes(bucket, n)
        ring.insert_many(memoryview(hashes), now=bucket * 2.0 + 0.1, expected=n)
        sets.append(hashes)
    ring.save()
    return ring, sets


def _holds(ring: BloomRing, hashes: np.ndarray) -> float:
    return float(np.frombuffer(ring.contains_many(memoryview(hashes)), dtype=bool).mean())


def test_sealed_slices_of_one_geometry_share_a_stack(tmp_path: Path) -> None:
    ring, sets = _sealed(tmp_path, [20_000] * 6)
    assert ring.compact() == 5
    infos = ring.slices()
    assert [(s.kind, s.stacked) for s in infos] == [("fuse", True)] * 5 + [("bloom", False)]
    (stack,) = ring.stacks()
    assert stack == {"width": 5, "live": 5, "nbytes": 5 * infos[0].nbytes}
    assert ring.nbytes == stack["nbytes"] + infos[-1].nbytes
    assert len(ring) == sum(s.count for s in infos)
    assert all(_holds(ring, hashes) == 1.0 for hashes in sets)
    fresh = np.random.default_rng(99).integers(0, 2**64, size=200_000, dtype=np.uint64)
    assert _holds(ring, fresh) < 0.01  # the head's Bloom filter and five columns
    for reopened in (BloomRing.open(tmp_path), BloomRing.open(tmp_path, readonly=True)):
        assert reopened.stacks() == [stack]
        assert [(s.kind, s.stacked) for s in reopened.slices()] == [
            (s.kind, s.stacked) for s in infos
        ]
        assert all(_holds(reopened, hashes) == 1.0 for hashes in sets)
    archive = ColdArchive(None, [10.0])
    archive.rings[10.0] = ring
    assert archive.stats()["10"]["stacks"] == [stack]


def test_open_stacks_each_fuse_slice_before_it_reads_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An archive's slices are read one at a time into stacks of their final width:
    # never two bodies of a slice in memory, never a stack copied to grow.
    _sealed(tmp_path, [20_000] * 6)[0].compact()
    loose_bodies: list[int] = []
    widths: list[list[int]] = []
    opened = BloomRing._open_fuse_slice

    def watch(ring: BloomRing, bucket: int, verify: bool, readonly: bool) -> object:
        loose_bodies.append(sum(s.kind == "fuse" and not s.stacked for s in ring.slices()))
        widths.append([st["width"] for st in ring.stacks()])
        return opened(ring, bucket, verify, readonly)

    monkeypatch.setattr(BloomRing, "_open_fuse_slice", watch)
    ring = BloomRing.open(tmp_path)
    assert loose_bodies == [0] * 5
    assert widths == [[], [5], [5], [5], [5]]
    assert ring.stacks()[0] | {"nbytes": 0} == {"width": 5, "live": 5, "nbytes": 0}


def test_a_full_stack_leaves_a_slice_loose_until_a_column_frees(tmp_path: Path) -> None:
    # A ring never has more sealed slices live than its widest stack (the head's
    # start expires the oldest); a stack at most three wide stands in for the
    # moments when it does (a clock set back, a ring reopened late).
    ring, sets = _sealed(tmp_path, [20_000] * 6)
    ring.fuse_stacks.max_width = 3
    assert ring.compact() == 5
    (stack,) = ring.stacks()
    assert (stack["width"], stack["live"]) == (3, 3)
    infos = ring.slices()
    assert [s.stacked for s in infos] == [True] * 3 + [False] * 3
    assert [s.kind for s in infos] == ["fuse"] * 5 + ["bloom"]  # two probed on their own
    assert all(_holds(ring, hashes) == 1.0 for hashes in sets)
    assert ring.expire(14.1) == 2  # buckets 0 and 1: their columns stop answering
    assert ring.stacks()[0]["live"] == 1
    assert _holds(ring, sets[0]) < 0.01 and _holds(ring, sets[1]) < 0.01
    assert ring.compact() == 0  # nothing to rebuild; the loose slices take the columns
    assert ring.stacks() == [stack]
    assert [s.stacked for s in ring.slices()] == [True] * 3 + [False]
    assert all(_holds(ring, hashes) == 1.0 for hashes in sets[2:])


def test_a_slice_of_another_geometry_gets_a_stack_of_its_own(tmp_path: Path) -> None:
    # 19,000 keys fit the 20,000-key geometry (a few percent more slots than their
    # own); 200,000 need another segment length.
    ring, sets = _sealed(tmp_path, [20_000, 200_000, 19_000, 10])
    assert ring.compact() == 3
    assert sorted(st["width"] for st in ring.stacks()) == [1, 2]
    assert all(_holds(ring, hashes) == 1.0 for hashes in sets)
    reopened = BloomRing.open(tmp_path)
    assert sorted(st["width"] for st in reopened.stacks()) == [1, 2]
    assert all(_holds(reopened, hashes) == 1.0 for hashes in sets)


# -- crashes of real processes ---------------------------------------------------

_CHILD = r"""
import os, signal, sys
import numpy as np
import dedupcore.ring as bloom
import dedupcore.fuse as fuse
from dedupcore import BloomRing

path, point = sys.argv[1], sys.argv[2]
ring = BloomRing(window=10.0, slice_seconds=5.0, slice_capacity=1000, error_rate=0.001,
                 path=path, key_logs=True)
first = np.arange(1, 50_001, dtype=np.uint64)
ring.insert_many(memoryview(first), now=0.0)
ring.save()
second = np.arange(50_001, 50_101, dtype=np.uint64)
ring.insert_many(memoryview(second), now=6.0)  # seals slice 0
ring.save()
print("ACK", flush=True)

def die(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "before-manifest":     # the fuse file is durable, the manifest still old
    save = bloom.atomic_write
    def save_then_die(p, chunks):
        save(p, chunks)
        if str(p).endswith(".fuse"):
            die()
    bloom.atomic_write = save_then_die
elif point == "before-unlink":     # the manifest names the fuse file, old files remain
    bloom._unlink_quiet = die
elif point == "mid-fuse-write":    # the fuse file half written (its temp file)
    def half(p, chunks):
        tmp = os.path.join(os.path.dirname(p), "." + os.path.basename(p) + ".x1.tmp")
        with open(tmp, "wb") as out:
            out.write(b"DEDUPFUS" + b"\0" * 40)
        die()
    bloom.atomic_write = half
elif point == "mid-log-append":    # a key log chunk half written
    def torn(self, hashes):
        with open(self.path, "ab") as fh:
            fh.write(fuse.LOG_HEAD.pack(b"DKLG", 0, len(hashes)) + b"\1" * 24)
        die()
    fuse.KeyLog.append = torn
    ring.insert_many(memoryview(np.arange(60_000, 60_010, dtype=np.uint64)), now=6.5)
    ring.save()
ring.compact()
print("DONE", flush=True)
"""


@pytest.mark.parametrize(
    "point", ["before-manifest", "before-unlink", "mid-fuse-write", "mid-log-append"]
)
def test_sigkill_during_the_rebuild_loses_nothing(tmp_path: Path, point: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), point],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.split() == ["ACK"]
    acknowledged = np.arange(1, 50_101, dtype=np.uint64)
    ring = BloomRing.open(tmp_path)
    assert all(ring.contains_many(memoryview(acknowledged)))
    expected_kind = "fuse" if point == "before-unlink" else "bloom"
    assert kinds(ring) == [(0, expected_kind), (1, "bloom")]
    if point == "before-unlink":  # what the crash left is removed at open
        assert files(tmp_path) == ["ring.json", "slice-0.fuse", "slice-1-0.bloom", "slice-1.keys"]
    assert ring.compact() == (0 if point == "before-unlink" else 1)
    assert kinds(ring) == [(0, "fuse"), (1, "bloom")]
    assert all(ring.contains_many(memoryview(acknowledged)))
    assert all(BloomRing.open(tmp_path).contains_many(memoryview(acknowledged)))
    assert not [n for n in files(tmp_path) if n.endswith(".tmp")]


def test_key_log_append_and_read_round_trip(tmp_path: Path) -> None:
    log = KeyLog(tmp_path / "k.keys")
    a = np.arange(10, dtype=np.uint64)
    b = np.arange(10, 20, dtype=np.uint64)
    log.append(memoryview(a))
    log.append(memoryview(b))
    assert log.hashes == 20
    assert list(log.read()) == list(range(20))
    resumed = KeyLog.resume(tmp_path / "k.keys", 20)
    assert resumed is not None and resumed.hashes == 20
    assert KeyLog.resume(tmp_path / "k.keys", 21) is None
    assert KeyLog.resume(tmp_path / "missing.keys", 0) is None
    log.hashes = 21
    with pytest.raises(CorruptFileError, match="vouches for 21"):
        log.read()
