"""The Bloom filter file format (version 1): layout, round trips, corruption, atomic save."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import refmodel
import xxhash

from dedupcore import BloomFilter
from dedupcore.errors import CorruptFileError, DedupError, UnsupportedFormatError

OPENERS = ["open-mmap", "open-copy", "from-bytes"]
Saved = tuple[BloomFilter, Path, list[bytes]]


@pytest.fixture
def saved(tmp_path: Path, make_keys: Callable[..., list[bytes]]) -> Saved:
    bf = BloomFilter(2000, 0.01, seed=0xDEADBEEF)
    keys = make_keys(1500)
    bf.update(keys)
    path = tmp_path / "filter.bloom"
    bf.save(path)
    return bf, path, keys


def load(how: str, data: bytes, tmp_path: Path, *, verify: bool = True) -> BloomFilter:
    """Loads ``data`` the way ``how`` names (a file opened two ways, or from_bytes)."""
    if how == "from-bytes":
        return BloomFilter.from_bytes(data)
    path = tmp_path / "damaged.bloom"
    path.write_bytes(data)
    return BloomFilter.open(path, mmap=how == "open-mmap", verify=verify)


# ------------------------------------------------------------------ layout --


def test_saved_file_layout_is_the_specified_one(
    saved: Saved,
) -> None:
    bf, path, keys = saved
    data = path.read_bytes()
    assert len(data) == 128 + bf.nblocks * 64
    head = refmodel.unpack_header(data)
    body = data[128:]
    assert head == {
        "magic": b"DEDUPBLM",
        "version": 1,
        "algorithm": 1,
        "block_bytes": 64,
        "seed": 0xDEADBEEF,
        "nblocks": bf.nblocks,
        "capacity": 2000,
        "error_rate": 0.01,
        "count": bf.count,
        "body_checksum": xxhash.xxh64_intdigest(body, 0),
        "header_checksum": xxhash.xxh64_intdigest(data[:120], 0),
    }
    assert data[64:120] == bytes(56)  # reserved
    model = refmodel.RefFilter(bf.nblocks, 0xDEADBEEF)
    model.add_many(keys)
    assert body == model.body()
    assert data == bf.to_bytes()


def test_header_built_independently_is_accepted(tmp_path: Path) -> None:
    model = refmodel.RefFilter(37, seed=5)
    keys = [b"a", b"b", "c"]
    model.add_many(keys)
    body = model.body()
    data = (
        refmodel.pack_header(seed=5, nblocks=37, capacity=100, error_rate=0.02, count=3, body=body)
        + body
    )
    for how in OPENERS:
        bf = load(how, data, tmp_path)
        assert (bf.nblocks, bf.seed, bf.capacity, bf.error_rate, bf.count) == (37, 5, 100, 0.02, 3)
        assert all(k in bf for k in keys)
        assert bytes(memoryview(bf)) == body


# ------------------------------------------------------------- round trip --


@pytest.mark.parametrize("use_mmap", [True, False])
def test_save_open_round_trip(saved: Saved, use_mmap: bool) -> None:
    bf, path, keys = saved
    opened = BloomFilter.open(path, mmap=use_mmap)
    assert opened == bf
    assert (opened.capacity, opened.error_rate, opened.seed, opened.count, opened.nblocks) == (
        bf.capacity,
        bf.error_rate,
        bf.seed,
        bf.count,
        bf.nblocks,
    )
    assert opened.readonly is use_mmap
    assert all(opened.contains_many(keys))
    probes = [b"absent-%d" % i for i in range(2000)]
    assert list(opened.contains_many(probes)) == list(bf.contains_many(probes))
    if not use_mmap:
        opened.add(b"more")
        assert b"more" in opened
        assert BloomFilter.open(path) == bf  # the file did not change


def test_open_accepts_str_and_pathlike(saved: Saved) -> None:
    bf, path, _ = saved
    assert BloomFilter.open(str(path)) == bf
    assert BloomFilter.open(path, mmap=False, verify=False) == bf


def test_save_overwrites_and_mapped_reader_keeps_old_content(
    saved: Saved,
) -> None:
    bf, path, keys = saved
    mapped = BloomFilter.open(path, mmap=True)
    bigger = bf.copy()
    bigger.update([b"second-%d" % i for i in range(500)])
    bigger.save(path)
    # The old mapping still reads the old, complete file; the path now holds the new one.
    assert mapped == bf
    assert all(mapped.contains_many(keys))
    assert BloomFilter.open(path) == bigger
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_save_of_mmap_filter_to_new_path(saved: Saved, tmp_path: Path) -> None:
    bf, path, _ = saved
    mapped = BloomFilter.open(path, mmap=True)
    mapped.save(tmp_path / "copy.bloom")
    assert BloomFilter.open(tmp_path / "copy.bloom") == bf


# ------------------------------------------------------------- corruption --


@pytest.mark.parametrize("how", OPENERS)
def test_truncated(saved: Saved, tmp_path: Path, how: str) -> None:
    _, path, _ = saved
    data = path.read_bytes()
    for cut in (0, 1, 8, 64, 119, 120, 127, 128, 129, 128 + 64, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptFileError, match="truncated"):
            load(how, data[:cut], tmp_path)


@pytest.mark.parametrize("how", OPENERS)
def test_trailing_garbage(saved: Saved, tmp_path: Path, how: str) -> None:
    _, path, _ = saved
    data = path.read_bytes()
    for extra in (b"\x00", b"garbage", bytes(64), bytes(4096)):
        with pytest.raises(CorruptFileError):
            load(how, data + extra, tmp_path)


def test_every_flipped_header_byte_is_detected(
    saved: Saved,
) -> None:
    _, path, _ = saved
    data = path.read_bytes()
    for offset in range(128):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[offset] ^= flip
            with pytest.raises(CorruptFileError):
                BloomFilter.from_bytes(bytes(damaged))


@pytest.mark.parametrize("how", ["open-mmap", "open-copy"])
@pytest.mark.parametrize("offset", [0, 9, 16, 24, 32, 40, 48, 56, 64, 100, 120, 127])
def test_flipped_header_byte_in_file(saved: Saved, tmp_path: Path, how: str, offset: int) -> None:
    _, path, _ = saved
    damaged = bytearray(path.read_bytes())
    damaged[offset] ^= 0x10
    with pytest.raises(CorruptFileError):
        load(how, bytes(damaged), tmp_path)
    with pytest.raises(CorruptFileError):  # the header is always checked, verify or not
        load(how, bytes(damaged), tmp_path, verify=False)


@pytest.mark.parametrize("how", OPENERS)
def test_flipped_body_byte(saved: Saved, tmp_path: Path, how: str) -> None:
    bf, path, _ = saved
    data = path.read_bytes()
    for offset in (128, 129, 128 + bf.nbytes // 2, len(data) - 1):
        damaged = bytearray(data)
        damaged[offset] ^= 0x04
        with pytest.raises(CorruptFileError, match="checksum"):
            load(how, bytes(damaged), tmp_path)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_flipped_body_byte_without_verify_opens(
    saved: Saved, tmp_path: Path, use_mmap: bool
) -> None:
    bf, path, _ = saved
    damaged = bytearray(path.read_bytes())
    damaged[200] ^= 0x04
    opened = load("open-mmap" if use_mmap else "open-copy", bytes(damaged), tmp_path, verify=False)
    assert bytes(memoryview(opened)) == bytes(damaged[128:])
    assert opened != bf


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize("magic", [b"DEDUPBLX", b"\x00" * 8, b"PK\x03\x04abc", b"dedupblm"])
def test_wrong_magic(saved: Saved, tmp_path: Path, how: str, magic: bytes) -> None:
    bf, path, _ = saved
    body = path.read_bytes()[128:]
    data = (
        refmodel.pack_header(
            magic=magic,
            seed=bf.seed,
            nblocks=bf.nblocks,
            capacity=bf.capacity,
            error_rate=bf.error_rate,
            count=bf.count,
            body=body,
        )
        + body
    )
    with pytest.raises(CorruptFileError, match="magic"):
        load(how, data, tmp_path)


@pytest.mark.parametrize("how", OPENERS)
def test_not_a_filter_at_all(tmp_path: Path, how: str) -> None:
    for data in (b"hello world\n" * 100, os.urandom(128 + 640), bytes(128 + 64)):
        with pytest.raises(CorruptFileError):
            load(how, data, tmp_path)


def _repacked(bf: BloomFilter, body: bytes, **fields: object) -> bytes:
    args: dict[str, object] = {
        "seed": bf.seed,
        "nblocks": bf.nblocks,
        "capacity": bf.capacity,
        "error_rate": bf.error_rate,
        "count": bf.count,
        "body": body,
    }
    args.update(fields)
    return refmodel.pack_header(**args) + body  # type: ignore[arg-type]


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize("version", [2, 3, 0xFFFF])
def test_newer_version_is_unsupported(saved: Saved, tmp_path: Path, how: str, version: int) -> None:
    bf, path, _ = saved
    data = _repacked(bf, path.read_bytes()[128:], version=version)
    with pytest.raises(UnsupportedFormatError, match="version") as info:
        load(how, data, tmp_path)
    assert isinstance(info.value, CorruptFileError)
    assert isinstance(info.value, DedupError)
    assert isinstance(info.value, ValueError)


def test_unsupported_format_error_hierarchy() -> None:
    assert issubclass(UnsupportedFormatError, CorruptFileError)
    assert issubclass(CorruptFileError, DedupError)
    assert issubclass(CorruptFileError, ValueError)


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"version": 0}, CorruptFileError),
        ({"algorithm": 2}, UnsupportedFormatError),
        ({"algorithm": 0}, CorruptFileError),
        ({"block_bytes": 32}, CorruptFileError),
        ({"block_bytes": 128}, CorruptFileError),
        ({"capacity": 0}, CorruptFileError),
        ({"error_rate": 0.0}, CorruptFileError),
        ({"error_rate": 1.0}, CorruptFileError),
        ({"error_rate": math.nan}, CorruptFileError),
        ({"error_rate": -0.5}, CorruptFileError),
        ({"nblocks": 0}, CorruptFileError),
        ({"nblocks": 2**32}, CorruptFileError),
        ({"nblocks": 2**63}, CorruptFileError),
    ],
    ids=lambda v: str(v) if not isinstance(v, type) else v.__name__,
)
def test_invalid_header_fields_with_valid_checksum(
    saved: Saved,
    tmp_path: Path,
    how: str,
    fields: dict[str, object],
    error: type[Exception],
) -> None:
    bf, path, _ = saved
    data = _repacked(bf, path.read_bytes()[128:], **fields)
    with pytest.raises(error):
        load(how, data, tmp_path)


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_block_count_disagreeing_with_size(
    saved: Saved, tmp_path: Path, how: str, delta: int
) -> None:
    bf, path, _ = saved
    data = _repacked(bf, path.read_bytes()[128:], nblocks=bf.nblocks + delta)
    with pytest.raises(CorruptFileError):
        load(how, data, tmp_path)


@pytest.mark.parametrize("how", OPENERS)
def test_wrong_body_checksum_field(saved: Saved, tmp_path: Path, how: str) -> None:
    _, path, _ = saved
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 56, (struct.unpack_from("<Q", data, 56)[0] + 1) % 2**64)
    struct.pack_into("<Q", data, 120, xxhash.xxh64_intdigest(bytes(data[:120]), 0))
    with pytest.raises(CorruptFileError, match="checksum"):
        load(how, bytes(data), tmp_path)


def test_missing_file_is_not_corruption(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        BloomFilter.open(tmp_path / "nope.bloom")


# ----------------------------------------------------------- atomic save --


def test_save_leaves_no_temp_files(tmp_path: Path, make_keys: Callable[..., list[bytes]]) -> None:
    bf = BloomFilter(1000, 0.01)
    for i in range(3):
        bf.update(make_keys(100, f"round{i}"))
        bf.save(tmp_path / "f.bloom")
        bf.save(tmp_path / "g.bloom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bloom", "g.bloom"]
    assert BloomFilter.open(tmp_path / "f.bloom") == bf


@pytest.mark.parametrize("fail", ["replace", "fsync", "write"])
def test_failed_save_keeps_previous_file(
    saved: Saved, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    bf, path, _ = saved
    old = path.read_bytes()
    newer = bf.copy()
    newer.update([b"newer-%d" % i for i in range(100)])

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device (simulated)")

    if fail == "write":
        real_fdopen = os.fdopen

        class FailingFile:
            def __init__(self, fh: object) -> None:
                self.fh = fh

            def __enter__(self) -> FailingFile:
                return self

            def __exit__(self, *exc: object) -> None:
                self.fh.close()  # type: ignore[attr-defined]

            def write(self, chunk: bytes) -> int:
                self.fh.write(bytes(chunk)[:10])  # type: ignore[attr-defined]
                raise OSError(28, "No space left on device (simulated)")

            def __getattr__(self, name: str) -> object:
                return getattr(self.fh, name)

        monkeypatch.setattr(os, "fdopen", lambda *a, **k: FailingFile(real_fdopen(*a, **k)))
    else:
        monkeypatch.setattr(os, fail, boom)
    with pytest.raises(OSError, match="simulated"):
        newer.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert BloomFilter.open(path) == bf


def test_failed_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bf = BloomFilter(1000, 0.01)

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("simulated")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        bf.save(tmp_path / "new.bloom")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
