"""StateMachine: compare-and-set transitions on PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from dedupcore.patterns.state import StateMachine, Transition, TransitionOutcome
from dedupcore.patterns.table import consume, ensure_table
from dedupcore.patterns.unique import Conn, SchemaError

from .conftest import DB

APPLIED, REJECTED, CONFLICT = (
    TransitionOutcome.APPLIED,
    TransitionOutcome.REJECTED,
    TransitionOutcome.CONFLICT,
)
ORDER = {
    "created": {"pay": "paid", "cancel": "cancelled"},
    "paid": {"ship": "shipped", "refund": "created"},
    "shipped": {},
}
COLUMNS = (
    "id INT NOT NULL PRIMARY KEY, status VARCHAR(20) NOT NULL, version INT NOT NULL, "
    "updated_at DOUBLE PRECISION"
)


def _orders(db: DB, *rows: tuple[int, str, int]) -> str:
    table = db.create("orders", COLUMNS)
    for row in rows:
        db.admin(
            f"INSERT INTO {table} (id, status, version) VALUES ({db.ph}, {db.ph}, {db.ph})", row
        )
    return table


def _row(db: DB, table: str, id: int = 1) -> tuple[Any, ...]:
    return tuple(db.admin(f"SELECT status, version FROM {table} WHERE id = {db.ph}", (id,))[0])


def test_apply_and_redelivery(db: DB) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table)
    conn = db.connect()
    t = sm.apply(conn, 1, "pay")
    assert t == Transition(APPLIED, 1, "pay", "paid", 1, "created", "")
    assert t.applied
    # Redelivered "pay": already applied, not allowed from "paid": REJECTED, nothing written.
    again = sm.apply(conn, 1, "pay")
    assert again.outcome is REJECTED and again.reason == "illegal"
    assert (again.status, again.version) == ("paid", 1)
    assert sm.apply(conn, 1, "ship").outcome is APPLIED
    conn.commit()
    assert _row(db, table) == ("shipped", 2)


def test_apply_does_not_commit(db: DB) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table)
    conn = db.connect()
    assert sm.apply(conn, 1, "pay").outcome is APPLIED
    conn.rollback()
    assert _row(db, table) == ("created", 0)


def test_aba_is_rejected_by_the_version(db: DB) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table)
    conn = db.connect()
    # An event computed against version 0 ("created"), delivered late.
    assert sm.apply(conn, 1, "pay", expected_version=0).outcome is APPLIED  # created -> paid
    assert sm.apply(conn, 1, "refund").outcome is APPLIED  # paid -> created (A -> B -> A)
    conn.commit()
    assert _row(db, table) == ("created", 2)
    stale = sm.apply(conn, 1, "pay", expected_version=0)
    assert stale.outcome is REJECTED and stale.reason == "stale_version"
    assert (stale.status, stale.version) == ("created", 2)
    conn.commit()
    assert _row(db, table) == ("created", 2)
    # The status alone would have let it through again:
    assert sm.apply(conn, 1, "pay", expected_version=2).outcome is APPLIED


def test_late_event_is_rejected(db: DB) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table, updated_column="updated_at")
    conn = db.connect()
    t0 = 1_700_000_000.0
    assert sm.apply(conn, 1, "pay", at=t0 + 10).outcome is APPLIED
    assert sm.apply(conn, 1, "refund", at=t0 + 20).outcome is APPLIED
    # "pay" again, but it happened before the refund: late.
    late = sm.apply(conn, 1, "pay", at=t0 + 15)
    assert late.outcome is REJECTED and late.reason == "late"
    conn.commit()
    assert db.admin(f"SELECT status, version, updated_at FROM {table}") == [("created", 2, t0 + 20)]
    # datetimes compare with unix seconds stored (naive counts as UTC).
    at = datetime.fromtimestamp(t0 + 30, timezone.utc)
    assert sm.apply(conn, 1, "pay", at=at.timestamp()).outcome is APPLIED
    older = at.replace(tzinfo=None) - timedelta(seconds=5)
    assert sm.apply(conn, 1, "refund", at=older).reason == "late"
    with pytest.raises(TypeError, match="at must be a datetime or unix seconds"):
        sm.apply(conn, 1, "refund", at="yesterday")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="updated_column"):
        StateMachine(ORDER, table).apply(conn, 1, "refund", at=t0)


def test_lost_race_is_conflict(db: DB, monkeypatch: pytest.MonkeyPatch) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table)
    conn = db.connect()
    real = StateMachine._read_row
    interfered: list[bool] = []

    def read_then_interfere(self: StateMachine, c: Conn, id: Any, *, lock: bool) -> Any:
        row = real(self, c, id, lock=lock)
        if not interfered:  # between this call's read and its update, another consumer commits
            interfered.append(True)
            other = db.raw_connect()
            assert sm.apply(other, 1, "cancel").outcome is APPLIED
            other.commit()
            other.close()
        return row

    monkeypatch.setattr(StateMachine, "_read_row", read_then_interfere)
    t = sm.apply(conn, 1, "pay")
    assert t.outcome is CONFLICT and t.reason == "lost_race"
    assert (t.previous, t.status, t.version) == ("created", "cancelled", 1)
    conn.commit()
    assert _row(db, table) == ("cancelled", 1)


def test_concurrent_applies_one_wins(db: DB, in_thread: Any) -> None:
    table = _orders(db, *[(i, "created", 0) for i in range(1, 21)])
    sm = StateMachine(ORDER, table)

    def worker() -> list[Transition]:
        conn = db.raw_connect()
        out = []
        try:
            for i in range(1, 21):
                out.append(sm.apply(conn, i, "pay"))
                conn.commit()
        finally:
            conn.close()
        return out

    runs = [in_thread(worker) for _ in range(3)]
    results: list[Transition] = []
    for thread, out in runs:
        thread.join(60)
        assert "error" not in out, out.get("error")
        results += out["value"]
    for i in range(1, 21):
        mine = [t for t in results if t.id == i]
        assert [t.outcome for t in mine].count(APPLIED) == 1
        assert all(t.outcome in (REJECTED, CONFLICT) for t in mine if not t.applied)
    assert db.admin(f"SELECT DISTINCT status, version FROM {table}") == [("paid", 1)]


def test_with_consume_in_one_transaction(db: DB) -> None:
    table = _orders(db, (1, "created", 0))
    sm = StateMachine(ORDER, table)
    conn = db.connect()
    dedup = db.table("consumed")
    ensure_table(conn, dedup)
    with pytest.raises(RuntimeError), consume(conn, "orders/pay", "msg-1", table=dedup) as c:
        assert c.new and sm.apply(conn, 1, "pay").applied
        raise RuntimeError("crash")
    assert _row(db, table) == ("created", 0)  # rolled back with the dedup row
    with consume(conn, "orders/pay", "msg-1", table=dedup) as c:
        assert c.new and sm.apply(conn, 1, "pay").applied
    assert _row(db, table) == ("paid", 1)


def test_bad_input_and_setup(db: DB) -> None:
    table = _orders(db, (1, "created", 0), (2, "lost", 0))
    conn = db.connect()
    sm = StateMachine(ORDER, table)
    with pytest.raises(ValueError, match=r"unknown event 'explode'.*cancel, pay, refund, ship"):
        sm.apply(conn, 1, "explode")
    with pytest.raises(TypeError, match="event must be str"):
        sm.apply(conn, 1, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected_version must be an int"):
        sm.apply(conn, 1, "pay", expected_version="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="status 'lost', which is not a state"):
        sm.apply(conn, 2, "pay")
    with pytest.raises(LookupError, match="no row with id = 99"):
        sm.apply(conn, 99, "pay")
    with pytest.raises(SchemaError, match="does not exist"):
        StateMachine(ORDER, db.table()).apply(conn, 1, "pay")
    with pytest.raises(SchemaError, match="no column 'state'"):
        StateMachine(ORDER, table, status_column="state").apply(conn, 1, "pay")
    with pytest.raises(SchemaError, match="no column 'changed'"):
        StateMachine(ORDER, table, updated_column="changed").apply(conn, 1, "pay")
    conn.rollback()
    assert _row(db, table) == ("created", 0)


def test_constructor_checks() -> None:
    with pytest.raises(TypeError, match="transitions must be a mapping"):
        StateMachine([("a", "b")], "t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        StateMachine({}, "t")
    with pytest.raises(TypeError, match="must be a mapping event"):
        StateMachine({"a": "b"}, "t")  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="target state of state 'a'"):
        StateMachine({"a": {"go": 3}}, "t")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="SQL identifier"):
        StateMachine(ORDER, "orders where 1=1")
    with pytest.raises(ValueError, match="distinct"):
        StateMachine(ORDER, "orders", status_column="id")
    sm = StateMachine(ORDER, "orders")
    assert sm.states == {"created", "paid", "shipped", "cancelled"}
    assert sm.events == {"pay", "cancel", "ship", "refund"}
    assert sm.target("paid", "refund") == "created" and sm.target("shipped", "pay") is None
