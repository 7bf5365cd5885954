"""Damage to stored records and a front filter from an earlier moment: never a silent NEW.

- Every record value in LMDB carries a checksum over its digest and bytes: a
  flipped byte anywhere in a value, a truncated value or a value moved under
  another digest raises CorruptFileError when read (deterministic: every byte
  of a value is tried, not a random sample).
- Bytes flipped inside data.mdb at every offset of a record's value (found in
  the file) are caught the same way through the real file.
- A stored result that passes its checksum but is not the msgpack it was is
  CorruptFileError, not UnicodeDecodeError.
- A front/ directory restored from before the last checkpoint (valid files)
  is rebuilt at open instead of answering "definitely new".
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
import pytest

from dedupcore import keys as _keys
from dedupcore.errors import CorruptFileError
from dedupcore.record import State, encode_stored
from dedupcore.store import DedupStore, Outcome

NS = "damage/ns"


def _digest(key: str) -> bytes:
    return _keys.digest(NS.encode(), key.encode())


def _lmdb_value(path: Path, key: str) -> bytes:
    env = lmdb.open(str(path / "lmdb"), max_dbs=64, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"s:00000001", create=False)) as txn:
            value = txn.get(_digest(key))
    finally:
        env.close()
    assert value is not None
    return bytes(value)


def _put_lmdb_value(path: Path, key: str, value: bytes) -> None:
    env = lmdb.open(str(path / "lmdb"), max_dbs=64)
    try:
        with env.begin(write=True) as txn:
            txn.put(_digest(key), value, db=env.open_db(b"s:00000001", txn=txn))
    finally:
        env.close()


def _completed_store(path: Path, results: dict[str, object]) -> None:
    with DedupStore.open(path) as store:
        for key, result in results.items():
            c = store.claim(key, namespace=NS)
            store.complete(key, c.token, namespace=NS, result=result)
        store.checkpoint()


def test_every_flipped_byte_of_a_stored_record_is_refused_never_new(tmp_path: Path) -> None:
    path = tmp_path / "d"
    _completed_store(path, {"k": {"paid": 42}, "other": None})
    good = _lmdb_value(path, "k")
    for i in range(len(good)):
        for bit in (0, 3, 7):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            _put_lmdb_value(path, "k", bytes(bad))
            with DedupStore.open(path) as store:
                with pytest.raises(CorruptFileError, match="checksum"):
                    store.claim("k", namespace=NS)
                with pytest.raises(CorruptFileError):
                    store.get("k", namespace=NS)
                # The damage is confined to that record: the others still answer.
                assert store.claim("other", namespace=NS).outcome is Outcome.DUPLICATE
    for n in range(len(good)):
        _put_lmdb_value(path, "k", good[:n] if n else b"\x00")
        with DedupStore.open(path) as store, pytest.raises(CorruptFileError):
            store.claim("k", namespace=NS)
    _put_lmdb_value(path, "k", _lmdb_value(path, "other"))  # right bytes, wrong key
    with DedupStore.open(path) as store, pytest.raises(CorruptFileError):
        store.claim("k", namespace=NS)
    _put_lmdb_value(path, "k", good)
    with DedupStore.open(path) as store:
        assert store.claim("k", namespace=NS).result == {"paid": 42}


def test_flipped_bytes_in_the_lmdb_file_are_caught_when_the_record_is_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d"
    _completed_store(path, {f"k{i}": f"result-{i}" * 3 for i in range(50)})
    data = (path / "lmdb" / "data.mdb").read_bytes()
    value = _lmdb_value(path, "k7")
    # The live record, and maybe stale copies in pages copy-on-write left behind:
    # every copy gets the same flip, so the one LMDB reads is damaged.
    found = [at for at in range(len(data)) if data.startswith(value, at)]
    assert found
    for i in range(len(value)):
        damaged = bytearray(data)
        for at in found:
            damaged[at + i] ^= 0x10
        (path / "lmdb" / "data.mdb").write_bytes(bytes(damaged))
        with DedupStore.open(path) as store:
            with pytest.raises(CorruptFileError):
                store.claim("k7", namespace=NS)
            assert store.claim("k8", namespace=NS).outcome is Outcome.DUPLICATE
    (path / "lmdb" / "data.mdb").write_bytes(data)


def test_a_stored_result_that_is_not_msgpack_is_corrupt_file_error(tmp_path: Path) -> None:
    path = tmp_path / "d"
    _completed_store(path, {"k": "fine"})
    raw = encode_stored(
        _digest("k"), State.PROCESSED, 1, 1, 1.7e9, 1.7e9, 30.0, result=b"\xa3\xff\xfe\xfd"
    )
    _put_lmdb_value(path, "k", raw)
    with DedupStore.open(path) as store:
        with pytest.raises(CorruptFileError, match="result"):
            store.claim("k", namespace=NS)
        with pytest.raises(CorruptFileError, match="result"):
            store.get("k", namespace=NS)


def test_front_filter_restored_from_before_the_checkpoint_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "d"
    first = [f"a{i}" for i in range(3000)]
    later = [f"b{i}" for i in range(2000)]
    with DedupStore.open(path) as store:
        for c in store.claim_many(first, namespace=NS):
            assert c.outcome is Outcome.NEW
    # complete the first keys, checkpoint, keep a copy of the front of that moment
    with DedupStore.open(path) as store:
        for key in first:
            rec = store.get(key, namespace=NS)
            assert rec is not None
            store.complete(key, rec.token, namespace=NS)
        store.checkpoint()
    shutil.copytree(path / "front", tmp_path / "front-then")
    with DedupStore.open(path) as store:
        claims = store.claim_many(later, namespace=NS)
        store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        store.checkpoint()
    shutil.rmtree(path / "front")
    shutil.copytree(tmp_path / "front-then", path / "front")
    with DedupStore.open(path) as store:
        outcomes = {c.outcome for c in store.claim_many(first + later, namespace=NS)}
        assert outcomes == {Outcome.DUPLICATE}
