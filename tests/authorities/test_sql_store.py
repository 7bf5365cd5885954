"""SqlStore against the machine's PostgreSQL and MariaDB, and SQLite: semantics, races, faults.

Every test gets a table of its own (a random name, dropped afterwards), so
runs do not see each other's keys. PostgreSQL and MariaDB (the shared servers of
tests/support/servers.py) skip their tests when they do not answer, and fail
them under CI=true.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, SchemaError, StaleTokenError, UnavailableError
from dedupcore.record import State
from dedupcore.sql import SqlStore
from dedupcore.tiers.base import RequestRefusedError
from tests.support.servers import SERVERS, require_server
from tests.support.stores import Counting, SqlTable, counting_store, sql_table

NS = "orders/billing"
ENGINES = ("postgresql", "mysql", "sqlite")


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlTable]:
    """An engine with a fresh dedup table, dropped afterwards."""
    eng = sql_table(request.param, tmp_path)
    with eng.store() as s:
        s.init_schema()
    yield eng
    eng.drop()


@pytest.fixture
def store(engine: SqlTable) -> Iterator[SqlStore]:
    with engine.store() as s:
        yield s


# -- semantics -----------------------------------------------------------------------


def test_outcomes_results_and_tokens(store: SqlStore) -> None:
    c = store.claim("k", namespace=NS)
    assert c.outcome is Outcome.NEW and c.token == 1 and not c.takeover
    assert store.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
    store.complete("k", c.token, namespace=NS, result={"charged": 100, 7: [b"\x00", None]})
    dup = store.claim("k", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == {"charged": 100, 7: [b"\x00", None]}
    assert dup.token == 1 and dup.exact
    store.complete("k", c.token, namespace=NS, result="ignored")  # retried completion: no-op
    rec = store.get("k", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.token == 1
    assert rec.result == {"charged": 100, 7: [b"\x00", None]}
    assert rec.owner is None and rec.fingerprint is None
    assert abs(rec.created - time.time()) < 60 and rec.updated >= rec.created
    assert store.get("other", namespace=NS) is None
    with pytest.raises(StaleTokenError, match="already completed"):
        store.release("k", c.token, namespace=NS)


def test_keys_are_bytes_namespaces_are_exact(store: SqlStore) -> None:
    assert store.claim("k", namespace=NS).outcome is Outcome.NEW
    assert store.claim(b"k", namespace=NS).outcome is Outcome.IN_PROGRESS  # str is UTF-8
    assert store.claim("k", namespace="orders/Billing").outcome is Outcome.NEW  # case matters
    for key in (b"\x00", b"\xff\xfe\x00'\\", "é", b"k ", b"x" * 512):
        c = store.claim(key, namespace=NS)
        assert c.outcome is Outcome.NEW, key
        store.complete(key, c.token, namespace=NS, result=key)
        assert store.claim(key, namespace=NS).result == key
    assert store.claim(b"k\x00", namespace=NS).outcome is Outcome.NEW  # no padding, no trimming


def test_release_then_higher_token_and_stale_owner(store: SqlStore) -> None:
    c = store.claim(b"k", namespace=NS)
    store.release(b"k", c.token, namespace=NS)
    rec = store.get(b"k", namespace=NS)
    assert rec is not None and rec.state is State.RELEASED and rec.token == 1
    again = store.claim(b"k", namespace=NS)
    assert again.outcome is Outcome.NEW and again.token == 2 and not again.takeover
    with pytest.raises(StaleTokenError):
        store.complete(b"k", c.token, namespace=NS)
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.complete(b"never", 1, namespace=NS)
    store.release(b"k", again.token, namespace=NS)
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.release(b"k", again.token, namespace=NS)
    assert store.claim(b"k", namespace=NS).token == 3


def test_lease_takeover_on_the_server_clock(store: SqlStore) -> None:
    first = store.claim("k", namespace=NS, lease=2.0, owner="a")
    assert store.claim("k", namespace=NS, owner="a", lease=2.0).token == first.token  # own back
    assert store.claim("k", namespace=NS, owner="b").outcome is Outcome.IN_PROGRESS
    store.claim("k", namespace=NS, lease=0.3, owner="a")  # renew shorter, then let it lapse
    time.sleep(0.5)
    taken = store.claim("k", namespace=NS, owner="b", lease=30)
    assert taken.outcome is Outcome.NEW and taken.takeover and taken.token == first.token + 1
    assert store.claim("k", namespace=NS, owner="a").outcome is Outcome.IN_PROGRESS
    with pytest.raises(StaleTokenError, match="not the key's current token"):
        store.complete("k", first.token, namespace=NS)
    rec = store.get("k", namespace=NS)
    assert rec is not None and rec.owner == b"b" and rec.state is State.PROCESSING
    store.complete("k", taken.token, namespace=NS, result=1)
    assert store.claim("k", namespace=NS).result == 1


def test_renewal_keeps_the_lease_alive(store: SqlStore) -> None:
    store.claim("k", namespace=NS, lease=1.0, owner="a")
    for _ in range(4):  # 1.2 s in all: past the first lease, so only renewals keep it
        time.sleep(0.3)
        assert store.claim("k", namespace=NS, lease=1.0, owner="a").outcome is Outcome.NEW
        assert store.claim("k", namespace=NS, owner="b").outcome is Outcome.IN_PROGRESS


def test_conflict_and_stale_token_change_nothing(store: SqlStore) -> None:
    store.claim("k", namespace=NS, fingerprint=b"one")
    assert store.claim("k", namespace=NS, fingerprint=b"one").outcome is Outcome.IN_PROGRESS
    with pytest.raises(ConflictError):
        store.claim_many(["fresh", "k"], namespace=NS, fingerprints=[None, b"two"])
    assert store.get("fresh", namespace=NS) is None  # the batch's INSERT was rolled back
    assert store.claim("fresh", namespace=NS).outcome is Outcome.NEW
    a = store.claim("a", namespace=NS)
    with pytest.raises(StaleTokenError):
        store.complete_many([("a", a.token), ("fresh", 99)], namespace=NS)
    assert store.get("a", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    with pytest.raises(StaleTokenError):
        store.release_many([("a", a.token), ("never", 1)], namespace=NS)
    assert store.get("a", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    # A conflict inside one batch (same key, two fingerprints) also claims nothing.
    with pytest.raises(ConflictError):
        store.claim_many(["b", "b"], namespace=NS, fingerprints=[b"x", b"y"])
    assert store.get("b", namespace=NS) is None


def test_fingerprint_survives_takeover(store: SqlStore) -> None:
    store.claim("k", namespace=NS, lease=0.1, fingerprint=b"fp")
    time.sleep(0.3)
    taken = store.claim("k", namespace=NS)  # no fingerprint: the stored one stays
    assert taken.takeover
    with pytest.raises(ConflictError):
        store.claim("k", namespace=NS, fingerprint=b"other")
    store.release("k", taken.token, namespace=NS)
    # A released key is claimed afresh: its fingerprint is the new request's.
    assert store.claim("k", namespace=NS, fingerprint=b"other").token == taken.token + 1


def test_batch_with_repeated_key(store: SqlStore) -> None:
    claims = store.claim_many([b"x", b"y", b"x"], namespace=NS)
    assert [c.outcome for c in claims] == [Outcome.NEW, Outcome.NEW, Outcome.IN_PROGRESS]
    mine = store.claim_many([b"p", b"p"], namespace=NS, owner="me")
    assert [(c.outcome, c.token) for c in mine] == [(Outcome.NEW, 1), (Outcome.NEW, 1)]
    store.complete_many([(b"x", 1, "a"), (b"x", 1, "b")], namespace=NS)  # second is a no-op
    assert store.claim(b"x", namespace=NS).result == "a"
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.release_many([(b"y", 1), (b"y", 1)], namespace=NS)
    assert store.get(b"y", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    assert store.claim_many([], namespace=NS) == []
    store.complete_many([], namespace=NS)


def test_mixed_batch(store: SqlStore) -> None:
    done = store.claim("done", namespace=NS)
    store.complete("done", done.token, namespace=NS, result=b"r")
    store.claim("busy", namespace=NS, owner="other")
    gone = store.claim("gone", namespace=NS)
    store.release("gone", gone.token, namespace=NS)
    store.claim("late", namespace=NS, lease=0.1)
    time.sleep(0.3)
    keys = ["fresh", "done", "busy", "gone", "late", "fresh"]
    got = store.claim_many(keys, namespace=NS, owner="me")
    assert [(c.outcome, c.token, c.takeover) for c in got] == [
        (Outcome.NEW, 1, False),
        (Outcome.DUPLICATE, 1, False),
        (Outcome.IN_PROGRESS, 1, False),
        (Outcome.NEW, 2, False),
        (Outcome.NEW, 2, True),
        (Outcome.NEW, 1, False),
    ]
    assert got[1].result == b"r"
    store.complete_many([("fresh", 1, 1), ("gone", 2, 2), ("late", 2, None)], namespace=NS)
    assert [c.result for c in store.claim_many(["fresh", "gone", "late"], namespace=NS)] == [
        1,
        2,
        None,
    ]


def test_results_up_to_the_limit(engine: SqlTable) -> None:
    with engine.store(max_result_bytes=70_000) as store:
        big = b"r" * 65_000
        c = store.claim("k", namespace=NS)
        store.complete("k", c.token, namespace=NS, result=big)
        assert store.claim("k", namespace=NS).result == big
        c = store.claim("k2", namespace=NS)
        with pytest.raises(ValueError, match="max_result_bytes"):
            store.complete("k2", c.token, namespace=NS, result=b"r" * 70_001)
        with pytest.raises(TypeError, match="msgpack"):
            store.complete("k2", c.token, namespace=NS, result=object())
        assert store.get("k2", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]


def _kinds(conn: Counting) -> list[str]:
    kinds = [s.split()[0] for s in conn.statements if not s.startswith("BEGIN")]
    del conn.statements[:]
    return kinds


def test_one_insert_per_batch(engine: SqlTable) -> None:
    store, conns = counting_store(engine)
    keys = [f"k{i}" for i in range(1000)]
    del conns[0].statements[:]
    store.claim_many(keys, namespace=NS)
    writes = [s for s in conns[0].statements if s.startswith(("INSERT", "SELECT", "UPDATE"))]
    # PostgreSQL and SQLite learn the created keys from RETURNING; MariaDB reads them back.
    assert [s.split()[0] for s in writes] == (
        ["INSERT", "SELECT"] if engine.name == "mysql" else ["INSERT"]
    )
    del conns[0].statements[:]
    if engine.name == "postgresql":
        # A namespace that has only seen fresh keys tries a plain INSERT (no ON CONFLICT):
        # it fails on the first existing key, and the transaction runs again the safe way.
        store.claim_many(keys, namespace=NS)
        assert _kinds(conns[0]) == ["INSERT", "INSERT", "SELECT"]
        assert store.stats().get("retries", 0) == 0
    store.claim_many(keys, namespace=NS)  # all in progress: INSERT finds them, one SELECT
    assert _kinds(conns[0]) == ["INSERT", "SELECT"]
    store.complete_many([(k, 1, k) for k in keys], namespace=NS)
    assert _kinds(conns[0]) == ["SELECT", "UPDATE"]
    store.close()


def test_mostly_duplicate_batches_are_read_first(engine: SqlTable) -> None:
    store, conns = counting_store(engine)
    keys = [f"k{i}".encode() for i in range(1000)]
    fps = [b"fp"] * len(keys)
    claims = store.claim_many(keys, namespace=NS, fingerprints=fps)
    store.complete_many([(k, c.token, k) for k, c in zip(keys, claims, strict=True)], namespace=NS)
    del conns[0].statements[:]
    pg = engine.name == "postgresql"
    # The first batches of a namespace go insert-first; the DUPLICATE share is followed.
    first = ["INSERT", "INSERT", "SELECT"] if pg else ["INSERT", "SELECT"]
    for expected in (first, ["INSERT", "SELECT"]):
        dups = store.claim_many(keys, namespace=NS)
        assert all(c.outcome is Outcome.DUPLICATE for c in dups)
        assert _kinds(conns[0]) == expected
    dups = store.claim_many(keys, namespace=NS, fingerprints=fps)
    assert [(c.outcome, c.token, c.result) for c in dups] == [
        (Outcome.DUPLICATE, 1, k) for k in keys
    ]
    if not pg:  # MariaDB and SQLite keep insert-first
        assert _kinds(conns[0]) == ["INSERT", "SELECT"]
        store.close()
        return
    # All PROCESSED: one unlocked SELECT, no write transaction.
    assert _kinds(conns[0]) == ["SELECT"]
    # Mixed: the absent keys are inserted, nothing else is locked.
    fresh = [f"new{i}".encode() for i in range(100)]
    got = store.claim_many(keys[:900] + fresh, namespace=NS)
    assert [c.outcome for c in got] == [Outcome.DUPLICATE] * 900 + [Outcome.NEW] * 100
    assert _kinds(conns[0]) == ["SELECT", "INSERT"]
    # A key in progress among processed ones: read, then locked (no INSERT).
    got = store.claim_many(keys[:999] + fresh[:1], namespace=NS)
    assert got[-1].outcome is Outcome.IN_PROGRESS
    assert _kinds(conns[0]) == ["SELECT", "SELECT"]
    # A PROCESSED row with another fingerprint: ConflictError before anything is written.
    with pytest.raises(ConflictError):
        store.claim_many([b"brand-new", keys[5]], namespace=NS, fingerprints=[None, b"other"])
    assert _kinds(conns[0]) == ["SELECT"]
    assert store.get(b"brand-new", namespace=NS) is None
    store.close()


@pytest.mark.parametrize("engine", ["postgresql"], indirect=True)  # only PostgreSQL reads first
def test_read_first_races_with_purge(engine: SqlTable, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the unlocked read saw may be gone by the write transaction (purge deleted it)."""
    store, conns = counting_store(engine)
    keys = [f"k{i}".encode() for i in range(10)]
    claims = store.claim_many(keys, namespace=NS)
    store.complete_many(
        [(k, c.token, "r") for k, c in zip(keys, claims, strict=True)], namespace=NS
    )
    for _ in range(3):
        store.claim_many(keys, namespace=NS)
    d = store._dialect
    assert d is not None
    real = d.read_rows

    def stale(cur: Any, table: str, ns: str, batch: list[bytes]) -> list[Any]:
        rows = real(cur, table, ns, batch)
        # "gone-done" was PROCESSED and purged since; "gone-busy" was a tombstone, purged.
        return [
            *rows,
            (b"gone-done", 2, 4, None, None, None),
            (b"gone-busy", 3, 7, None, None, None),
        ]

    monkeypatch.setattr(d, "read_rows", stale)
    del conns[0].statements[:]
    got = store.claim_many([*keys, b"gone-done", b"gone-busy"], namespace=NS)
    # A processed key that retention dropped is still answered DUPLICATE (it was final);
    # the vanished tombstone is created again by the retried transaction.
    assert [(c.outcome, c.token) for c in got[-2:]] == [(Outcome.DUPLICATE, 4), (Outcome.NEW, 1)]
    assert all(c.outcome is Outcome.DUPLICATE for c in got[:-2])
    assert _kinds(conns[0]) == ["SELECT", "SELECT", "INSERT"]  # read, lock (gone), retry
    assert store.get(b"gone-done", namespace=NS) is None  # nothing written for it
    rec = store.get(b"gone-busy", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSING
    store.close()


def test_purge_deletes_rows_past_their_window(engine: SqlTable) -> None:
    short = Retention(exact_window=0.3)
    with engine.store(namespaces={"short": short}) as store:
        for key in ("done", "busy", "gone"):
            store.claim(key, namespace="short", lease=30)
        store.claim("abandoned", namespace="short", lease=0.1)
        store.complete("done", 1, namespace="short")
        store.release("gone", 1, namespace="short")
        c = store.claim("kept", namespace=NS)
        store.complete("kept", c.token, namespace=NS)
        time.sleep(0.5)
        assert store.purge() == 2
        assert store.get("done", namespace="short") is None
        assert store.get("gone", namespace="short") is None
        assert store.get("busy", namespace="short") is not None  # its lease is still running
        assert store.get("kept", namespace=NS) is not None  # default window: 7 days
        # An abandoned claim becomes a tombstone first: its token keeps growing.
        rec = store.get("abandoned", namespace="short")
        assert rec is not None and rec.state is State.RELEASED and rec.token == 1
        with pytest.raises(StaleTokenError):
            store.complete("abandoned", 1, namespace="short")
        assert store.stats()["tombstoned"] == 1
        time.sleep(0.5)
        assert store.purge() == 1  # one window later the tombstone goes too
        assert store.get("abandoned", namespace="short") is None
        assert store.claim("busy", namespace="short").outcome is Outcome.IN_PROGRESS
        with pytest.raises(ValueError):
            store.purge(limit=0)


def test_purge_in_bounded_batches(engine: SqlTable) -> None:
    with engine.store(retention=Retention(exact_window=0.2)) as store:
        keys = [f"k{i}" for i in range(25)]
        store.claim_many(keys, namespace=NS)
        store.complete_many([(k, 1) for k in keys], namespace=NS)
        time.sleep(0.4)
        assert [store.purge(limit=10) for _ in range(4)] == [10, 10, 5, 0]


def test_purge_copies_processed_keys_before_deleting(engine: SqlTable) -> None:
    with engine.store(retention=Retention(exact_window=0.3)) as store:
        done = {ns: [f"{ns}-{i}".encode() for i in range(12)] for ns in ("a", "b")}
        for ns, keys in done.items():
            store.claim_many(keys, namespace=ns)
            store.complete_many([(k, 1) for k in keys], namespace=ns)
        gone = store.claim("gone", namespace="a")
        store.release("gone", gone.token, namespace="a")
        store.claim("busy", namespace="a")
        time.sleep(0.5)
        total = sum(len(k) for k in done.values()) + 1

        def present() -> int:
            rows = engine.execute(f"SELECT COUNT(*) FROM {engine.table}")
            return int(rows[0][0])

        def failing(namespace: str, keys: list[bytes]) -> None:
            assert present() == total + 1  # nothing is deleted before the copy
            raise RuntimeError("cold archive is full")

        with pytest.raises(RuntimeError, match="archive is full"):
            store.purge(before_delete=failing)
        assert present() == total + 1  # the copy failed: every row stays
        assert store.claim("a-0", namespace="a").outcome is Outcome.DUPLICATE

        copied: list[tuple[str, list[bytes]]] = []
        rows_before: list[int] = []

        def copy(namespace: str, keys: list[bytes]) -> None:
            assert present() == rows_before[-1]  # the copy runs before the delete
            copied.append((namespace, list(keys)))

        # Bounded chunks; a tombstone is deleted but never copied.
        deleted = []
        for _ in range(4):
            rows_before.append(present())
            deleted.append(store.purge(limit=10, before_delete=copy))
        assert deleted == [10, 10, total - 20, 0]
        got: dict[str, list[bytes]] = {}
        for ns, keys in copied:
            got.setdefault(ns, []).extend(keys)
        assert {ns: sorted(k) for ns, k in got.items()} == {ns: sorted(k) for ns, k in done.items()}
        assert sum(len(k) for _, k in copied) == total - 1
        assert present() == 1  # only the claim whose lease still runs
        assert store.get("gone", namespace="a") is None
        assert store.claim("busy", namespace="a").outcome is Outcome.IN_PROGRESS
        with pytest.raises(TypeError):
            store.purge(before_delete="not callable")  # type: ignore[arg-type]


def test_init_schema_is_idempotent_and_stats(store: SqlStore, engine: SqlTable) -> None:
    store.init_schema()
    store.claim("k", namespace=NS)
    store.claim("k", namespace=NS)
    stats = store.stats()
    assert stats["engine"] == engine.name and stats["table"] == engine.table
    assert stats["new"] == 1 and stats["in_progress"] == 1
    prefix = {"postgresql": "PostgreSQL ", "mysql": "MySQL/MariaDB ", "sqlite": "SQLite "}
    assert store.server_version().startswith(prefix[engine.name])


# -- bad input ----------------------------------------------------------------------


def test_bad_input_raises_before_any_sql(engine: SqlTable) -> None:
    store, conns = counting_store(engine)
    statements = conns[0].statements
    del statements[:]
    for key, error in ((b"", ValueError), (b"x" * 513, ValueError), (5, TypeError)):
        with pytest.raises(error):
            store.claim(key, namespace=NS)  # type: ignore[arg-type]
        with pytest.raises(error):
            store.complete(key, 1, namespace=NS)  # type: ignore[arg-type]
        with pytest.raises(error):
            store.get(key, namespace=NS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_key_bytes=512"):
        store.claim_many(["ok", "y" * 513], namespace=NS)
    with pytest.raises(ValueError):
        store.claim("k", namespace="bad namespace")
    with pytest.raises(ValueError):
        store.claim("k", namespace="")
    with pytest.raises(TypeError):
        store.claim("k", namespace=b"ns")  # type: ignore[arg-type]
    for lease in (0, -1, float("nan"), float("inf"), 1e12, 1e39, 30 * 86400 + 1, 0.0009):
        with pytest.raises(ValueError, match="lease"):
            store.claim("k", namespace=NS, lease=lease)
    with pytest.raises(ValueError, match="max_result_bytes"):
        store.complete("k", 1, namespace=NS, result=b"r" * 70000)
    for limit in (0, 10**20):
        with pytest.raises(ValueError, match="limit"):
            store.purge(limit=limit)
    with pytest.raises(ValueError, match="limit"):
        store.sweep(limit=10**20)
    with pytest.raises(TypeError):
        store.claim("k", namespace=NS, lease="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.claim("k", namespace=NS, owner=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.claim("k", namespace=NS, owner=b"o" * 256)
    with pytest.raises(TypeError):
        store.claim("k", namespace=NS, fingerprint="fp")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.claim_many(["a", "b"], namespace=NS, fingerprints=[b"x"])
    for token, error in (
        (0, ValueError),
        (1 << 63, ValueError),
        ("1", TypeError),
        (True, TypeError),
    ):
        with pytest.raises(error):
            store.complete("k", token, namespace=NS)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.complete_many([("k",)], namespace=NS)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        store.release_many([("k", 1, "result")], namespace=NS)  # type: ignore[list-item]
    assert statements == []  # nothing reached the database
    store.close()


def test_bad_settings_are_refused_before_connecting() -> None:
    # A URL where nothing listens: every error below comes from the checks, none from a
    # connection attempt.
    url = "postgresql://postgres@127.0.0.1:1/test"
    huge = Retention(exact_window=1e39)
    for options in (
        {"lease": 1e39},
        {"lease": 30 * 86400 + 1},
        {"retention": huge},
        {"namespaces": {NS: huge}},
        {"namespaces": {"bad ns": Retention()}},
        {"retention": Retention(cold_window=1e12)},
        {"max_result_bytes": 10**12},
        {"max_key_bytes": 10**6},
        {"retries": 10**6},
        {"timeout": 0},
        {"timeout": 1e39},
        {"timeout": float("nan")},
        {"hang_timeout": -1},
    ):
        with pytest.raises(ValueError):
            SqlStore.from_url(url, **options)
    for options in ({"retention": 7}, {"lease": "1"}, {"timeout": "5"}):
        with pytest.raises(TypeError):
            SqlStore.from_url(url, **options)
    with pytest.raises(ValueError, match="read_timeout"):
        SqlStore.from_url("mysql://root@127.0.0.1:1/test?read_timeout=0")
    with pytest.raises(ValueError, match="bad PostgreSQL URL"):
        SqlStore.from_url(url + "?no_such_parameter=1")
    store = SqlStore.from_url(url, lease=30 * 86400, retention=Retention(exact_window=3e9))
    with pytest.raises(UnavailableError):  # valid, so it gets as far as the (absent) server
        store.claim("k", namespace=NS)


def test_mariadb_timeouts_are_defaults_that_the_url_overrides() -> None:
    require_server("mariadb")

    def waits(store: SqlStore) -> tuple[float, float, float]:
        store.server_version()  # connects
        conn = store._conn
        # The read and write timeouts are caps: each call gives them its time left.
        out = (conn.connect_timeout, *conn._dedupcore_caps)
        assert conn._read_timeout <= out[1] and conn._write_timeout <= out[2]
        store.close()
        return out

    assert waits(SqlStore.from_url(SERVERS.mariadb)) == (5.0, 5.0, 5.0)
    assert waits(SqlStore.from_url(SERVERS.mariadb, timeout=1.5)) == (1.5, 1.5, 1.5)
    assert waits(SqlStore.from_url(SERVERS.mariadb + "?read_timeout=7", timeout=1)) == (1, 7.0, 1)
    own = SqlStore.from_url(SERVERS.mariadb, connect_args={"write_timeout": 9})
    assert waits(own) == (5.0, 5.0, 9)


def test_a_refused_request_is_a_value_error_not_unavailability(store: SqlStore) -> None:
    # Data the checks let through but the database refuses (here: past the key column,
    # which is 512 bytes on MariaDB, or against the token CHECK elsewhere).
    def too_big(cur: Any) -> None:
        d = store._dialect
        assert d is not None
        if d.name == "mysql":
            d.insert_fresh(cur, store.table, NS, [b"k" * 600], [None], None, 1.0, b"n" * 16)
        else:
            cur.execute(
                f"INSERT INTO {d.q(store.table)} (namespace, {d.q('key')}, state, token, "
                f"created, updated) VALUES ({d.ph}, {d.ph}, 1, -1, 0, 0)"
                if d.name == "sqlite"
                else f"INSERT INTO {d.q(store.table)} (namespace, {d.q('key')}, state, token, "
                "created, updated) VALUES (%s, %s, 1, -1, now(), now())",
                [NS, b"k"],
            )

    with pytest.raises(RequestRefusedError) as info:
        store._tx(too_big)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, UnavailableError)
    assert store.stats()["refused"] == 1 and "unavailable" not in store.stats()
    # Nothing was written, and the same connection goes on.
    assert store.get("k", namespace=NS) is None
    assert store.claim("k", namespace=NS).outcome is Outcome.NEW


def test_durability_is_told_on_first_connect(
    engine: SqlTable, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dedupcore"), engine.store() as store:
        assert caplog.records == []  # nothing is sent before the first call
        store.claim("k", namespace=NS)
        store.claim("k2", namespace=NS)
        said = store.durability()
    told = [r for r in caplog.records if "durability" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.INFO and said in told[0].getMessage()
    assert "power loss" in said


def test_sqlite_without_sync_warns_on_first_connect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(tmp_path / "x.db", check_same_thread=False)
        conn.execute("PRAGMA synchronous = OFF")
        return conn

    store = SqlStore(connect, dialect="sqlite")
    with caplog.at_level(logging.WARNING, logger="dedupcore"):
        store.init_schema()
    (warning,) = caplog.records
    assert "can lose committed claims: synchronous 0" in warning.getMessage()
    assert store.durability().startswith("synchronous 0")
    store.close()


def test_bad_configuration(engine: SqlTable) -> None:
    if engine.name == "mysql":
        with pytest.raises(ValueError, match="at most 512 bytes"):
            engine.store(max_key_bytes=1024)
    for table in ("bad-name", "x; DROP TABLE y", ""):
        with pytest.raises(ValueError, match="table"):
            engine.store(table=table)
    with pytest.raises(ValueError, match="scheme"):
        SqlStore.from_url("oracle://x")
    with pytest.raises(ValueError, match="sqlite"):
        SqlStore.from_url("sqlite://relative.db")
    with pytest.raises(ValueError, match="dialect"):
        SqlStore(lambda: object())


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    for url, args in (
        ("postgresql://postgres@127.0.0.1:1/test", {"connect_timeout": 2}),
        ("mysql://root@127.0.0.1:1/test", {"connect_timeout": 2}),
        (f"sqlite:///{tmp_path}/no/such/dir/x.db", {}),
    ):
        store = SqlStore.from_url(url, connect_args=args)  # opens: nothing is sent yet
        with pytest.raises(UnavailableError):
            store.claim("k", namespace=NS)
        with pytest.raises(UnavailableError):
            store.complete("k", 1, namespace=NS)
        with pytest.raises(UnavailableError):
            store.get("k", namespace=NS)
        with pytest.raises(UnavailableError):
            store.init_schema()
        assert store.stats()["unavailable"] == 4


# -- faults -------------------------------------------------------------------------


def test_connection_dropped_between_claim_and_complete(engine: SqlTable) -> None:
    store, conns = engine.tracked_store()
    c = store.claim("k", namespace=NS)
    engine.kill(conns[-1])
    with pytest.raises(UnavailableError):
        store.complete("k", c.token, namespace=NS, result="done")
    # Nothing was completed: another store on its own connection finds the claim...
    with engine.store() as other:
        rec = other.get("k", namespace=NS)
        assert rec is not None and rec.state is State.PROCESSING and rec.token == c.token
        # ... and completes it with the token (the work was done once).
        other.complete("k", c.token, namespace=NS, result="done")
        assert other.claim("k", namespace=NS).outcome is Outcome.DUPLICATE
    # A claim on a dropped connection is an error, never NEW.
    store.claim("warm", namespace=NS)  # the store reconnected on its next call
    assert len(conns) == 2
    engine.kill(conns[-1])
    with pytest.raises(UnavailableError):
        store.claim("fresh", namespace=NS)
    with engine.store() as other:
        assert other.get("fresh", namespace=NS) is None
    dup = store.claim("k", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == "done"
    assert store.stats()["unavailable"] == 2
    store.close()


def _race(url: str, table: str, keys: list[str], seed: int, start: Any, queue: Any) -> None:
    store = SqlStore.from_url(url, table=table)
    order = keys[:]
    random.Random(seed).shuffle(order)
    new = []
    start.wait(60)  # every process is connected: the batches really overlap
    for i in range(0, len(order), 250):
        new += [
            c.key
            for c in store.claim_many(order[i : i + 250], namespace=NS)
            if c.outcome is Outcome.NEW
        ]
    queue.put((new, store.stats().get("retries", 0)))
    store.close()


def test_processes_racing_on_the_same_keys_get_one_new_each(engine: SqlTable) -> None:
    keys = [f"k{i}" for i in range(5000)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_race, args=(engine.url, engine.table, keys, seed, start, queue))
        for seed in range(4)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    winners = [k for new, _ in results for k in new]
    print(
        f"{engine.name}: NEW per process {[len(n) for n, _ in results]}, "
        f"retries {[r for _, r in results]}"
    )
    assert len(winners) == len(keys)
    assert set(winners) == set(keys)
    with engine.store() as store:
        assert all(c.token == 1 for c in store.claim_many(keys, namespace=NS))


def test_missing_table_is_a_setup_error_not_unavailability(engine: SqlTable) -> None:
    with SqlStore.from_url(engine.url, table=f"{engine.table}_absent") as store:
        for call in (
            lambda: store.claim("k", namespace=NS),
            lambda: store.complete("k", 1, namespace=NS),
            lambda: store.get("k", namespace=NS),
        ):
            with pytest.raises(SchemaError, match="dedupcore sql init"):
                call()
        assert store.stats().get("unavailable", 0) == 0
