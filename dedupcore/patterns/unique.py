"""Business unique key: insert the business row once; a conflict on its unique key is DUPLICATE.

When the message's effect *is* a row (an order, a payment, a ledger entry)
and the row carries the business id under a unique constraint, the database
already deduplicates::

    from dedupcore.patterns.unique import insert_once
    from dedupcore import Outcome

    outcome = insert_once(
        conn, "payments", {"payment_id": msg["id"], "amount": msg["amount"]},
        unique=["payment_id"],
    )
    if outcome is Outcome.NEW:
        ...  # first delivery: further writes in the same transaction
    conn.commit()

``conn`` is a DB-API connection of psycopg 3 (PostgreSQL), PyMySQL
(MariaDB/MySQL) or sqlite3, or a SQLAlchemy 2 ``Connection`` over one of
them. :func:`insert_once` never commits: it runs in the caller's transaction.

How each engine tells a duplicate, and only a duplicate of *this* key:

- PostgreSQL and SQLite: ``INSERT .. ON CONFLICT (unique columns) DO
  NOTHING``; no row inserted is DUPLICATE. No error is raised for the
  duplicate, so the caller's transaction stays usable (a PostgreSQL error
  would abort it). A conflict on *another* unique constraint, NOT NULL,
  foreign key and check violations raise as usual.
- MariaDB/MySQL: a plain ``INSERT``; the duplicate-key error (1062) is
  DUPLICATE only when it names a unique index over exactly the ``unique``
  columns. InnoDB rolls back just the failed statement, so the transaction
  stays usable. Never ``INSERT IGNORE`` (it turns every error, including
  NOT NULL and foreign keys, into a warning) nor ``ON DUPLICATE KEY UPDATE``
  (it fires on any unique key, and its affected-rows count depends on the
  client's ``CLIENT_FOUND_ROWS`` flag, which SQLAlchemy sets).

Concurrency: a second transaction inserting the same key waits for the
first one (PostgreSQL and InnoDB lock the conflicting index entry; SQLite
has one writer at a time) and sees DUPLICATE after it commits, NEW if it
rolled back. Under PostgreSQL ``REPEATABLE READ``/``SERIALIZABLE`` a
conflict with a row committed after the snapshot raises a serialization
failure instead (retry the transaction).

The table must have a unique index (or primary key) over exactly the
``unique`` columns, without a ``WHERE`` clause or expressions: it is looked
up in the catalog once per (driver, table) and cached
(:func:`forget_schema` clears the cache after a migration); without one,
:class:`SchemaError`. A ``None`` in a unique column is refused: NULLs never
conflict, so such a row could be inserted any number of times.

:func:`is_unique_violation` tells a driver's duplicate-key error apart from
every other error (psycopg ``23505``, PyMySQL ``1062``, sqlite3
``SQLITE_CONSTRAINT_UNIQUE``/``_PRIMARYKEY``), also under SQLAlchemy.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dedupcore.api import Outcome
from dedupcore.errors import SchemaError
from dedupcore.sql.dialects import (
    detect_dialect,
    driver_error,
    is_unique_violation,
    on_conflict_do_nothing,
    placeholder,
    quote,
)

__all__ = ["SchemaError", "forget_schema", "insert_once", "is_unique_violation"]

#: SQL identifiers accepted for tables and columns (no quoting games, no schema prefix).
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")

_MYSQL_DUP_KEY_RE = re.compile(r"for key '(.*)'\Z", re.S)


def check_identifier(name: object, what: str) -> str:
    """A table or column name: ``[A-Za-z_][A-Za-z0-9_]*``, at most 63 characters."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be str, not {type(name).__name__}")
    if not IDENT_RE.match(name):
        raise ValueError(
            f"{what} must be an SQL identifier [A-Za-z_][A-Za-z0-9_]* of at most 63 "
            f"characters, got {name!r}"
        )
    return name


# -- connections ---------------------------------------------------------------------------


class Conn:
    """One DB-API connection (psycopg 3, PyMySQL, sqlite3) or SQLAlchemy Connection, uniformly.

    Statements are written with the driver's placeholder (:attr:`ph`); with
    SQLAlchemy they go through ``exec_driver_sql`` so that SQLAlchemy's own
    transaction bookkeeping sees them.
    """

    __slots__ = ("dialect", "ph", "raw", "sa")

    def __init__(self, conn: Any) -> None:
        self.sa: Any = None
        if type(conn).__module__.startswith("sqlalchemy") and hasattr(conn, "exec_driver_sql"):
            self.sa = conn
            self.raw: Any = conn.connection.dbapi_connection
        else:
            self.raw = conn
        self.dialect = detect_dialect(self.raw)
        self.ph = placeholder(self.dialect)

    @property
    def kind(self) -> str:
        """What the connection is, for messages and cache keys."""
        return f"{'sqlalchemy+' if self.sa is not None else ''}{self.dialect}"

    def q(self, ident: str) -> str:
        return quote(self.dialect, ident)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> tuple[int, list[tuple[Any, ...]]]:
        """Runs one statement: ``(rowcount, rows)`` (rows empty for statements without any)."""
        if self.sa is not None:
            result = (
                self.sa.exec_driver_sql(sql, tuple(params))
                if params
                else (self.sa.exec_driver_sql(sql))
            )
            rows = [tuple(r) for r in result.fetchall()] if result.returns_rows else []
            return int(result.rowcount), rows
        cur = self.raw.cursor()
        try:
            cur.execute(sql, tuple(params)) if params else cur.execute(sql)
            rows = [tuple(r) for r in cur.fetchall()] if cur.description else []
            return int(cur.rowcount), rows
        finally:
            cur.close()

    def commit(self) -> None:
        (self.sa if self.sa is not None else self.raw).commit()

    def rollback(self) -> None:
        (self.sa if self.sa is not None else self.raw).rollback()

    def autocommit_setting(self) -> str | None:
        """What puts the connection in autocommit mode, or None when it is not.

        May start a SQLAlchemy transaction (nothing is written).
        """
        raw = self.raw
        if self.sa is not None:
            level = self.sa.get_execution_options().get("isolation_level")
            if level == "AUTOCOMMIT":
                return "SQLAlchemy execution option isolation_level='AUTOCOMMIT'"
        if self.dialect == "postgresql":
            if raw.autocommit:
                return "psycopg connection autocommit=True"
            return None
        if self.dialect == "mysql":
            if raw.get_autocommit():
                return (
                    "PyMySQL connection autocommit (connect(autocommit=True) or autocommit(True))"
                )
            return None
        if getattr(raw, "autocommit", None) is True:  # Python 3.12+
            return "sqlite3 connection autocommit=True"
        if raw.isolation_level is None:
            if self.sa is not None and not self.sa.in_transaction():
                self.sa.begin()  # SQLAlchemy "begin" event recipes emit BEGIN here
            if not raw.in_transaction:
                what = (
                    "SQLAlchemy isolation_level='AUTOCOMMIT'"
                    if self.sa is not None
                    else "sqlite3 connection isolation_level=None"
                )
                return f"{what} (autocommit) without an open transaction"
        return None

    def sqlite_begin(self) -> None:
        """SQLite: opens the transaction with ``BEGIN IMMEDIATE`` if none is open.

        sqlite3 opens a *deferred* transaction before the first write; one that
        has read anything (even the schema) and then finds the writer lock
        taken fails at once with "database is locked" instead of waiting out
        the busy timeout. Taking the writer lock first makes a second writer
        wait. Autocommit connections (each statement its own transaction) and
        connections with a transaction already open are left alone.
        """
        raw = self.raw
        if (
            self.dialect == "sqlite"
            and not raw.in_transaction
            and raw.isolation_level is not None
            and getattr(raw, "autocommit", None) is not True
        ):
            self.execute("BEGIN IMMEDIATE")


# -- the catalog ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TableInfo:
    """A table's columns and its unique indexes (name -> columns), as the catalog reports."""

    columns: tuple[str, ...]
    unique: tuple[tuple[str, tuple[str, ...]], ...]
    fold: bool  # column names are case-insensitive (MariaDB, SQLite)

    def norm(self, name: str) -> str:
        return name.lower() if self.fold else name

    def missing(self, names: Sequence[str]) -> list[str]:
        have = {self.norm(c) for c in self.columns}
        return [n for n in names if self.norm(n) not in have]

    def unique_indexes(self, cols: Sequence[str]) -> list[str]:
        """Names of the unique indexes over exactly ``cols`` (in any order)."""
        want = {self.norm(c) for c in cols}
        return [
            name
            for name, idx in self.unique
            if len(idx) == len(want) and {self.norm(c) for c in idx} == want
        ]


_cache: dict[tuple[str, str], TableInfo] = {}
_cache_lock = threading.Lock()


def forget_schema() -> None:
    """Forgets every table looked up in the catalog (after a migration)."""
    with _cache_lock:
        _cache.clear()


def table_info(c: Conn, table: str) -> TableInfo:
    """The table's columns and unique indexes, looked up once per (driver, table)."""
    cache_key = (c.kind, table)
    with _cache_lock:
        info = _cache.get(cache_key)
    if info is not None:
        return info
    info = _lookup(c, table)
    with _cache_lock:
        _cache[cache_key] = info
    return info


def _lookup(c: Conn, table: str) -> TableInfo:
    if c.dialect == "postgresql":
        _, rows = c.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [c.q(table)],
        )
        columns = tuple(str(r[0]) for r in rows)
        _, rows = c.execute(
            "SELECT ci.relname, ARRAY(SELECT a.attname FROM unnest(i.indkey::int2[]) "
            "WITH ORDINALITY AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum WHERE k.n <= i.indnkeyatts ORDER BY k.n) "
            "FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indisvalid "
            "AND i.indpred IS NULL AND i.indexprs IS NULL",
            [c.q(table)],
        )
        unique = tuple((str(name), tuple(cols)) for name, cols in rows)
        fold = False
    elif c.dialect == "mysql":
        _, rows = c.execute(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            [table],
        )
        columns = tuple(str(r[0]) for r in rows)
        _, rows = c.execute(
            "SELECT INDEX_NAME, COLUMN_NAME, SUB_PART FROM information_schema.STATISTICS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND NON_UNIQUE = 0 "
            "ORDER BY INDEX_NAME, SEQ_IN_INDEX",
            [table],
        )
        indexes: dict[str, list[str | None]] = {}
        for name, col, sub_part in rows:
            # A prefix index (SUB_PART) is unique on a prefix only; an expression has no column.
            indexes.setdefault(str(name), []).append(
                None if sub_part is not None or col is None else str(col)
            )
        unique = tuple(
            (name, tuple(c for c in cols if c is not None))
            for name, cols in indexes.items()
            if None not in cols
        )
        fold = True
    else:
        _, rows = c.execute("SELECT name, pk FROM pragma_table_info(?) ORDER BY cid", [table])
        columns = tuple(str(r[0]) for r in rows)
        pk = tuple(str(name) for name, n in sorted(rows, key=lambda r: r[1]) if n)
        _, rows = c.execute('SELECT name, "unique", partial FROM pragma_index_list(?)', [table])
        found: list[tuple[str, tuple[str, ...]]] = [("PRIMARY KEY", pk)] if pk else []
        for name, is_unique, partial in rows:
            if not is_unique or partial:
                continue
            _, cols = c.execute("SELECT name FROM pragma_index_info(?) ORDER BY seqno", [name])
            if any(col[0] is None for col in cols):
                continue  # an expression
            found.append((str(name), tuple(str(col[0]) for col in cols)))
        unique = tuple(found)
        fold = True
    if not columns:
        raise SchemaError(
            f"table {table!r} does not exist (or is not visible) on this {c.kind} connection"
        )
    return TableInfo(columns, unique, fold)


def require_columns(c: Conn, table: str, info: TableInfo, names: Sequence[str]) -> None:
    missing = info.missing(names)
    if missing:
        raise SchemaError(
            f"table {table!r} has no column {', '.join(map(repr, missing))} "
            f"(its columns: {', '.join(info.columns)})"
        )


# -- insert_once --------------------------------------------------------------------------


def _check_row(row: object, unique: object) -> tuple[list[str], list[Any], list[str]]:
    if not isinstance(row, Mapping):
        raise TypeError(f"row must be a mapping of column -> value, not {type(row).__name__}")
    if not row:
        raise ValueError("row must have at least one column")
    cols = [check_identifier(col, "column name") for col in row]
    if isinstance(unique, (str, bytes)) or not isinstance(unique, Sequence):
        raise TypeError(f"unique must be a sequence of column names, not {type(unique).__name__}")
    ucols = [check_identifier(col, "unique column name") for col in unique]
    if not ucols:
        raise ValueError("unique must name at least one column")
    if len(set(ucols)) != len(ucols):
        raise ValueError(f"unique names a column twice: {ucols}")
    for col in ucols:
        if col not in row:
            raise ValueError(f"unique column {col!r} is not in the row")
        if row[col] is None:
            raise ValueError(
                f"unique column {col!r} is None: NULLs never conflict, so the row could "
                "be inserted twice"
            )
    return cols, [row[col] for col in cols], ucols


def insert_once(conn: Any, table: str, row: Mapping[str, Any], unique: Sequence[str]) -> Outcome:
    """Inserts ``row`` into ``table`` unless a row with the same ``unique`` columns exists.

    Outcome.NEW when the row was inserted, Outcome.DUPLICATE when the unique
    key was already taken. Runs in the caller's transaction (never commits);
    after DUPLICATE the transaction is still usable. Any other error
    propagates. See the module docstring.
    """
    check_identifier(table, "table")
    cols, values, ucols = _check_row(row, unique)
    c = Conn(conn)
    info = table_info(c, table)
    require_columns(c, table, info, cols)
    indexes = info.unique_indexes(ucols)
    if not indexes:
        raise SchemaError(
            f"table {table!r} has no unique constraint or unique index over exactly "
            f"({', '.join(ucols)}) (without WHERE or expressions); insert_once needs one "
            f"to tell a duplicate, e.g. CREATE UNIQUE INDEX ON {table} ({', '.join(ucols)})"
        )
    q, ph = c.q, c.ph
    sql = (
        f"INSERT INTO {q(table)} ({', '.join(q(col) for col in cols)}) "
        f"VALUES ({', '.join([ph] * len(cols))})"
    )
    if c.dialect != "mysql":
        c.sqlite_begin()
        count, _ = c.execute(f"{sql} {on_conflict_do_nothing(c.dialect, ucols)}", values)
        return Outcome.NEW if count == 1 else Outcome.DUPLICATE
    try:
        c.execute(sql, values)
    except Exception as exc:
        if is_unique_violation(exc) and _mysql_dup_key(exc, table) in {
            info.norm(i) for i in indexes
        }:
            return Outcome.DUPLICATE  # InnoDB rolled back only this statement
        raise
    return Outcome.NEW


def _mysql_dup_key(exc: BaseException, table: str) -> str | None:
    """The index a MariaDB/MySQL duplicate-key error names (MySQL 8 writes ``table.index``)."""
    exc = driver_error(exc)
    args: tuple[Any, ...] = exc.args
    match = _MYSQL_DUP_KEY_RE.search(str(args[1])) if len(args) > 1 else None
    if match is None:
        return None
    name = match.group(1)
    if name.lower().startswith(table.lower() + "."):
        name = name[len(table) + 1 :]
    return name.lower()
