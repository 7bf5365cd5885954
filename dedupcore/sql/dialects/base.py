"""The SQL dialect interface: what differs between the engines, and the helpers they share."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from dedupcore.errors import SchemaError
from dedupcore.record import State

#: The engines, by the names every module uses.
DIALECTS = ("postgresql", "mysql", "sqlite")

#: Seconds :func:`connect_url` gives a connect and a statement by default.
DEFAULT_TIMEOUT = 5.0

# sqlite3 extended result codes (Python 3.11+ exposes them as exc.sqlite_errorcode).
_SQLITE_CONSTRAINT_PRIMARYKEY = 1555
_SQLITE_CONSTRAINT_UNIQUE = 2067
#: MariaDB/MySQL: ER_DUP_ENTRY and ER_DUP_ENTRY_WITH_KEY_NAME.
MYSQL_DUP_ENTRY = (1062, 1586)


def detect_dialect(conn: Any) -> str:
    """``"postgresql"``, ``"mysql"`` or ``"sqlite"`` from a DB-API connection's driver."""
    module = type(conn).__module__.split(".")[0]
    found = {"psycopg": "postgresql", "pymysql": "mysql", "sqlite3": "sqlite"}.get(module)
    if found is None:
        raise ValueError(
            f"cannot tell the SQL dialect of a {type(conn).__module__}.{type(conn).__name__} "
            "connection; pass dialect='postgresql', 'mysql' or 'sqlite'"
        )
    return found


def placeholder(dialect: str) -> str:
    """The driver's parameter marker: ``?`` for sqlite3, ``%s`` for psycopg and PyMySQL."""
    return "?" if dialect == "sqlite" else "%s"


def quote(dialect: str, ident: str) -> str:
    """``ident`` quoted as an identifier (backticks on MariaDB/MySQL, double quotes else)."""
    return f"`{ident}`" if dialect == "mysql" else f'"{ident}"'


def on_conflict_do_nothing(dialect: str, columns: Sequence[str]) -> str:
    """``ON CONFLICT (columns) DO NOTHING``: PostgreSQL and SQLite only."""
    if dialect == "mysql":
        raise ValueError("MariaDB/MySQL has no ON CONFLICT (columns) clause")
    return f"ON CONFLICT ({', '.join(quote(dialect, c) for c in columns)}) DO NOTHING"


def driver_error(exc: BaseException) -> BaseException:
    """The driver's exception (SQLAlchemy wraps it as ``.orig``)."""
    if type(exc).__module__.startswith("sqlalchemy"):
        orig = getattr(exc, "orig", None)
        if isinstance(orig, BaseException):
            return orig
    return exc


def is_unique_violation(exc: BaseException) -> bool:
    """True only for a duplicate-key error of psycopg, PyMySQL or sqlite3 (or SQLAlchemy's wrap).

    NOT NULL, foreign key and check violations, and every other error, are False.
    """
    exc = driver_error(exc)
    module = type(exc).__module__.split(".")[0]
    if module == "psycopg":
        return getattr(exc, "sqlstate", None) == "23505"
    if module == "pymysql":
        import pymysql

        args: tuple[Any, ...] = exc.args
        dup = bool(args) and args[0] in MYSQL_DUP_ENTRY
        return isinstance(exc, pymysql.err.IntegrityError) and dup
    if isinstance(exc, sqlite3.IntegrityError):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            return code in (_SQLITE_CONSTRAINT_UNIQUE, _SQLITE_CONSTRAINT_PRIMARYKEY)
        return str(exc).startswith("UNIQUE constraint failed")  # Python < 3.11
    return False


#: Rows per statement where the statement carries one set of parameters per row.
_CHUNK = 1000
_PROCESSING, _PROCESSED, _RELEASED = (
    int(State.PROCESSING),
    int(State.PROCESSED),
    int(State.RELEASED),
)

#: ``before_delete(namespace, keys)`` of :meth:`SqlStore.purge`.
BeforeDelete = Callable[[str, list[bytes]], None]

# SET list of a batched UPDATE: (column, i) takes the i-th per-row value, (column, str) is SQL.
_SetList = list[tuple[str, "int | str"]]


# -- dialects --------------------------------------------------------------------


class _Dialect:
    """What differs between the engines: SQL text, session setup, error classes."""

    name = ""
    ph = "%s"  # the driver's placeholder (dialect.placeholder)
    max_key_bytes = 512

    def q(self, ident: str) -> str:
        return quote(self.name, ident)

    @property
    def now(self) -> str:
        raise NotImplementedError

    def lease_until(self, lease: float) -> str:
        raise NotImplementedError

    def epoch(self, column: str) -> str:
        raise NotImplementedError

    def error_classes(self) -> tuple[type[BaseException], ...]:
        raise NotImplementedError

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def is_missing_table(self, exc: BaseException) -> bool:
        return False

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        return False

    def is_refused(self, exc: BaseException) -> bool:
        """Whether the server refused the request's data (out of range, too long, a CHECK)."""
        return False

    def arm(self, conn: Any, wait: float) -> None:
        """Gives the connection's next transaction at most ``wait`` seconds of waiting.

        (The driver's own per-wait timeouts, where it has them; the watchdog
        cuts what is left at the deadline.)
        """

    def socket_of(self, conn: Any) -> int | None:
        """The connection's socket, for the watchdog that cuts it at a call's deadline."""
        return None

    def durability(self, cur: Any) -> tuple[int, str]:
        """What a committed claim survives: a level (see ``durability_report``) and words."""
        raise NotImplementedError

    def prepare(self, conn: Any) -> None:
        """Session setup of a new connection (transactions, time zone, isolation)."""

    def begin(self, cur: Any, write: bool) -> None:
        """Starts the transaction (drivers that begin implicitly do nothing)."""

    def schema(self, table: str) -> list[str]:
        raise NotImplementedError

    def server_version(self, cur: Any) -> str:
        raise NotImplementedError

    # -- statements ---------------------------------------------------------------

    def insert_fresh(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        nonce: bytes,
        parts: list[int] | None = None,
    ) -> set[bytes] | None:
        """Creates the rows that do not exist; the keys created, or None if unknown."""
        raise NotImplementedError

    def select_rows(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        parts: tuple[int, int | None] | None = None,
        lock: bool = True,
    ) -> list[tuple[Any, ...]]:
        """``(key, state, token, owner, fingerprint, result, live)`` of existing keys, locked.

        ``parts=(lo, hi)`` (a partitioned table): the keys' rows in partitions
        ``lo`` .. ``hi`` (None: every one from ``lo``), with ``part`` after ``key``;
        ``lock=False`` reads them without locking them.
        """
        t, k, p = self.q(table), self.q("key"), self.ph
        part, where, order = _part_range(parts, k)
        out: list[tuple[Any, ...]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"SELECT {k}, {part}state, token, owner, fingerprint, result, "
                f"lease_until > {self.now} FROM {t} WHERE namespace = {p} "
                f"AND {k} IN ({', '.join([p] * len(chunk))}){where}{order}"
                + (self.for_update if lock else ""),
                [ns, *chunk],
            )
            out += cur.fetchall()
        return out

    for_update = " FOR UPDATE"

    #: Whether a batch that is mostly DUPLICATE is read without locks first.
    read_first = False
    #: Whether a read-only call runs without a transaction (one round trip, no COMMIT).
    autocommit_reads = False
    #: Whether :meth:`insert_all` exists (a plain INSERT that fails on any existing key).
    plain_insert = False

    def insert_all(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        parts: list[int] | None = None,
    ) -> None:
        """Creates every row; raises (see :meth:`is_unique_violation`) if any exists."""
        raise NotImplementedError

    def is_unique_violation(self, exc: BaseException) -> bool:
        return is_unique_violation(exc)

    def read_rows(self, cur: Any, table: str, ns: str, keys: list[bytes]) -> list[tuple[Any, ...]]:
        """``(key, state, token, owner, fingerprint, result)`` of existing keys, not locked."""
        t, k, p = self.q(table), self.q("key"), self.ph
        out: list[tuple[Any, ...]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"SELECT {k}, state, token, owner, fingerprint, result FROM {t} "
                f"WHERE namespace = {p} AND {k} IN ({', '.join([p] * len(chunk))})",
                [ns, *chunk],
            )
            out += cur.fetchall()
        return out

    def update_rows(
        self,
        cur: Any,
        table: str,
        ns: str,
        sets: _SetList,
        types: list[str],
        rows: list[list[Any]],
        parted: bool = False,
    ) -> None:
        """``UPDATE .. SET sets`` for each row ``[key, v0, v1, ..]`` (keys already locked)."""
        raise NotImplementedError

    def set_clause(self, sets: _SetList, value: Callable[[int], str]) -> str:
        return ", ".join(f"{col} = {value(e) if isinstance(e, int) else e}" for col, e in sets)

    def purge(
        self,
        cur: Any,
        table: str,
        ns: str | None,
        skip: list[str],
        window: float,
        limit: int,
        before_delete: BeforeDelete | None = None,
    ) -> tuple[int, int]:
        """Tombstones abandoned claims, then deletes finished rows; ``(tombstoned, deleted)``.

        The conditions are in the outer ``WHERE`` too, so a row claimed again
        while the statement waited for its lock is re-checked and left alone.
        With ``before_delete`` the rows are first selected and locked, the
        callback gets each namespace's PROCESSED keys, and then exactly those
        rows are deleted (see :meth:`SqlStore.purge`).
        """
        p, t = self.ph, self.q(table)
        scope: list[str] = []
        params: list[Any] = []
        if ns is not None:
            scope.append(f"namespace = {p}")
            params.append(ns)
        elif skip:
            scope.append(f"namespace NOT IN ({', '.join([p] * len(skip))})")
            params += skip
        old = f"updated < {self.ago(window)}"
        abandoned = " AND ".join(
            [*scope, old, f"state = {_PROCESSING}", f"lease_until < {self.now}"]
        )
        cur.execute(
            self.limited(
                f"UPDATE {t} SET state = {_RELEASED}, result = NULL, updated = {self.now}",
                table,
                abandoned,
                limit,
            ),
            params * self.where_repeats,
        )
        tombstoned = int(cur.rowcount)
        done = f"state IN ({_PROCESSED}, {_RELEASED})"
        finished = " AND ".join([*scope, old, done])
        if before_delete is None:
            cur.execute(
                self.limited(f"DELETE FROM {t}", table, finished, limit),
                params * self.where_repeats,
            )
            return tombstoned, int(cur.rowcount)
        k = self.q("key")
        cur.execute(
            f"SELECT namespace, {k}, state FROM {t} WHERE {finished} "
            f"ORDER BY updated LIMIT {int(limit)}{self.for_update}",
            params,
        )
        chosen: dict[str, tuple[list[bytes], list[bytes]]] = {}
        for name, key, state in cur.fetchall():
            rows, processed = chosen.setdefault(str(name), ([], []))
            rows.append(bytes(key))
            if int(state) == _PROCESSED:
                processed.append(bytes(key))
        for name, (_, processed) in sorted(chosen.items()):
            if processed:
                before_delete(name, processed)  # raises: the transaction is rolled back
        deleted = 0
        for name, (rows, _) in sorted(chosen.items()):
            deleted += self.delete_keys(cur, table, name, rows, f"{old} AND {done}")
        return tombstoned, deleted

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        """Deletes the rows of ``keys`` (already locked) that still match ``where``."""
        p, k = self.ph, self.q("key")
        deleted = 0
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"DELETE FROM {self.q(table)} WHERE namespace = {p} "
                f"AND {k} IN ({', '.join([p] * len(chunk))}) AND {where}",
                [ns, *chunk],
            )
            deleted += int(cur.rowcount)
        return deleted

    where_repeats = 2

    def limited(self, verb: str, table: str, where: str, limit: int) -> str:
        """``verb`` on at most ``limit`` rows matching ``where`` (re-checked per row)."""
        k = self.q("key")
        return (
            f"{verb} WHERE (namespace, {k}) IN (SELECT namespace, {k} FROM {self.q(table)} "
            f"WHERE {where} LIMIT {int(limit)}) AND {where}"
        )

    def ago(self, seconds: float) -> str:
        raise NotImplementedError

    # -- partitions by event time (docs/sql-partitions.md) --------------------------

    #: Whether the engine can keep the table in RANGE partitions of ``part``.
    partitions = False

    def part_schema(self, table: str, first: int, span: int) -> list[str]:
        """The partitioned table (no partition yet where the engine allows), meta and edges."""
        raise NotImplementedError

    def part_list(self, cur: Any, table: str) -> list[int]:
        """The starts of the table's partitions, sorted."""
        raise NotImplementedError

    def is_partitioned(self, cur: Any, table: str) -> bool:
        raise NotImplementedError

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        """Creates the partitions starting at ``starts`` (after the last one on MariaDB)."""
        raise NotImplementedError

    def part_drop(self, cur: Any, table: str, start: int) -> None:
        raise NotImplementedError

    def part_from(self, table: str, start: int) -> str:
        """The FROM item that reads one partition."""
        raise NotImplementedError

    def part_guard(self, cur: Any, table: str, exclusive: bool) -> int:
        """Locks the horizon (shared by claims, exclusive to move it) and returns it."""
        raise NotImplementedError

    def lock_edges(self, cur: Any, table: str, ns: str, edges: list[tuple[bytes, int]]) -> None:
        """Creates or locks one edge row per ``(key, boundary)`` (sorted), until the commit."""
        raise NotImplementedError


def _part_range(parts: tuple[int, int | None] | None, key: str) -> tuple[str, str, str]:
    """The ``part`` column, the condition and the ORDER BY of a lookup in partitions.

    A partitioned lookup has no ORDER BY (which would merge the partitions'
    scans instead of probing each): each partition is probed in key order,
    partition after partition, so the rows are still locked in one order.
    """
    if parts is None:
        return "", "", f" ORDER BY {key}"
    lo, hi = parts
    upper = "" if hi is None else f" AND part <= {int(hi)}"
    return "part, ", f" AND part >= {int(lo)}{upper}", ""


def _part_name(table: str, start: int) -> str:
    """The name of the partition that starts at ``start`` (unix seconds)."""
    return f"{table}_p{int(start)}"


def _part_start(table: str, name: str) -> int:
    prefix = f"{table}_p"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        raise SchemaError(f"partition {name!r} of table {table!r} is not one dedupcore made")
    return int(name[len(prefix) :])


def _lock_id(table: str) -> int:
    """The advisory lock key of a table's partition horizon (PostgreSQL)."""
    return int.from_bytes(
        hashlib.blake2b(table.encode(), digest_size=8).digest(), "big", signed=True
    )
