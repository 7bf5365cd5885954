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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dedupcore.api import Outcome
from dedupcore.errors import SchemaError
from dedupcore.sql.dialects import Dialect, dialect_of, is_unique_violation

__all__ = ["SchemaError", "forget_schema", "insert_once", "is_unique_violation"]

#: SQL identifiers accepted for tables and columns (no quoting games, no schema prefix).
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")


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
    transaction bookkeeping sees them. What differs between the engines is
    asked of :attr:`dialect` (:mod:`dedupcore.sql.dialects`).
    """

    __slots__ = ("dialect", "ph", "raw", "sa")

    def __init__(self, conn: Any) -> None:
        if isinstance(conn, str):
            raise ValueError("cannot tell the SQL dialect of a str: pass a connection, not a URL")
        self.sa: Any = None
        if type(conn).__module__.startswith("sqlalchemy") and hasattr(conn, "exec_driver_sql"):
            self.sa = conn
            self.raw: Any = conn.connection.dbapi_connection
        else:
            self.raw = conn
        self.dialect: Dialect = dialect_of(self.raw)
        self.ph = self.dialect.ph

    @property
    def kind(self) -> str:
        """What the connection is, for messages and cache keys."""
        return f"{'sqlalchemy+' if self.sa is not None else ''}{self.dialect.name}"

    def q(self, ident: str) -> str:
        return self.dialect.q(ident)

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
        raw, d = self.raw, self.dialect
        if self.sa is not None:
            level = self.sa.get_execution_options().get("isolation_level")
            if level == "AUTOCOMMIT":
                return "SQLAlchemy execution option isolation_level='AUTOCOMMIT'"
        setting = d.autocommit_of(raw)
        if setting is not None:
            return setting
        manual = d.manual_begin(raw)  # the driver leaves BEGIN to the caller
        if manual is not None:
            if self.sa is not None and not self.sa.in_transaction():
                self.sa.begin()  # SQLAlchemy "begin" event recipes emit BEGIN here
            if not d.in_transaction(raw):
                what = "SQLAlchemy isolation_level='AUTOCOMMIT'" if self.sa is not None else manual
                return f"{what} (autocommit) without an open transaction"
        return None

    def begin_write(self) -> None:
        """Takes the writer lock now where the driver would take it late (SQLite).

        sqlite3 opens a *deferred* transaction before the first write; one that
        has read anything (even the schema) and then finds the writer lock
        taken fails at once with "database is locked" instead of waiting out
        the busy timeout. ``BEGIN IMMEDIATE`` first makes a second writer
        wait. Autocommit connections (each statement its own transaction) and
        connections with a transaction already open are left alone.
        """
        begin = self.dialect.immediate_begin(self.raw)
        if begin is not None:
            self.execute(begin)

    def insert_if_absent(
        self,
        insert: str,
        values: Sequence[Any],
        unique: Sequence[str],
        ours: Callable[[BaseException], bool] = lambda exc: True,
    ) -> bool:
        """Runs ``insert`` (an INSERT of one row); False when the row's ``unique`` key existed.

        With ``ON CONFLICT (unique) DO NOTHING`` where the engine has it (no
        error, so the transaction stays usable); else a plain INSERT whose
        duplicate-key error is the answer when ``ours(exc)`` (it names the
        ``unique`` key's index; InnoDB rolls back only the failed statement).
        Every other error propagates.
        """
        d = self.dialect
        if d.supports_on_conflict:
            self.begin_write()
            count, _ = self.execute(f"{insert} {d.on_conflict_do_nothing(unique)}", values)
            return count == 1
        try:
            self.execute(insert, values)
        except Exception as exc:
            if is_unique_violation(exc) and ours(exc):
                return False
            raise
        return True


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
    columns, unique = c.dialect.catalog(c.execute, table)
    if not columns:
        raise SchemaError(
            f"table {table!r} does not exist (or is not visible) on this {c.kind} connection"
        )
    return TableInfo(columns, unique, c.dialect.folds_names)


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
    names = {info.norm(i) for i in indexes}

    def ours(exc: BaseException) -> bool:  # the error names one of the key's indexes
        return c.dialect.duplicate_key_index(exc, table) in names

    return Outcome.NEW if c.insert_if_absent(sql, values, ucols, ours) else Outcome.DUPLICATE
