"""Lookups in LMDB's pages in native code (ext/dc_mdb.h, ``_engine.PageReader``,
``Environment.read_sorted``; docs/warm-tier.md, "Lookups in native code").

The walk must answer exactly what LMDB answers (``getmulti``) on real files
written by py-lmdb: trees of one page and of several levels, values on overflow
pages, absent keys between and beyond the present ones, an empty database. What
it cannot read it must say so (and LMDB then answers), never read outside its
mapping: damaged copies of a real file go through the walk built under
AddressSanitizer in tests/unit/test_native_headers.py.
"""

from __future__ import annotations

import ast
import mmap
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from dedupcore import _engine
from dedupcore.tiers.environment import Environment
from tests.support.procs import PATIENCE, child_env

NAME = b"s:00000001"


def _digests(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return sorted({rng.randbytes(16) for _ in range(n)})


def _value(i: int) -> bytes:
    """Mostly small records; every 97th on overflow pages (over a page's worth)."""
    size = 5000 + i % 7000 if i % 97 == 0 else 20 + i % 60
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[lmdb.Environment]:
    e = lmdb.open(str(tmp_path / "env"), max_dbs=4, map_size=1 << 28)
    yield e
    e.close()


def _fill(env: lmdb.Environment, keys: list[bytes], name: bytes = NAME) -> object:
    db = env.open_db(name)
    with env.begin(write=True) as txn:
        for i, k in enumerate(keys):
            txn.put(k, _value(i), db=db)
    return db


def _reader(env: lmdb.Environment) -> _engine.PageReader:
    path = Path(env.path()) / "data.mdb"
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    return _engine.PageReader(mapping, env.stat()["psize"])


@pytest.mark.parametrize("n", [1, 40, 3000, 60_000])
def test_the_walk_answers_what_lmdb_answers(env: lmdb.Environment, n: int) -> None:
    present = _digests(n, seed=n)
    stored = present[::2]  # every other one stored: the rest are absent between them
    db = _fill(env, stored)
    asked = _engine.sort_digests(
        b"".join(present + _digests(50, seed=1_000_000 + n) + [b"\x00" * 16, b"\xff" * 16])
    )
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        assert record is not None and len(record) == 48
        got = reader.get_many(record, asked)
        assert isinstance(got, _engine.PackedRecords)
        assert list(got) == txn.cursor(db=db).getmulti(_engine.split_digests(asked))
    assert len(got) == len(stored)
    assert next(iter(got))[1] == _value(0)
    if n >= 3000:  # several levels, and values on overflow pages
        assert env.stat()["depth"] >= 1
        with env.begin() as txn:
            stat = txn.stat(db)
        assert stat["depth"] >= 2 and stat["overflow_pages"] > 0


def test_keys_in_any_order_are_answered_as_lmdb_answers_them(env: lmdb.Environment) -> None:
    """A batch's walks start below the deepest branch page of the walk before that
    holds the key (docs/warm-tier.md, "Lookups in native code"): keys in byte
    order, reversed, shuffled and repeated are each answered as LMDB answers them."""
    present = _digests(60_000, seed=17)
    db = _fill(env, present[::2])
    rng = random.Random(17)
    shuffled = present[:5000] + present[-5000:] + present[:50]
    rng.shuffle(shuffled)
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        assert record is not None
        assert txn.stat(db)["depth"] >= 3  # two branch levels above the leaves
        for order in (present, present[::-1], shuffled):
            got = reader.get_many(record, b"".join(order))
            assert isinstance(got, _engine.PackedRecords)
            assert list(got) == txn.cursor(db=db).getmulti(order)


def test_keys_not_spread_evenly_are_answered_the_same(env: lmdb.Environment) -> None:
    """The search's first guess assumes hash keys; keys that share their first 8
    bytes (the compare's second word decides), keys packed at one end and keys of
    other lengths in the same tree cost more nodes read, never another answer."""
    rng = random.Random(6)
    shared = [b"\x42" * 8 + rng.randbytes(8) for _ in range(3000)]
    low_end = [bytes(12) + rng.randbytes(4) for _ in range(3000)]
    stored = sorted(set(shared[::2] + low_end[::2]))
    db = _fill(env, stored)
    with env.begin(write=True) as txn:  # a few keys of other lengths among them
        for k in (b"\x42", b"\x42" * 9, bytes(20), b"\xff" * 3):
            txn.put(k, b"other", db=db)
    asked = _engine.sort_digests(b"".join(shared + low_end))
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        assert record is not None
        got = reader.get_many(record, asked)
        assert isinstance(got, _engine.PackedRecords)
        assert list(got) == txn.cursor(db=db).getmulti(_engine.split_digests(asked))
    assert len(got) == len(stored)


def test_an_empty_database_and_an_empty_ask(env: lmdb.Environment) -> None:
    env.open_db(NAME)
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        assert record is not None
        for asked in (b"\x01" * 32, b""):
            got = reader.get_many(record, asked)
            assert isinstance(got, _engine.PackedRecords) and list(got) == []


def test_what_the_walk_does_not_read_is_said(env: lmdb.Environment) -> None:
    keys = _digests(100, seed=1)
    dup = env.open_db(b"dups", dupsort=True)
    with env.begin(write=True) as txn:
        txn.put(keys[0], b"a", db=dup)
    _fill(env, keys)
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        dup_record = txn.get(b"dups")
        record = txn.get(NAME)
    assert dup_record is not None and record is not None
    assert reader.get_many(dup_record, keys[0]) == _engine.PAGES_UNREADABLE
    assert reader.get_many(record[:47], keys[0]) == _engine.PAGES_UNREADABLE
    with pytest.raises(ValueError, match="multiple of 16"):
        reader.get_many(record, b"\x00" * 15)
    with pytest.raises(ValueError, match="page size"):
        _engine.PageReader(b"\x00" * 4096, 1000)
    # A mapping of the file as it was before it grew: pages past it.
    small = _engine.PageReader(b"\x00" * (2 * 4096), 4096)
    assert small.pages == 2
    assert small.get_many(record, keys[0]) == _engine.PAGES_BEYOND


@contextmanager
def _environment(tmp_path: Path) -> Iterator[tuple[Environment, object]]:
    """An Environment of a fresh directory of a 1 MiB map, and its database NAME."""
    environment = Environment(
        tmp_path / "lmdb", map_size=1 << 20, readonly=False, sync=False, max_dbs=4
    )
    try:
        yield environment, environment.open_db(NAME, create=True)
    finally:
        environment.close()


def test_the_environment_maps_the_grown_file_again_and_counts_its_probes(tmp_path: Path) -> None:
    with _environment(tmp_path) as (environment, db):
        first = _digests(10, seed=2)
        environment.write(lambda txn: [txn.put(k, b"v1", db=db) for k in first])
        with environment.txn(buffers=False) as txn:
            assert list(environment.read_sorted(txn, NAME, db, b"".join(first))) == [
                (k, b"v1") for k in first
            ]
        # Many more records: the file grows past the pages mapped at open (and the
        # map itself past its first megabyte).
        more = _digests(30_000, seed=3)
        environment.write(lambda txn: [txn.put(k, _value(i), db=db) for i, k in enumerate(more)])
        asked = _engine.sort_digests(b"".join(first + more))
        with environment.txn(buffers=False) as txn:
            got = environment.read_sorted(txn, NAME, db, asked)
            assert list(got) == txn.cursor(db=db).getmulti(_engine.split_digests(asked))
        assert len(got) == len(first) + len(more)
        assert environment.native_probes == len(first) + len(asked) // 16
        assert environment.lmdb_probes == 0
        # A database the walk cannot read: LMDB answers, and is counted.
        dups = environment.lmdb.open_db(b"dups", dupsort=True)
        environment.write(lambda txn: txn.put(first[0], b"x", db=dups))
        with environment.txn(buffers=False) as txn:
            got = environment.read_sorted(txn, b"dups", dups, b"".join(first))
            assert list(got) == [(first[0], b"x")]
        assert environment.lmdb_probes == len(first)


def test_without_a_mapping_lmdb_answers_every_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapping that cannot be made (address space, a host without mmap) leaves
    the walk out: LMDB answers, and the probes say so."""

    def refused(*args: object, **kwargs: object) -> object:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refused)
    with _environment(tmp_path) as (environment, db):
        keys = _digests(20, seed=8)
        environment.write(lambda txn: [txn.put(k, b"v", db=db) for k in keys])
        with environment.txn(buffers=False) as txn:
            got = environment.read_sorted(txn, NAME, db, b"".join(keys))
        assert list(got) == [(k, b"v") for k in keys]
        assert (environment.native_probes, environment.lmdb_probes) == (0, len(keys))


def test_a_store_answers_from_lmdb_through_the_walk(tmp_path: Path) -> None:
    from dedupcore import Outcome
    from dedupcore.store import DedupStore

    keys = [f"k{i}" for i in range(3000)]
    with DedupStore.open(tmp_path / "s") as store:
        claims = store.claim_many(keys, namespace="ns")
        store.complete_many([(c.key, c.token, {"n": c.key}) for c in claims], namespace="ns")
        store.checkpoint()
    with DedupStore.open(tmp_path / "s") as store:
        for c in store.claim_many(keys, namespace="ns"):
            assert (c.outcome, c.result) == (Outcome.DUPLICATE, {"n": c.key})
        stats = store.stats()
        assert stats["lmdb"]["probes_native"] >= len(keys)
        assert stats["lmdb"]["probes_lmdb"] == 0
        # Settled records a claim only read stay out of the table (docs/engine.md,
        # "Records read for a claim"); a completion's read loads what it reads.
        assert stats["memory"]["records"] == 0
        again = store.claim_many([*keys[:10], "fresh"], namespace="ns")
        assert [c.outcome for c in again] == [Outcome.DUPLICATE] * 10 + [Outcome.NEW]
        store.release("fresh", again[-1].token, namespace="ns")
        assert store.stats()["memory"]["records"] == 1


def test_the_gate_lets_one_alone_in_at_a_time_and_uses_wait_for_it(tmp_path: Path) -> None:
    """``alone()`` (a map resize, a reopen) waits for the uses under way, keeps new
    ones and any other ``alone()`` out until it ends; a transaction's use ends
    whether its block returns or raises (committed, or aborted)."""
    with _environment(tmp_path) as (environment, db):
        inside = threading.Event()
        release = threading.Event()
        entered: list[str] = []

        def first() -> None:
            with environment.alone():
                entered.append("first")
                inside.set()
                release.wait(10)
                entered.append("first out")

        def second() -> None:
            with environment.alone():
                entered.append("second")

        def use() -> None:
            with environment.txn() as txn:
                entered.append("use")
                txn.get(b"x", db=db)

        a = threading.Thread(target=first)
        a.start()
        assert inside.wait(10)
        others = [threading.Thread(target=second), threading.Thread(target=use)]
        for t in others:
            t.start()
        for t in others:
            t.join(0.3)  # neither may enter while the first is alone
        assert entered == ["first"]
        release.set()
        for t in [a, *others]:
            t.join(10)
        assert entered[:2] == ["first", "first out"]
        assert sorted(entered[2:]) == ["second", "use"]
        with pytest.raises(KeyError), environment.txn(write=True) as txn:
            txn.put(b"k", b"v", db=db)
            raise KeyError("the block fails: the write is aborted")
        with environment.txn() as txn:
            assert txn.get(b"k", db=db) is None
        with environment.alone():  # no use was left counted
            pass


#: Another thread opens databases while this one holds a write transaction and goes
#: on with Python code inside it (a checkpoint's, or a new namespace's, say).
_OPEN_BESIDE_A_WRITE = """
import pathlib, sys, threading, time
from dedupcore.tiers.environment import Environment

env = Environment(pathlib.Path(sys.argv[1]), map_size=1 << 24, readonly=False, sync=False,
                  max_dbs=8)
env.open_db(b"old", create=True)
calling = threading.Event()
opened = []

def other():
    calling.set()
    opened.append(env.open_db(b"new", create=True))
    opened.append(env.open_db(b"old", create=False))

with env.txn(write=True) as txn:
    thread = threading.Thread(target=other)
    thread.start()
    calling.wait()
    time.sleep(0.2)  # the other thread waits for LMDB's writer meanwhile
    txn.put(b"k", b"v")
thread.join()
print(len(opened))
"""


def test_a_database_opened_beside_a_write_transaction_waits_for_it_without_the_gil(
    tmp_path: Path,
) -> None:
    """``Environment.open_db`` waits for LMDB's writer with the GIL released: py-lmdb's
    own temporary transaction waited holding it, so the thread whose write
    transaction it waited for could never end it, and the process (the daemon,
    when its background compaction opened a slice's copy while a new namespace
    was written) stopped for good. In a process of its own, which that would
    hang."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_BESIDE_A_WRITE, str(tmp_path / "env")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2"]


def test_the_package_opens_no_database_in_a_transaction_of_py_lmdbs_own() -> None:
    """The rule the test above guards, over the whole package: a call of ``open_db``
    passes its transaction (``txn=``), or is the warm tier's own
    ``Environment.open_db`` (``self._env``), or is ``open_dbs``'s read-only branch.
    A py-lmdb ``open_db`` without one would wait for LMDB's writer holding the GIL."""
    package = Path(__file__).resolve().parents[2] / "dedupcore"
    bare: list[str] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        exempt = {
            id(node)
            for f in ast.walk(tree)
            if path.name == "environment.py"
            and isinstance(f, ast.FunctionDef)
            and f.name == "open_dbs"
            for node in ast.walk(f)
        }
        for call in ast.walk(tree):
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "open_db"
            ):
                continue
            receiver = call.func.value
            if (
                any(k.arg == "txn" for k in call.keywords)
                or (isinstance(receiver, ast.Attribute) and receiver.attr == "_env")
                or id(call) in exempt
            ):
                continue
            bare.append(f"{path.relative_to(package.parent)}:{call.lineno}")
    assert not bare, f"open_db without a transaction: {bare}"


def test_every_key_of_a_database_walked_in_batches_as_lmdb_iterates_them(tmp_path: Path) -> None:
    """``Environment.keys`` (sealing a slice, rebuilding its filter, compacting it):
    the native walk gives LMDB's keys in LMDB's order; where it cannot go on,
    LMDB's cursor gives the rest from after the last key given, never one twice."""
    with _environment(tmp_path) as (environment, db):
        keys = sorted(_digests(30_000, seed=12))
        environment.write(
            lambda txn: [txn.put(k, _value(i % 9), db=db) for i, k in enumerate(keys)]
        )
        environment._map_pages()
        with environment.txn(buffers=False) as txn:
            for batch in (1, 999, 30_000, 100_000):
                before = environment.native_keys
                got = list(environment.keys(txn, NAME, db, batch))
                assert b"".join(got) == b"".join(keys)
                assert all(len(part) <= 16 * batch for part in got)
                assert environment.native_keys - before == len(keys)
        # A mapping that ends part way through the tree (the file grew since it
        # was mapped): the walk stops at a page past it, the file is mapped again
        # and walked again from where the keys given end.
        pages = environment._pages
        assert pages is not None
        with open(environment.path / "data.mdb", "rb") as f:
            head = f.read(psize := environment.lmdb.stat()["psize"]) + f.read(
                (pages.pages // 2) * psize
            )
        for batch in (1, 500, 30_000):
            environment._pages = _engine.PageReader(head, psize)
            before = environment.native_keys
            with environment.txn(buffers=False) as txn:
                got = list(environment.keys(txn, NAME, db, batch))
            assert b"".join(got) == b"".join(keys)
            assert environment.native_keys - before == len(keys)
        # Where mapping again does not help, LMDB's cursor gives the rest.
        short = _engine.PageReader(head, psize)
        environment._pages = short
        remap = environment._map_pages
        environment._map_pages = lambda: setattr(environment, "_pages", short)  # type: ignore[method-assign]
        try:
            before = environment.native_keys
            with environment.txn(buffers=False) as txn:
                assert b"".join(environment.keys(txn, NAME, db, 500)) == b"".join(keys)
            assert 0 < environment.native_keys - before < len(keys)
        finally:
            environment._map_pages = remap  # type: ignore[method-assign]
        # An empty database; one the walk does not read (sorted duplicates).
        empty = environment.open_db(b"empty", create=True)
        dups = environment.lmdb.open_db(b"dups", dupsort=True)
        environment.write(lambda txn: [txn.put(k, b"x", db=dups) for k in keys[:10]])
        environment._map_pages()
        with environment.txn(buffers=False) as txn:
            assert list(environment.keys(txn, b"empty", empty, 10)) == []
            assert b"".join(environment.keys(txn, b"dups", dups, 3)) == b"".join(keys[:10])


def test_a_key_walk_refuses_what_it_cannot_walk(env: lmdb.Environment) -> None:
    keys = _digests(100, seed=13)
    db = _fill(env, keys)
    reader = _reader(env)
    with env.begin(buffers=False) as txn:
        record = txn.get(NAME)
        assert record is not None
        walk = reader.walk(record)
        assert isinstance(walk, _engine.KeyWalk)
        for most in (0, 1 << 40):
            with pytest.raises(ValueError, match="a batch of 1 to"):
                walk.next(most)
        assert walk.next(1000) == b"".join(sorted(keys)) and walk.next(5) == b""
        assert reader.walk(record, 8) is not None
        short = reader.walk(record, 8)  # the keys are 16 bytes
        assert isinstance(short, _engine.KeyWalk) and short.next(10) == _engine.PAGES_UNREADABLE
        assert reader.walk(record, 0) == _engine.PAGES_UNREADABLE
        assert reader.walk(record[:47]) == _engine.PAGES_UNREADABLE
        assert _engine.PageReader(b"", 4096).walk(record) == _engine.PAGES_BEYOND
    assert db is not None


def test_an_open_walks_the_in_flight_index_in_native_code_and_says_so(tmp_path: Path) -> None:
    """An open reads every digest of the in-flight index through the native key walk
    (``Environment.keys``), counted in ``stats()["lmdb"]["keys_walked_native"]``."""
    from dedupcore.store import DedupStore

    keys = [f"open-{i}" for i in range(2500)]
    with DedupStore.open(tmp_path / "s") as store:
        store.claim_many(keys, namespace="ns")  # left PROCESSING
        store.checkpoint()
    with DedupStore.open(tmp_path / "s") as store:
        stats = store.stats()
        assert stats["lmdb"]["keys_walked_native"] == len(keys)
        assert stats["in_flight"] == len(keys)
