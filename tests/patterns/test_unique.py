"""insert_once: business unique key on PostgreSQL, MariaDB and SQLite, DB-API and SQLAlchemy."""

from __future__ import annotations

from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.patterns.unique import SchemaError, insert_once, is_unique_violation

from .conftest import DB

PAYMENTS = (
    "id INT NOT NULL PRIMARY KEY, code VARCHAR(32) NOT NULL, invoice INT, "
    "amount INT NOT NULL CHECK (amount > 0), UNIQUE (invoice)"
)


def _payments(db: DB) -> str:
    return db.create("pay", PAYMENTS)


def test_new_then_duplicate_and_transaction_stays_usable(anydb: DB) -> None:
    table = _payments(anydb)
    log = anydb.create("log", "id INT NOT NULL")
    conn = anydb.connect()
    p = anydb.ph
    assert insert_once(conn, table, {"id": 1, "code": "a", "amount": 5}, ["id"]) is Outcome.NEW
    anydb.execute(conn, f"INSERT INTO {log} (id) VALUES ({p})", (1,))
    # The same key again, even with other values: DUPLICATE, nothing written, no error.
    row = {"id": 1, "code": "other", "amount": 7}
    assert insert_once(conn, table, row, ["id"]) is Outcome.DUPLICATE
    # The transaction goes on (PostgreSQL would have aborted it on an error).
    assert insert_once(conn, table, {"id": 2, "code": "b", "amount": 5}, ["id"]) is Outcome.NEW
    anydb.execute(conn, f"INSERT INTO {log} (id) VALUES ({p})", (2,))
    conn.commit()
    assert anydb.admin(f"SELECT id, code, amount FROM {table} ORDER BY id") == [
        (1, "a", 5),
        (2, "b", 5),
    ]
    assert anydb.count(log) == 2
    # Committed by another transaction: still DUPLICATE.
    other = anydb.connect()
    assert insert_once(other, table, {"id": 1, "code": "x", "amount": 1}, ["id"]) is (
        Outcome.DUPLICATE
    )
    other.rollback()


def test_composite_key_in_any_order(anydb: DB) -> None:
    table = anydb.create(
        "line", "order_id INT NOT NULL, line INT NOT NULL, qty INT, UNIQUE (order_id, line)"
    )
    conn = anydb.connect()
    row = {"order_id": 7, "line": 1, "qty": 3}
    assert insert_once(conn, table, row, ["line", "order_id"]) is Outcome.NEW
    assert insert_once(conn, table, row, ["order_id", "line"]) is Outcome.DUPLICATE
    assert insert_once(conn, table, {**row, "line": 2}, ["order_id", "line"]) is Outcome.NEW
    conn.commit()
    assert anydb.count(table) == 2


def _raises(db: DB, conn: Any, fn: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    conn.rollback()
    return info.value


def test_only_the_business_key_is_a_duplicate(anydb: DB) -> None:
    table = _payments(anydb)
    conn = anydb.connect()
    assert insert_once(conn, table, {"id": 1, "code": "a", "invoice": 9, "amount": 5}, ["id"]) is (
        Outcome.NEW
    )
    conn.commit()
    # Another unique constraint (invoice) conflicts: an error, not a DUPLICATE.
    exc = _raises(
        anydb,
        conn,
        lambda: insert_once(conn, table, {"id": 2, "code": "b", "invoice": 9, "amount": 5}, ["id"]),
    )
    assert is_unique_violation(exc)
    # NOT NULL and CHECK violations propagate and are not unique violations.
    exc = _raises(
        anydb, conn, lambda: insert_once(conn, table, {"id": 3, "code": None, "amount": 5}, ["id"])
    )
    assert not is_unique_violation(exc)
    exc = _raises(
        anydb, conn, lambda: insert_once(conn, table, {"id": 4, "code": "c", "amount": -1}, ["id"])
    )
    assert not is_unique_violation(exc)
    assert anydb.count(table) == 1


def test_setup_errors(db: DB) -> None:
    anydb = db
    plain = anydb.create("plain", "id INT NOT NULL, code VARCHAR(10)")
    partial = anydb.create("wide", "a INT NOT NULL, b INT NOT NULL, UNIQUE (a, b)")
    conn = anydb.connect()
    with pytest.raises(
        SchemaError, match=r"no unique constraint or unique index over exactly \(id\)"
    ):
        insert_once(conn, plain, {"id": 1}, ["id"])
    # A unique index over (a, b) does not make a alone unique.
    with pytest.raises(SchemaError, match=r"exactly \(a\)"):
        insert_once(conn, partial, {"a": 1, "b": 1}, ["a"])
    with pytest.raises(SchemaError, match="no column 'nope'"):
        insert_once(conn, partial, {"a": 1, "b": 1, "nope": 2}, ["a", "b"])
    with pytest.raises(SchemaError, match="does not exist"):
        insert_once(conn, "no_such_table_here", {"a": 1}, ["a"])
    conn.rollback()
    assert anydb.count(plain) == 0


def test_bad_input(db: DB) -> None:
    anydb = db
    table = _payments(anydb)
    conn = anydb.connect()
    row = {"id": 1, "code": "a", "amount": 5}
    with pytest.raises(ValueError, match="SQL identifier"):
        insert_once(conn, f"{table}; DROP TABLE x", row, ["id"])
    with pytest.raises(ValueError, match="SQL identifier"):
        insert_once(conn, table, {"id": 1, 'code" text': "a"}, ["id"])
    with pytest.raises(TypeError, match="table must be str"):
        insert_once(conn, 5, row, ["id"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="row must be a mapping"):
        insert_once(conn, table, [("id", 1)], ["id"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unique must be a sequence"):
        insert_once(conn, table, row, "id")
    with pytest.raises(ValueError, match="at least one column"):
        insert_once(conn, table, row, [])
    with pytest.raises(ValueError, match="not in the row"):
        insert_once(conn, table, {"code": "a", "amount": 5}, ["id"])
    with pytest.raises(ValueError, match="NULLs never conflict"):
        insert_once(conn, table, {**row, "id": None}, ["id"])
    with pytest.raises(ValueError, match="cannot tell the SQL dialect"):
        insert_once(object(), table, row, ["id"])
    conn.rollback()
    assert anydb.count(table) == 0


@pytest.mark.parametrize("winner_ends", ["commit", "rollback"])
def test_concurrent_insert_waits_for_the_first(anydb: DB, winner_ends: str, in_thread: Any) -> None:
    table = _payments(anydb)
    first, second = anydb.connect(), anydb.connect()
    assert insert_once(first, table, {"id": 1, "code": "w", "amount": 1}, ["id"]) is Outcome.NEW

    def contend() -> Outcome:
        out = insert_once(second, table, {"id": 1, "code": "l", "amount": 2}, ["id"])
        second.commit()
        return out

    thread, out = in_thread(contend)
    anydb.wait_blocked(second, thread)
    getattr(first, winner_ends)()
    thread.join(30)
    assert "error" not in out, out.get("error")
    expected = Outcome.DUPLICATE if winner_ends == "commit" else Outcome.NEW
    assert out["value"] is expected
    code = "w" if winner_ends == "commit" else "l"
    assert anydb.admin(f"SELECT code FROM {table}") == [(code,)]
