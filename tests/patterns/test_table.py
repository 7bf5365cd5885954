"""consume/ensure_table: the transactional dedup table on PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

import pytest

from dedupcore import BloomFilter, BloomRing
from dedupcore.api import Outcome
from dedupcore.patterns.table import Consumption, consume, ensure_table, stats
from dedupcore.patterns.unique import SchemaError

from . import _workers
from .conftest import DB

NS = "payments/ledger"


def _dedup(db: DB, conn: Any) -> str:
    table = db.table("consumed")
    ensure_table(conn, table)
    return table


def _accounts(db: DB) -> tuple[str, str]:
    accounts = db.create("acct", "id INT NOT NULL PRIMARY KEY, balance INT NOT NULL")
    changes = db.create(
        "chg", "account INT NOT NULL, delta INT NOT NULL, transfer VARCHAR(64) NOT NULL"
    )
    db.admin(f"INSERT INTO {accounts} (id, balance) VALUES (7, 0)")
    return accounts, changes


def _credit(db: DB, conn: Any, accounts: str, changes: str, msg: dict[str, Any]) -> Consumption:
    """The worked example: +amount to an account, a change-log row, once per transfer id."""
    p = db.ph
    with consume(conn, NS, msg["transfer"], table=msg["table"]) as c:
        if c.new:
            db.execute(
                conn,
                f"UPDATE {accounts} SET balance = balance + {p} WHERE id = {p}",
                (msg["amount"], msg["account"]),
            )
            db.execute(
                conn,
                f"INSERT INTO {changes} (account, delta, transfer) VALUES ({p}, {p}, {p})",
                (msg["account"], msg["amount"], msg["transfer"]),
            )
            if msg.get("fail"):
                raise RuntimeError("crash after the business writes")
            c.result = {"applied": msg["amount"]}
    return c


def test_account_balance_plus_100_once(anydb: DB) -> None:
    conn = anydb.connect()
    table = _dedup(anydb, conn)
    accounts, changes = _accounts(anydb)
    msg = {"transfer": "tx-1", "account": 7, "amount": 100, "table": table}
    first = _credit(anydb, conn, accounts, changes, msg)
    again = _credit(anydb, conn, accounts, changes, msg)
    assert first.outcome is Outcome.NEW and first.new
    assert again.outcome is Outcome.DUPLICATE and not again.new
    assert again.result == {"applied": 100}
    assert anydb.admin(f"SELECT balance FROM {accounts}") == [(100,)]
    assert anydb.count(changes) == 1
    assert anydb.count(table) == 1
    # A second connection (another consumer) sees it too.
    other = anydb.connect()
    assert _credit(anydb, other, accounts, changes, msg).outcome is Outcome.DUPLICATE
    assert anydb.admin(f"SELECT balance FROM {accounts}") == [(100,)]


def test_exception_rolls_back_business_and_dedup_row(anydb: DB) -> None:
    conn = anydb.connect()
    table = _dedup(anydb, conn)
    accounts, changes = _accounts(anydb)
    msg = {"transfer": "tx-2", "account": 7, "amount": 100, "table": table, "fail": True}
    with pytest.raises(RuntimeError, match="crash after"):
        _credit(anydb, conn, accounts, changes, msg)
    # Neither the balance, the change log nor the dedup row were committed...
    assert anydb.admin(f"SELECT balance FROM {accounts}") == [(0,)]
    assert anydb.count(changes) == 0 and anydb.count(table) == 0
    # ...so the redelivery runs the work.
    msg["fail"] = False
    assert _credit(anydb, conn, accounts, changes, msg).outcome is Outcome.NEW
    assert anydb.admin(f"SELECT balance FROM {accounts}") == [(100,)]
    assert anydb.count(changes) == 1 and anydb.count(table) == 1


def test_unserializable_result_rolls_back(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    with pytest.raises(TypeError, match="msgpack"), consume(conn, NS, "k", table=table) as c:
        c.result = object()
    assert db.count(table) == 0
    with consume(conn, NS, "k", table=table) as c:
        assert c.new and c.result is None
    with consume(conn, NS, "k", table=table) as c:
        assert c.outcome is Outcome.DUPLICATE and c.result is None


def _fronts(engine: str) -> dict[str, Any]:
    fronts: dict[str, Any] = {"bloom": BloomFilter(10_000, 0.001)}
    if engine == "sqlite":  # the front logic is the same on every engine
        fronts["ring"] = BloomRing(window=3600, slice_seconds=600, slice_capacity=10_000)
        fronts["set"] = set()
    return fronts


def test_front_filter_skips_the_select_for_fresh_keys(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    fronts = _fronts(db.engine)
    for kind, front in fronts.items():
        before = stats()
        for i in range(20):
            with consume(conn, NS, f"{kind}-{i}", table=table, front=front) as c:
                assert c.new
                assert c.statements == ["insert"]  # no SELECT for a key the front never saw
        assert stats().get("select", 0) - before.get("select", 0) == 0
        # Known keys: the front says "maybe", one SELECT answers, no failed insert.
        for i in range(20):
            with consume(conn, NS, f"{kind}-{i}", table=table, front=front) as c:
                assert c.outcome is Outcome.DUPLICATE
                assert c.statements == ["select"]
    # Without a front: straight to the insert; a duplicate costs the insert and a read.
    with consume(conn, NS, "bloom-0", table=table) as c:
        assert c.outcome is Outcome.DUPLICATE and c.statements == ["insert", "select"]
    # A front positive that is not in the table (another consumer's front, a false positive):
    # the SELECT finds nothing and the insert decides.
    front2: Any = {_front_key("absent")}
    with consume(conn, NS, "absent", table=table, front=front2) as c:
        assert c.new and c.statements == ["select", "insert"]
    assert db.count(table) == 20 * len(fronts) + 1


def _front_key(key: str) -> bytes:
    return NS.encode() + b"\x00" + key.encode()


def test_namespaces_and_bytes_keys(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    with consume(conn, "a/b", "k", table=table) as c:
        assert c.new
    with consume(conn, "a/b", b"k", table=table) as c:  # str keys are UTF-8
        assert not c.new
    with consume(conn, "a/B", "k", table=table) as c:  # namespaces are exact
        assert c.new
    with consume(conn, "a/b", b"\x00\xff" * 256, table=table) as c:  # 512 bytes, binary
        assert c.new
    with consume(conn, "a/b", b"\x00\xff" * 256, table=table) as c:
        assert not c.new


def test_ensure_table_idempotent_and_checked(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    ensure_table(conn, table)  # again: nothing changes
    with consume(conn, NS, "k", table=table) as c:
        assert c.new
    ensure_table(conn, table)
    assert db.count(table) == 1
    other = db.create("notdedup", "id INT NOT NULL PRIMARY KEY")
    with pytest.raises(SchemaError, match="no column"):
        ensure_table(conn, other)
    with (
        pytest.raises(SchemaError, match="does not exist"),
        consume(conn, NS, "k", table=db.table()),
    ):
        pass


def test_autocommit_connection_refused_before_writing(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    auto = db.raw_connect(autocommit=True)
    db.conns.append(auto)
    with pytest.raises(ValueError, match="autocommit") as info, consume(auto, NS, "k", table=table):
        pytest.fail("the body must not run")
    setting = {"postgresql": "autocommit=True", "mysql": "autocommit", "sqlite": "isolation_level"}
    assert setting[db.engine] in str(info.value)
    assert db.count(table) == 0


def test_sqlalchemy_autocommit_refused(tmp_path: Any) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.connect() as conn:
        ensure_table(conn, "dedup_sa")
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        with (
            pytest.raises(ValueError, match="AUTOCOMMIT"),
            consume(auto, NS, "k", table="dedup_sa"),
        ):
            pytest.fail("the body must not run")
    engine.dispose()


def test_bad_input(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    cases: list[tuple[Any, Any, Any, type[Exception], str]] = [
        (NS, "", table, ValueError, "must not be empty"),
        (NS, b"x" * 513, table, ValueError, "513 bytes"),
        (NS, 42, table, TypeError, "key must be bytes or str, not int"),
        (NS, None, table, TypeError, "not NoneType"),
        ("", "k", table, ValueError, "namespace must not be empty"),
        ("bad namespace!", "k", table, ValueError, "may only hold"),
        (b"ns", "k", table, TypeError, "namespace must be str"),
        (NS, "k", "dedup; DROP TABLE x", ValueError, "SQL identifier"),
        (NS, "k", "t" * 60, ValueError, "at most"),
    ]
    for ns, key, tbl, exc, match in cases:
        with pytest.raises(exc, match=match), consume(conn, ns, key, table=tbl):
            pytest.fail("the body must not run")
    with pytest.raises(ValueError, match="cannot tell the SQL dialect"), consume(object(), NS, "k"):
        pass
    assert db.count(table) == 0


@pytest.mark.parametrize("winner_ends", ["commit", "rollback"])
def test_second_consumer_waits_for_the_first(anydb: DB, winner_ends: str, in_thread: Any) -> None:
    first, second = anydb.connect(), anydb.connect()
    table = _dedup(anydb, first)
    cm = consume(first, NS, "contended", table=table)
    c = cm.__enter__()
    assert c.new
    c.result = "winner"

    def contend() -> tuple[Outcome, Any]:
        with consume(second, NS, "contended", table=table) as c2:
            if c2.new:
                c2.result = "second"
        return c2.outcome, c2.result

    thread, out = in_thread(contend)
    anydb.wait_blocked(second, thread)
    if winner_ends == "commit":
        cm.__exit__(None, None, None)
    else:
        # The block failed: consume rolls back and lets the exception through.
        assert cm.__exit__(RuntimeError, RuntimeError("body failed"), None) is False
    thread.join(30)
    assert "error" not in out, out.get("error")
    if winner_ends == "commit":
        assert out["value"] == (Outcome.DUPLICATE, "winner")
    else:
        assert out["value"] == (Outcome.NEW, "second")
    assert anydb.count(table) == 1


# -- real processes ---------------------------------------------------------------------


def _spawn() -> Any:
    return multiprocessing.get_context("spawn")


def test_four_processes_same_keys_exactly_once(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    business = db.create("biz", "k VARCHAR(64) NOT NULL, pid INT NOT NULL")
    keys = [f"order-{i}" for i in range(200)]
    ctx = _spawn()
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_workers.race,
            args=(db.engine, db.sqlite_path, table, business, keys, start, out),
        )
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r[3] for r in results if r[3]]
    assert not errors, errors
    new_keys = [k for r in results for k in r[1]]
    assert sorted(new_keys) == sorted(keys)  # exactly one NEW per key, over all processes
    rows = db.admin(f"SELECT k, COUNT(*) FROM {business} GROUP BY k")
    assert len(rows) == 200 and all(n == 1 for _, n in rows)
    # The stored result names the process that did the work.
    winners = {k: pid for pid, ks, _, _ in results for k in ks}
    with consume(conn, "race/consumers", "order-17", table=table) as c:
        assert c.outcome is Outcome.DUPLICATE and c.result == winners["order-17"]


def test_process_killed_inside_consume_leaves_key_claimable(db: DB) -> None:
    conn = db.connect()
    table = _dedup(db, conn)
    business = db.create("biz", "k VARCHAR(64) NOT NULL, pid INT NOT NULL")
    ctx = _spawn()
    inside = ctx.Event()
    proc = ctx.Process(
        target=_workers.hold, args=(db.engine, db.sqlite_path, table, business, "order-1", inside)
    )
    proc.start()
    try:
        assert inside.wait(60), "the worker never got inside consume"
    finally:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    p = db.ph
    with consume(conn, "race/consumers", "order-1", table=table) as c:
        assert c.new  # the killed transaction was rolled back: its claim is gone
        db.execute(conn, f"INSERT INTO {business} (k, pid) VALUES ({p}, {p})", ("order-1", 0))
    assert db.admin(f"SELECT k, pid FROM {business}") == [("order-1", 0)]
    assert db.count(table) == 1
