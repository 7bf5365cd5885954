"""A data directory written in record format 1 is converted when opened read-write."""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import msgpack
import pytest

from dedupcore import keys as _keys
from dedupcore.errors import UnsupportedFormatError
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome
from dedupcore.wal import WriteAheadLog

NS = "orders/billing"
_HEAD = struct.Struct("<BBHQddf")


def _v1(state: State, token: int, t: float, *, owner=None, fp=None, result=None) -> bytes:
    flags = (1 if owner else 0) | (2 if fp else 0) | (4 if result is not None else 0)
    o, f, r = owner or b"", fp or b"", result or b""
    return b"".join(
        (
            _HEAD.pack(1, int(state) | (flags << 4), 1, token, t, t, 30.0),
            bytes([len(o)]),
            o,
            bytes([len(f)]),
            f,
            struct.pack("<I", len(r)),
            r,
        )
    )


def _v1_payload(entries: list[tuple[bytes, bytes]]) -> bytes:
    parts = [struct.pack("<I", len(entries))]
    for d, raw in entries:
        parts += [d, struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


def _make_v1_dir(path: Path) -> dict[str, bytes]:
    digest = {k: _keys.digest(NS.encode(), k.encode()) for k in ("done", "held", "logged", "gone")}
    env = lmdb.open(str(path / "lmdb"), max_dbs=8, map_size=1 << 24)
    records = env.open_db(b"records")
    env.open_db(b"expiry")
    inflight = env.open_db(b"inflight")
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"1", db=meta)
        txn.put(b"ns:" + NS.encode(), struct.pack("<H", 1), db=meta)
        txn.put(
            digest["done"],
            _v1(State.PROCESSED, 2, 1.7e9, result=msgpack.packb({"ok": 1})),
            db=records,
        )
        txn.put(digest["held"], _v1(State.PROCESSING, 1, 1.7e9, owner=b"w1"), db=records)
        txn.put(digest["held"], b"", db=inflight)
        txn.put(digest["gone"], _v1(State.RELEASED, 4, 1.7e9), db=records)
        txn.put(b"checkpoint_lsn", struct.pack(">Q", 0), db=meta)
    env.close()
    with WriteAheadLog.open(path / "wal") as wal:
        wal.append([_v1_payload([(digest["logged"], _v1(State.PROCESSED, 1, 1.7e9, fp=b"f"))])])
    return digest


def test_format_1_directory_is_converted_and_answers_alike(tmp_path: Path) -> None:
    _make_v1_dir(tmp_path)
    with DedupStore.open(tmp_path) as store:
        done = store.claim("done", namespace=NS)
        assert (done.outcome, done.token, done.result) == (Outcome.DUPLICATE, 2, {"ok": 1})
        assert store.claim("held", namespace=NS).outcome is Outcome.IN_PROGRESS
        assert store.claim("held", namespace=NS, owner="w1").outcome is Outcome.NEW
        rec = store.get("logged", namespace=NS)
        assert rec is not None and (rec.state, rec.fingerprint) == (State.PROCESSED, b"f")
        again = store.claim("gone", namespace=NS)
        assert (again.outcome, again.token) == (Outcome.NEW, 5)
    with DedupStore.open(tmp_path, readonly=True) as ro:  # format 2 now: read-only works
        assert ro.get("done", namespace=NS) is not None


def test_read_only_open_of_format_1_says_what_to_do(tmp_path: Path) -> None:
    _make_v1_dir(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="open it once read-write"):
        DedupStore.open(tmp_path, readonly=True)
    with DedupStore.open(tmp_path) as store:  # and nothing was changed by the refusal
        assert store.claim("done", namespace=NS).outcome is Outcome.DUPLICATE


def test_newer_format_is_refused(tmp_path: Path) -> None:
    DedupStore.open(tmp_path).close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"9", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(UnsupportedFormatError, match="newer"):
        DedupStore.open(tmp_path)
