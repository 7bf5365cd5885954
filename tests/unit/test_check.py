"""``dedupcore check``: every kind of silent damage is found, by slice and key range.

A template store holds known keys: warm slices of one checkpoint each (so a
record's key is in one known slice), sealed slice filters, a front filter,
and a cold ring with a fuse slice and a key log. Each test copies it, flips
one byte at a known place (found in the file: an LMDB key by searching
data.mdb for the digest's bytes, the value right after it), and expects a
damage finding naming that place and exit code 1. A clean copy exits 0;
bad paths exit 2; a store served by a live daemon is checked without
disturbing it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from dedupcore import keys as _keys
from dedupcore.bloom import HEADER_SIZE
from dedupcore.check import DAMAGE, CheckReport, NotADataDirectoryError, check_data_dir
from dedupcore.cli import main
from dedupcore.fuse import FUSE_HEADER_SIZE
from dedupcore.ring import BloomRing
from dedupcore.store import DedupStore, Outcome
from dedupcore.wal import HEADER_SIZE as WAL_HEADER_SIZE
from tests.support import procs
from tests.support.daemon import Lab

NS = "check/ns"
PER_SLICE = 300
SLICES = 3
COLD_WINDOW = 800.0


def slice_keys(sid: int) -> list[str]:
    """The keys checkpointed into warm slice ``sid`` (1-based)."""
    return [f"s{sid}-k{i:04d}" for i in range(PER_SLICE)]


def digest(key: str) -> bytes:
    return _keys.digest(NS.encode(), key.encode())


def _settings() -> dict[str, Any]:
    return {
        "slice_records": PER_SLICE,
        "compact_slices": False,  # no copies: each digest is in data.mdb once
        "checkpoint_records": 10**9,
        "checkpoint_interval": 1e9,
        "sweep_interval": 1e9,
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "d"
    with DedupStore.open(path, **_settings()) as store:
        for sid in range(1, SLICES + 1):
            keys = slice_keys(sid)
            claims = store.claim_many(keys, namespace=NS)
            store.complete_many([(c.key, c.token, sid) for c in claims], namespace=NS)
            store.checkpoint()  # one checkpoint per slice: slice_records keys
    # A cold ring beside the store's own: a fuse slice (sealed, rebuilt) and a head
    # slice with its Bloom filter and key log.
    ring = BloomRing(COLD_WINDOW, 100.0, 1000, 0.001, path=path / "cold" / "t800", key_logs=True)
    ring.add_many([f"cold-a{i}".encode() for i in range(500)], 1000.0)
    ring.add_many([f"cold-b{i}".encode() for i in range(500)], 1100.0)
    ring.save()
    assert ring.compact() == 1
    assert (path / "cold" / "t800" / "slice-10.fuse").exists()
    assert (path / "cold" / "t800" / "slice-11.keys").exists()
    return path


@pytest.fixture
def store_dir(template: Path, tmp_path: Path) -> Path:
    path = tmp_path / "d"
    shutil.copytree(template, path)
    return path


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    stdout, sys.stdout = sys.stdout, out
    try:
        rc = main(["check", *args])
    finally:
        sys.stdout = stdout
    return rc, out.getvalue()


def check_json(path: Path) -> tuple[int, dict[str, Any]]:
    rc, out = run_cli(str(path), "--json")
    return rc, json.loads(out)


def damage(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] == DAMAGE]


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def offsets_of(path: Path, needle: bytes) -> Iterator[int]:
    data = path.read_bytes()
    at = data.find(needle)
    while at >= 0:
        yield at
        at = data.find(needle, at + 1)


# ----------------------------------------------------------------- clean ---


def test_a_clean_store_exits_0(store_dir: Path) -> None:
    rc, report = check_json(store_dir)
    assert rc == 0, report
    assert not report["damaged"] and damage(report) == []
    assert report["checked"]["records"] == PER_SLICE * SLICES
    assert report["checked"]["slices"] == SLICES
    assert report["checked"]["key_logs"] == 1
    assert report["checked"]["cold_slices"] == 2
    rc, text = run_cli(str(store_dir))
    assert rc == 0 and "clean: no damage found" in text


def test_the_library_call_answers_as_the_cli(store_dir: Path) -> None:
    report = check_data_dir(store_dir)
    assert isinstance(report, CheckReport) and not report.damaged
    assert report.checked["records"] == PER_SLICE * SLICES


# ---------------------------------------------------------------- damage ---


def _record_finding(report: dict[str, Any]) -> dict[str, Any]:
    found = [f for f in damage(report) if f["kind"] == "record"]
    assert len(found) == 1, report["findings"]
    return found[0]


def test_a_flipped_byte_in_an_lmdb_key_is_found_in_its_slice(store_dir: Path) -> None:
    key = slice_keys(2)[123]
    d = digest(key)
    data = store_dir / "lmdb" / "data.mdb"
    places = list(offsets_of(data, d))
    assert places  # the key is in the file
    for at in places:
        flip(data, at + 15)  # the last byte: the key still sorts in its place
    flipped = d[:15] + bytes([d[15] ^ 1])
    rc, report = check_json(store_dir)
    assert rc == 1
    f = _record_finding(report)
    assert (f["slice"], f["first"], f["last"], f["count"]) == (2, flipped.hex(), flipped.hex(), 1)
    # What the check prevents: the store itself misses the record and answers NEW.
    with DedupStore.open(store_dir, readonly=True, **_settings()) as ro:
        assert ro.get(key, namespace=NS) is None


def test_a_flipped_byte_in_an_lmdb_value_is_found(store_dir: Path) -> None:
    d = digest(slice_keys(3)[7])
    data = store_dir / "lmdb" / "data.mdb"
    places = list(offsets_of(data, d))
    assert places
    for at in places:
        flip(data, at + 16 + 3)  # inside the value that follows the key in its leaf node
    rc, report = check_json(store_dir)
    assert rc == 1
    f = _record_finding(report)
    assert (f["slice"], f["first"], f["count"]) == (3, d.hex(), 1)


def test_a_run_of_damaged_records_is_one_finding_with_its_range(store_dir: Path) -> None:
    digests = sorted(digest(k) for k in slice_keys(1))
    run = digests[40:45]
    data = store_dir / "lmdb" / "data.mdb"
    for d in run:
        for at in offsets_of(data, d):
            flip(data, at + 16 + 3)
    rc, report = check_json(store_dir)
    assert rc == 1
    f = _record_finding(report)
    assert (f["slice"], f["first"], f["last"], f["count"]) == (1, run[0].hex(), run[-1].hex(), 5)


def test_a_flipped_byte_in_a_slice_filter_body_is_found(store_dir: Path) -> None:
    path = store_dir / "slices" / "00000001.bloom"
    flip(path, HEADER_SIZE + 10, 3)
    rc, report = check_json(store_dir)
    assert rc == 1
    (f,) = damage(report)
    assert (f["kind"], f["slice"], f["path"]) == ("slice-filter", 1, str(path))
    assert "checksum" in f["message"]


def test_a_flipped_byte_in_a_fuse_file_is_found(store_dir: Path) -> None:
    path = store_dir / "cold" / "t800" / "slice-10.fuse"
    flip(path, FUSE_HEADER_SIZE + 5)
    rc, report = check_json(store_dir)
    assert rc == 1
    (f,) = damage(report)
    assert f["kind"] == "cold" and str(path) in f["message"] and "checksum" in f["message"]


def test_a_flipped_byte_in_a_key_log_is_found(store_dir: Path) -> None:
    path = store_dir / "cold" / "t800" / "slice-11.keys"
    flip(path, 16 + 8 * 3)  # a hash inside the first chunk
    rc, report = check_json(store_dir)
    assert rc == 1
    (f,) = damage(report)
    assert (f["kind"], f["path"]) == ("key-log", str(path))


def test_a_flipped_byte_in_the_front_filter_manifest_is_found(store_dir: Path) -> None:
    path = store_dir / "front" / "ring.json"
    flip(path, 0, 1)  # "{" becomes "y": not JSON
    rc, report = check_json(store_dir)
    assert rc == 1
    (f,) = damage(report)
    assert f["kind"] == "front" and "manifest" in f["message"]


def test_a_damaged_slice_entry_of_the_warm_tier_manifest_is_found(store_dir: Path) -> None:
    env = lmdb.open(str(store_dir / "lmdb"), max_dbs=64)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            raw = bytearray(txn.get(b"slice:00000002", db=meta))
            raw[-1] = 7  # a slice state that does not exist
            txn.put(b"slice:00000002", bytes(raw), db=meta)
    finally:
        env.close()
    rc, report = check_json(store_dir)
    assert rc == 1
    assert any(f["kind"] == "lmdb" and "slice:00000002" in f["message"] for f in damage(report)), (
        report
    )


def test_a_slice_entry_that_miscounts_its_records_is_found(store_dir: Path) -> None:
    env = lmdb.open(str(store_dir / "lmdb"), max_dbs=64)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            raw = bytearray(txn.get(b"slice:00000002", db=meta))
            raw[0] ^= 1  # the record count
            txn.put(b"slice:00000002", bytes(raw), db=meta)
    finally:
        env.close()
    rc, report = check_json(store_dir)
    assert rc == 1
    (f,) = damage(report)
    assert (f["kind"], f["slice"]) == ("meta", 2)


def _log_after_checkpoint(store_dir: Path, tmp_path: Path) -> Path:
    """A crash image of the store with two logged batches no checkpoint took."""
    image = tmp_path / "image"
    store = DedupStore.open(store_dir, **_settings())
    try:
        for b in range(2):
            keys = [f"logged-{b}-{i}" for i in range(50)]
            store.claim_many(keys, namespace=NS)
        shutil.copytree(store_dir, image, ignore=shutil.ignore_patterns("LOCK"))
    finally:
        store.close()
    return image


def test_a_flipped_byte_in_a_log_frame_is_found(store_dir: Path, tmp_path: Path) -> None:
    image = _log_after_checkpoint(store_dir, tmp_path)
    rc, report = check_json(image)
    assert rc == 0, report
    assert report["checked"]["wal_records"] == 2
    (segment,) = sorted((image / "wal").glob("wal-*.log"))
    flip(segment, WAL_HEADER_SIZE + 12 + 40)  # inside the first record's payload
    rc, report = check_json(image)
    assert rc == 1
    (f,) = damage(report)
    assert f["kind"] == "wal" and segment.name in f["message"]
    assert "checksum mismatch" in f["message"]


def test_a_deleted_log_with_unchecked_records_is_found(store_dir: Path, tmp_path: Path) -> None:
    image = _log_after_checkpoint(store_dir, tmp_path)
    shutil.rmtree(image / "wal")
    rc, report = check_json(image)
    assert rc == 1
    (f,) = damage(report)
    assert f["kind"] == "wal" and "not closed clean" in f["message"]


def test_the_exit_code_of_the_command(store_dir: Path) -> None:
    flip(store_dir / "slices" / "00000002.bloom", HEADER_SIZE + 1)
    proc = procs.run_cli("check", str(store_dir))
    assert proc.returncode == 1, proc.stderr
    assert "DAMAGED" in proc.stdout and "00000002.bloom" in proc.stdout


# ----------------------------------------------------------- wrong input ---


@pytest.mark.parametrize("kind", ["missing", "file", "empty", "other"])
def test_wrong_input_is_a_clear_error_and_exit_2(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "x"
    expect = {
        "missing": "no such data directory",
        "file": "not a directory",
        "empty": "empty directory",
        "other": "not a dedupcore data directory",
    }[kind]
    if kind == "file":
        target.write_text("hello")
    elif kind == "empty":
        target.mkdir()
    elif kind == "other":  # another program's directory, with a lock file of its own
        target.mkdir()
        (target / "LOCK").write_text("123\n")
        (target / "data").mkdir()
        (target / "data" / "x.db").write_bytes(b"\0" * 100)
    rc, out = run_cli(str(target), "--json")
    assert rc == 2
    assert expect in json.loads(out)["error"]
    exc = {
        "missing": FileNotFoundError,
        "file": NotADirectoryError,
        "empty": NotADataDirectoryError,
        "other": NotADataDirectoryError,
    }[kind]
    with pytest.raises(exc, match=expect):
        check_data_dir(target)


def test_a_usage_error_of_the_command_exits_2() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["check"])
    assert exit_.value.code == 2


# ---------------------------------------------------------- live daemon ---


def test_check_of_a_store_served_by_a_live_daemon(tmp_path: Path) -> None:
    lab = Lab()
    try:
        d = lab.daemon()
        with d.client() as client:
            first = client.claim_many([f"k{i}" for i in range(200)], namespace=NS)
            assert {c.outcome for c in first} == {Outcome.NEW}
            client.complete_many([(c.key, c.token, 1) for c in first], namespace=NS)
            before = sorted(os.listdir(d.data))
            proc = procs.run_cli("check", str(d.data), "--json")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            report = json.loads(proc.stdout)
            assert report["owner"] == d.pid
            assert report["checked"]["wal_records"] >= 2  # the claims, not yet checkpointed
            # Undisturbed: still serving, the same files, every answer as before.
            assert d.alive()
            assert sorted(os.listdir(d.data)) == before
            again = client.claim_many([f"k{i}" for i in range(200)], namespace=NS)
            assert {(c.outcome, c.result) for c in again} == {(Outcome.DUPLICATE, 1)}
            assert client.claim("fresh", namespace=NS).outcome is Outcome.NEW
        assert d.stop() == 0
    finally:
        lab.close()


def test_plain_text_without_rich(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flip(store_dir / "slices" / "00000001.bloom", HEADER_SIZE + 2)
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails: rich is absent
    monkeypatch.setitem(sys.modules, "rich.table", None)
    rc, text = run_cli(str(store_dir))
    assert rc == 1
    assert f"damage: slice-filter: {store_dir / 'slices' / '00000001.bloom'}, slice 1" in text
    assert text.rstrip().splitlines()[-1].startswith("DAMAGED: 1 finding(s)")
