"""Transactional dedup table: the dedup row commits in the same transaction as the business write.

When the business effect lives in your own PostgreSQL, MariaDB/MySQL or
SQLite database, the simplest exactly-once effect is a dedup row written in
the *same* transaction as the business rows: both commit or neither does,
so a key can never be recorded as consumed without its effect, nor the
effect applied twice. Worked example, a "+100 to account 7" message that
may be delivered more than once::

    import psycopg
    from dedupcore.patterns.table import consume, ensure_table

    conn = psycopg.connect("postgresql://app@db/app")   # autocommit off (the default)
    ensure_table(conn)                                   # once, at start-up

    def on_message(msg):
        with consume(conn, "payments/ledger", msg["transfer_id"]) as c:
            if c.new:
                cur = conn.cursor()
                cur.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                            (msg["amount"], msg["account"]))
                cur.execute("INSERT INTO change_log (account, delta, transfer_id) "
                            "VALUES (%s, %s, %s)",
                            (msg["account"], msg["amount"], msg["transfer_id"]))
                c.result = {"applied": msg["amount"]}
            # c.outcome is Outcome.DUPLICATE on a redelivery; c.result is the stored result
        ack(msg)   # only after the with block: the transaction is committed by then

On a normal exit the connection is committed (the dedup row, the balance and
the change log together); if the block raises, the connection is rolled
back and the exception re-raised, so the key stays claimable and a
redelivery runs the work again. A DUPLICATE also ends the transaction
(commit) on exit.

``conn`` is a DB-API connection of psycopg 3, PyMySQL or sqlite3, or a
SQLAlchemy 2 ``Connection`` over one of them. It must not be in autocommit
mode (each business statement would commit on its own): that is refused
before anything is written, naming the setting. Do not start ``consume``
with uncommitted work of your own on the connection: it is committed (or
rolled back) with the block.

**How a key is decided.** ``INSERT .. ON CONFLICT (namespace, key) DO
NOTHING`` (PostgreSQL, SQLite) or a plain ``INSERT`` whose duplicate-key
error (1062 on the primary key) means DUPLICATE (MariaDB/MySQL; InnoDB rolls
back only the failed statement). An inserted row is NEW; otherwise the
stored row is read for its result. With a ``front`` filter (a
:class:`~dedupcore.BloomFilter`, :class:`~dedupcore.BloomRing` or anything
with ``contains_many``/``add_many`` or ``in``/``add``), a key the front has
never seen goes straight to the ``INSERT`` (one statement); a key it may
have seen is looked up with a ``SELECT`` first, so a redelivery costs one
read and no failed insert. The front is only a hint: the ``INSERT`` decides.
Keys are added to the front after the commit. :attr:`Consumption.statements`
and :func:`stats` count the statements.

**Concurrency.** Two consumers of the same key: the second one's ``INSERT``
waits on the first one's uncommitted row (PostgreSQL and InnoDB lock it; on
SQLite the transaction starts with ``BEGIN IMMEDIATE`` and waits for the
writer lock within the connection's busy timeout), then sees DUPLICATE if
the first committed, or inserts (NEW) if it rolled back or its process
died. Under PostgreSQL ``REPEATABLE READ``/``SERIALIZABLE`` the second one
gets a serialization failure instead; on MariaDB, several waiters of a
rolled-back winner may get a deadlock error (1213) -- in both cases the
transaction is rolled back and the exception propagates: let the broker
redeliver. A connection lost while committing leaves it unknown whether the
commit applied; a redelivery then finds out (NEW or DUPLICATE).

The table (``ensure_table``)::

    namespace  text COLLATE "C" / VARCHAR(128) ascii_bin / TEXT   primary key, part 1
    key        bytea / VARBINARY(512) / BLOB                      primary key, part 2
    created    timestamptz / DATETIME(6) UTC / REAL unix seconds  indexed, for retention
    result     bytea / LONGBLOB / BLOB                            msgpack, NULL when none

Retention is yours: delete rows older than the longest redelivery window
(``DELETE FROM dedupcore_consumed WHERE created < ...``) in small batches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dedupcore.keys as _keys
from dedupcore.api import Outcome, pack_result, unpack_result
from dedupcore.patterns.unique import (
    Conn,
    SchemaError,
    check_identifier,
    is_unique_violation,
    require_columns,
    table_info,
)

__all__ = ["DEFAULT_TABLE", "Consumption", "consume", "ensure_table", "stats"]

DEFAULT_TABLE = "dedupcore_consumed"
#: Longest key (bytes); the MariaDB column is VARBINARY(512).
MAX_KEY_BYTES = 512
#: Longest stored result (msgpack bytes).
MAX_RESULT_BYTES = 65536
_MAX_TABLE = 54  # room for the index name's "_created" suffix within 63 characters
_COLUMNS = ("namespace", "key", "created", "result")

_stats: Counter[str] = Counter()
_stats_lock = threading.Lock()


def stats() -> dict[str, int]:
    """Counts since import: statements run (``select``, ``insert``, ``update``) and outcomes."""
    with _stats_lock:
        return dict(_stats)


@dataclass(slots=True)
class Consumption:
    """What :func:`consume` found for a key.

    ``outcome`` is NEW (do the work; set ``result`` to store one with the
    dedup row) or DUPLICATE (``result`` is the stored result). ``statements``
    lists the statements consume ran for the key, in order.
    """

    namespace: str
    key: bytes
    outcome: Outcome
    result: Any = None
    statements: list[str] = field(default_factory=list)

    @property
    def new(self) -> bool:
        """True when the caller must do the work."""
        return self.outcome is Outcome.NEW


def _check_table(table: object) -> str:
    name = check_identifier(table, "table")
    if len(name) > _MAX_TABLE:
        raise ValueError(f"table name must be at most {_MAX_TABLE} characters, got {len(name)}")
    return name


def ensure_table(conn: Any, table: str = DEFAULT_TABLE) -> None:
    """Creates the dedup table (and its ``created`` index) if it does not exist; commits.

    Idempotent. An existing table of that name without the dedup columns or
    the ``(namespace, key)`` primary key raises :class:`SchemaError`.
    """
    table = _check_table(table)
    c = Conn(conn)
    for attempt in range(2):
        try:
            create, *indexes = c.dialect.consumed_schema(table, MAX_KEY_BYTES)
            c.execute(create)
            _check_schema(c, table)  # an older table of that name that is not a dedup table
            for statement in indexes:
                c.execute(statement)
            c.commit()
            return
        except Exception as exc:
            _rollback(c)
            # Two processes creating the same PostgreSQL table at once: one loses on pg_type.
            if attempt or not is_unique_violation(exc):
                raise


def _check_schema(c: Conn, table: str) -> None:
    info = table_info(c, table)
    require_columns(c, table, info, _COLUMNS)
    if not info.unique_indexes(["namespace", "key"]):
        raise SchemaError(
            f"table {table!r} has no primary key or unique index over (namespace, key); "
            "it is not a dedup table made by ensure_table"
        )


def _rollback(c: Conn) -> None:
    with contextlib.suppress(Exception):  # a lost connection cannot roll back; the server does
        c.rollback()


def _front_key(namespace: str, key: bytes) -> bytes:
    return namespace.encode() + b"\x00" + key


def _front_contains(front: Any, k: bytes) -> bool:
    if hasattr(front, "contains_many"):
        return bool(front.contains_many([k])[0])
    return k in front


def _front_add(front: Any, k: bytes) -> None:
    from dedupcore.ring import BloomRing

    if isinstance(front, BloomRing):
        front.add_many([k], time.time())
    elif hasattr(front, "add_many"):
        front.add_many([k])
    else:
        front.add(k)


def _claim(c: Conn, table: str, cons: Consumption, front: Any) -> None:
    """Decides the key: inserts its row (NEW) or reads the stored one (DUPLICATE)."""
    _check_schema(c, table)
    ns, key = cons.namespace, cons.key
    q, p = c.q, c.ph
    t, k = q(table), q("key")
    c.begin_write()  # wait for the writer lock now (see Conn.begin_write)
    select = f"SELECT result FROM {t} WHERE namespace = {p} AND {k} = {p}"
    if (
        front is not None
        and _front_contains(front, _front_key(ns, key))
        and _found(c, select, cons)
    ):
        return
    insert = f"INSERT INTO {t} (namespace, {k}, created) VALUES ({p}, {p}, {c.dialect.utc_now})"
    # A locking read where it takes one to see the row committed by the winner (InnoDB's
    # REPEATABLE READ).
    select += c.dialect.read_latest
    for _ in range(3):
        cons.statements.append("insert")
        # (The primary key is the table's only unique index.)
        if c.insert_if_absent(insert, [ns, key], ["namespace", "key"]):
            cons.outcome = Outcome.NEW
            return
        if _found(c, select, cons):
            return
        # The row was deleted between the two statements (retention): insert again.
    raise RuntimeError(f"key {key!r} of {ns!r} kept vanishing between INSERT and SELECT")


def _found(c: Conn, select: str, cons: Consumption) -> bool:
    """Reads the key's row: DUPLICATE with its stored result, or False when there is none."""
    cons.statements.append("select")
    _, rows = c.execute(select, [cons.namespace, cons.key])
    if not rows:
        return False
    cons.outcome = Outcome.DUPLICATE
    cons.result = unpack_result(None if rows[0][0] is None else bytes(rows[0][0]))
    return True


@contextmanager
def consume(
    conn: Any,
    namespace: str,
    key: bytes | str,
    *,
    table: str = DEFAULT_TABLE,
    front: Any = None,
) -> Iterator[Consumption]:
    """Decides ``key`` in a transaction on ``conn`` that commits with the block's writes.

    Yields a :class:`Consumption`: act only when ``c.new``. Normal exit
    commits the dedup row (and ``c.result``) with everything the block wrote
    on ``conn``; an exception rolls all of it back and is re-raised. See the
    module docstring.
    """
    ns = _keys.check_namespace(namespace).decode()
    raw = _keys.check_key(key, MAX_KEY_BYTES)
    table = _check_table(table)
    c = Conn(conn)
    setting = c.autocommit_setting()
    if setting is not None:
        raise ValueError(
            f"consume needs a transaction, but the connection is in autocommit mode ({setting}): "
            "the dedup row and the business writes would not commit together"
        )
    cons = Consumption(ns, raw, Outcome.NEW)
    try:
        _claim(c, table, cons, front)
        yield cons
        if cons.new and cons.result is not None:
            packed = pack_result(cons.result, MAX_RESULT_BYTES)
            cons.statements.append("update")
            c.execute(
                f"UPDATE {c.q(table)} SET result = {c.ph} "
                f"WHERE namespace = {c.ph} AND {c.q('key')} = {c.ph}",
                [packed, ns, raw],
            )
        c.commit()
    except BaseException:
        _rollback(c)
        raise
    finally:
        with _stats_lock:
            _stats.update(cons.statements)
    with _stats_lock:
        _stats[cons.outcome.value] += 1
    if front is not None:
        _front_add(front, _front_key(ns, raw))
