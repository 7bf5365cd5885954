"""The dialect interface: every SQL text and driver difference between the engines.

Every module that sends SQL (the store, its transactions, partitions and
retention, and the patterns in :mod:`dedupcore.patterns`) asks a
:class:`Dialect` object instead of comparing engine names: ``d.ph`` is the
driver's parameter marker, ``d.q(name)`` quotes an identifier, what an
engine can do is an attribute
(``supports_on_conflict``, ``partitions``, ``read_first``, ...) and every
statement that differs is a method. One subclass per engine:

- :mod:`~dedupcore.sql.dialects.postgresql`: PostgreSQL through psycopg 3;
- :mod:`~dedupcore.sql.dialects.mysql`: MariaDB/MySQL through PyMySQL;
- :mod:`~dedupcore.sql.dialects.sqlite`: SQLite through sqlite3.

:func:`dedupcore.sql.dialects.dialect_of` gives the dialect of a connection,
a URL or a name. The methods here that are not abstract are the SQL the
engines share; a subclass overrides what its engine does otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dedupcore.errors import SchemaError
from dedupcore.record import State

__all__ = [
    "CHUNK",
    "DEFAULT_TIMEOUT",
    "Catalog",
    "Dialect",
    "NewRows",
    "RowUpdate",
    "Run",
    "SetList",
    "driver_error",
]

#: Seconds a connection by URL gives a connect and a statement by default.
DEFAULT_TIMEOUT = 5.0
#: Rows per statement where the statement carries one set of parameters per row.
CHUNK = 1000
PROCESSING, PROCESSED, RELEASED = int(State.PROCESSING), int(State.PROCESSED), int(State.RELEASED)

#: A primary key's columns; the dedup table's (unpartitioned).
Key = Sequence[str]
KEY: Key = ("namespace", "key")
#: The SET list of a batched UPDATE: ``(column, i)`` takes the i-th value of each row,
#: ``(column, str)`` is SQL.
SetList = list[tuple[str, "int | str"]]
#: Runs one statement: ``(rowcount, rows)`` (the patterns' connections, any driver).
Run = Callable[[str, Sequence[Any]], tuple[int, list[tuple[Any, ...]]]]
#: A table's columns and its unique indexes ``(name, columns)``.
Catalog = tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]
#: The rows of a lookup: ``(key, [part,] state, token, owner, fingerprint, result[, live])``.
Rows = list[tuple[Any, ...]]


def driver_error(exc: BaseException) -> BaseException:
    """The driver's exception (SQLAlchemy wraps it as ``.orig``)."""
    if type(exc).__module__.startswith("sqlalchemy"):
        orig = getattr(exc, "orig", None)
        if isinstance(orig, BaseException):
            return orig
    return exc


@dataclass(frozen=True, slots=True)
class NewRows:
    """The rows a claim creates: PROCESSING, token 1, one owner and lease, a nonce."""

    table: str
    namespace: str
    keys: list[bytes]
    fingerprints: list[bytes | None]
    owner: bytes | None
    lease: float
    nonce: bytes
    #: Each key's partition (a partitioned table), else None.
    parts: list[int] | None = None


@dataclass(frozen=True, slots=True)
class RowUpdate:
    """One batched UPDATE of locked rows: ``sets`` for each row ``[key, (part,) v0, v1, ..]``."""

    sets: SetList
    #: The SQL types of ``v0, v1, ..`` (``bigint``, ``bytea``).
    types: list[str]
    rows: list[list[Any]]
    #: Whether each row carries its partition after its key.
    parted: bool = False


class Dialect:
    """What one engine and its driver do differently (see the module docstring)."""

    #: The engine's name: ``"postgresql"``, ``"mysql"`` or ``"sqlite"``.
    name = ""
    #: The top-level module of the DB-API driver (how a connection's dialect is told).
    driver = ""
    #: The URL schemes of :meth:`connector`.
    schemes: tuple[str, ...] = ()
    #: The driver's parameter marker.
    ph = "%s"
    #: The longest key the dedup table's key column holds.
    max_key_bytes = 512

    # -- text -----------------------------------------------------------------------

    def q(self, ident: str) -> str:
        """``ident`` quoted as an identifier."""
        return f'"{ident}"'

    #: The server's time in the store's sessions.
    now = ""
    #: The server's time in UTC in any session (the patterns' connections are the caller's).
    utc_now = ""

    #: The server's time at the statement (not at the transaction's start, where they
    #: differ: the transaction may have waited for locks).
    write_now = ""

    def shift(self, time: str, sign: str, seconds: float) -> str:
        """The time ``time`` plus (``sign`` ``+``) or minus (``-``) ``seconds``."""
        raise NotImplementedError

    def lease_until(self, lease: float) -> str:
        """The end of a lease of ``lease`` seconds from now, on the server's clock."""
        return self.shift(self.write_now, "+", lease)

    def ago(self, seconds: float) -> str:
        """The server's time ``seconds`` ago."""
        return self.shift(self.now, "-", seconds)

    def epoch(self, column: str) -> str:
        """A time column as unix seconds."""
        raise NotImplementedError

    #: Whether ``INSERT .. ON CONFLICT (columns) DO NOTHING`` exists.
    supports_on_conflict = True

    def on_conflict_do_nothing(self, columns: Sequence[str]) -> str:
        """``ON CONFLICT (columns) DO NOTHING`` (ValueError where the engine has none)."""
        if not self.supports_on_conflict:
            raise ValueError(f"{self.name} has no ON CONFLICT (columns) clause")
        return f"ON CONFLICT ({', '.join(self.q(c) for c in columns)}) DO NOTHING"

    def if_absent(self, columns: Sequence[str]) -> str:
        """The tail of an INSERT into a table whose only unique key is ``columns``: no error
        and no change where the row exists."""
        return self.on_conflict_do_nothing(columns)

    #: What a SELECT appends to read the newest committed row, not the transaction's
    #: snapshot (InnoDB's REPEATABLE READ); the other engines read it anyway.
    read_latest = ""

    # -- the driver -----------------------------------------------------------------

    def connector(
        self, url: str, connect_args: dict[str, Any], timeout: float
    ) -> Callable[[], Any]:
        """A factory of connections to ``url``: each call opens one (nothing is opened here).

        ``timeout`` caps the driver's waits where the URL and ``connect_args``
        set none (see ``SqlStore.from_url``).
        """
        raise NotImplementedError

    #: Whether a connect is local (no network to wait for: no connect thread).
    connects_locally = False

    def error_classes(self) -> tuple[type[BaseException], ...]:
        """The driver's errors (what a transaction turns into the store's errors)."""
        raise NotImplementedError

    def is_duplicate_key(self, exc: BaseException) -> bool:
        """Whether ``exc`` (the driver's own, unwrapped) is a duplicate-key error, and no other."""
        return False

    def is_unique_violation(self, exc: BaseException) -> bool:
        """Whether ``exc`` (also wrapped by SQLAlchemy) is this driver's duplicate-key error."""
        return self.is_duplicate_key(driver_error(exc))

    def duplicate_key_index(self, exc: BaseException, table: str) -> str | None:
        """The index a duplicate-key error names, lower-cased, where the engine says it."""
        return None

    def is_transient(self, exc: BaseException) -> bool:
        """A deadlock or serialization failure: the transaction was rolled back; retry it."""
        return False

    def is_missing_table(self, exc: BaseException) -> bool:
        return False

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        """Whether the connection is lost (it is dropped, and the next call connects)."""
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

    def prepare(self, conn: Any) -> None:
        """Session setup of a new connection (transactions, time zone, isolation)."""

    def begin(self, cur: Any, write: bool) -> None:
        """Starts the transaction (drivers that begin implicitly do nothing)."""

    #: Statements run once, outside a transaction, before the dedup table is created.
    database_setup: tuple[str, ...] = ()

    # -- a caller's connection (the patterns) ---------------------------------------------

    def autocommit_of(self, raw: Any) -> str | None:
        """The driver setting that puts the DB-API connection ``raw`` in autocommit, or None."""
        return None

    def manual_begin(self, raw: Any) -> str | None:
        """The setting with which the driver leaves BEGIN to the caller, or None.

        Such a connection commits every statement by itself unless a
        transaction is open (:meth:`in_transaction`).
        """
        return None

    def in_transaction(self, raw: Any) -> bool:
        """Whether the DB-API connection has a transaction open."""
        raise NotImplementedError

    def immediate_begin(self, raw: Any) -> str | None:
        """The statement that takes the write lock before the first write, when the
        driver would open a transaction that takes it late (SQLite); else None."""
        return None

    #: Whether the catalog's names are case-insensitive.
    folds_names = False

    def catalog(self, run: Run, table: str) -> Catalog:
        """A table's columns and unique indexes ``(name, columns)`` as the catalog reports.

        Only indexes over plain columns, without ``WHERE`` or expressions; no
        columns when the table does not exist.
        """
        raise NotImplementedError

    def consumed_schema(self, table: str, key_bytes: int) -> list[str]:
        """The transactional dedup table (:mod:`dedupcore.patterns.table`) and its index."""
        raise NotImplementedError

    # -- the dedup table ---------------------------------------------------------------

    #: The dedup table's column types (:meth:`dedup_table`): the namespace, the key and
    #: other bytes, small and big integers, times; what follows the table's definition.
    namespace_type = "TEXT"
    bytes_type = "BLOB"
    small_int = big_int = "INTEGER"
    time_type = "REAL"
    table_options = ""

    def schema(self, table: str) -> list[str]:
        """The dedup table and its index."""
        return [
            self.dedup_table(table, part=False),
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_updated')} ON {self.q(table)} (updated)",
        ]

    def dedup_table(self, table: str, part: bool) -> str:
        """The dedup table; with a ``part`` column and RANGE partitions of it when ``part``."""
        b, t = self.bytes_type, self.time_type
        part_col = f"\n                part {self.big_int} NOT NULL," if part else ""
        return f"""CREATE TABLE IF NOT EXISTS {self.q(table)} (
                namespace {self.namespace_type} NOT NULL,
                "key" {b} NOT NULL,{part_col}
                state {self.small_int} NOT NULL CHECK (state IN (1, 2, 3)),
                token {self.big_int} NOT NULL CHECK (token > 0),
                owner {b},
                fingerprint {b},
                result {b},
                lease_until {t},
                created {t} NOT NULL,
                updated {t} NOT NULL,
                PRIMARY KEY (namespace, "key"{", part" if part else ""})
            ){" PARTITION BY RANGE (part)" if part else self.table_options}"""

    def durability(self, cur: Any) -> tuple[int, str]:
        """What a committed claim survives: a level (see ``durability_report``) and words."""
        raise NotImplementedError

    def server_version(self, cur: Any) -> str:
        raise NotImplementedError

    for_update = " FOR UPDATE"
    #: Whether a batch that is mostly DUPLICATE is read without locks first.
    read_first = False
    #: Whether a read-only call runs without a transaction (one round trip, no COMMIT).
    autocommit_reads = False
    #: Whether :meth:`insert_fresh` can insert ``plain``: fail on any existing key.
    plain_insert = False
    #: Whether the rows a claim creates carry its nonce (in ``result``): the engine
    #: cannot return the rows an INSERT actually created.
    marks_created = False

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
        *,
        plain: bool = False,
    ) -> set[bytes] | None:
        """Creates the rows that do not exist; the keys created, or None if unknown.

        ``plain`` (where :attr:`plain_insert`): a plain INSERT of every row,
        which raises a duplicate-key error if any exists.
        """
        if plain and not self.plain_insert:
            raise ValueError(f"{self.name} inserts a claim's rows if absent only")
        return self.insert(cur, NewRows(table, ns, keys, fps, owner, lease, nonce, parts), plain)

    def insert(self, cur: Any, new: NewRows, plain: bool) -> set[bytes] | None:
        """:meth:`insert_fresh`: multi-row VALUES, :data:`CHUNK` rows a statement."""
        assert not plain
        if new.parts is not None and not self.partitions:
            raise ValueError(f"{self.name} tables are not partitioned")
        nonce, part = self.marks_created, new.parts is not None
        cols = ["namespace", "key", *(["part"] if part else []), "state", "token", "owner"]
        cols += ["fingerprint", *(["result"] if nonce else []), "lease_until", "created"]
        ph = self.ph
        row = (
            f"({ph}, {ph}, {f'{ph}, ' if part else ''}{PROCESSING}, 1, {ph}, {ph}, "
            f"{f'{ph}, ' if nonce else ''}{self.lease_until(new.lease)}, {self.now}, {self.now})"
        )
        into = f"INSERT INTO {self.q(new.table)} ({', '.join(self.q(c) for c in cols)}, updated)"
        parts = new.parts or [0] * len(new.keys)  # (only sent with a part column)
        created: set[bytes] | None = None if nonce else set()
        for i in range(0, len(new.keys), CHUNK):
            params: list[Any] = []
            for j in range(i, min(i + CHUNK, len(new.keys))):
                params += (new.namespace, new.keys[j], *([parts[j]] if part else []))
                params += (new.owner, new.fingerprints[j], *([new.nonce] if nonce else []))
            count = min(i + CHUNK, len(new.keys)) - i
            cur.execute(
                f"{into} VALUES {', '.join([row] * count)} {self.if_absent(KEY)}"
                + ("" if created is None else f" RETURNING {self.q('key')}"),
                params,
            )
            if created is not None:
                created.update(bytes(r[0]) for r in cur.fetchall())
        return created  # None: the SELECT .. FOR UPDATE tells them by the nonce

    def select_rows(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        parts: tuple[int, int | None] | None = None,
        lock: bool = True,
    ) -> Rows:
        """``(key, state, token, owner, fingerprint, result, live)`` of existing keys, locked.

        ``parts=(lo, hi)`` (a partitioned table): the keys' rows in partitions
        ``lo`` .. ``hi`` (None: every one from ``lo``), with ``part`` after ``key``;
        ``lock=False`` reads them without locking them.
        """
        part, where, order = part_range(parts, self.q("key"))
        cols = f"{part}state, token, owner, fingerprint, result, lease_until > {self.now}"
        if parts is not None:
            return self.select_parted(cur, cols, table, ns, keys, where, lock)
        return self._select_in(cur, cols, table, ns, keys, f"{order}{self._lock(lock)}")

    def select_parted(
        self, cur: Any, cols: str, table: str, ns: str, keys: list[bytes], where: str, lock: bool
    ) -> Rows:
        """:meth:`select_rows` in partitions: ``cols`` of the keys' rows that match ``where``."""
        return self._select_in(cur, cols, table, ns, keys, f"{where}{self._lock(lock)}")

    def _lock(self, lock: bool) -> str:
        return self.for_update if lock else ""

    def read_rows(self, cur: Any, table: str, ns: str, keys: list[bytes]) -> Rows:
        """``(key, state, token, owner, fingerprint, result)`` of existing keys, not locked."""
        return self._select_in(cur, "state, token, owner, fingerprint, result", table, ns, keys)

    def _select_in(
        self, cur: Any, cols: str, table: str, ns: str, keys: list[bytes], tail: str = ""
    ) -> Rows:
        """``SELECT key, cols`` of the keys' rows, :data:`CHUNK` keys a statement."""
        out: Rows = []
        for among, chunk in self._in_list(keys):
            cur.execute(
                f"SELECT {self.q('key')}, {cols} FROM {self.q(table)} "
                f"WHERE namespace = {self.ph} AND {among}{tail}",
                [ns, *chunk],
            )
            out += cur.fetchall()
        return out

    def _in_list(self, keys: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
        """``key IN (..)`` for :data:`CHUNK` keys at a time, with those keys."""
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i : i + CHUNK]
            yield f"{self.q('key')} IN ({', '.join([self.ph] * len(chunk))})", chunk

    def update_rows(self, cur: Any, table: str, ns: str, update: RowUpdate) -> None:
        """``UPDATE .. SET`` each row of ``update`` (its keys already locked)."""
        raise NotImplementedError

    def set_clause(self, sets: SetList, value: Callable[[int], str]) -> str:
        return ", ".join(f"{col} = {value(e) if isinstance(e, int) else e}" for col, e in sets)

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        """Deletes the rows of ``keys`` (already locked) that still match ``where``."""
        deleted = 0
        for among, chunk in self._in_list(keys):
            cur.execute(
                f"DELETE FROM {self.q(table)} WHERE namespace = {self.ph} AND {among} AND {where}",
                [ns, *chunk],
            )
            deleted += int(cur.rowcount)
        return deleted

    #: How many times :meth:`limited` writes ``where`` (its parameters go that often).
    where_repeats = 2

    def limited(self, verb: str, table: str, where: str, limit: int, key: Key = KEY) -> str:
        """``verb`` on at most ``limit`` rows matching ``where`` (re-checked per row).

        ``key``: the table's primary key columns.
        """
        cols = ", ".join(self.q(c) for c in key)
        return (
            f"{verb} WHERE ({cols}) IN (SELECT {cols} FROM {self.q(table)} "
            f"WHERE {where} LIMIT {int(limit)}) AND {where}"
        )

    # -- partitions by event time (docs/sql-partitions.md) ------------------------------

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

    def missing_parts(self, have: list[int], horizon: int, top: int, span: int) -> list[int]:
        """The starts of the partitions to create so that every one to ``top`` exists."""
        present = set(have)
        return [s for s in range(horizon, top + 1, span) if s not in present]

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        """Creates the partitions starting at ``starts``."""
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


def part_range(parts: tuple[int, int | None] | None, key: str) -> tuple[str, str, str]:
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


def part_name(table: str, start: int) -> str:
    """The name of the partition that starts at ``start`` (unix seconds)."""
    return f"{table}_p{int(start)}"


def part_start(table: str, name: str) -> int:
    """The start of the partition ``name`` (SchemaError for one dedupcore did not make)."""
    prefix = f"{table}_p"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        raise SchemaError(f"partition {name!r} of table {table!r} is not one dedupcore made")
    return int(name[len(prefix) :])


def horizon_of(row: tuple[Any, ...] | None, table: str) -> int:
    """The horizon from the partition table's row (SchemaError when it has none)."""
    if row is None:
        raise SchemaError(f"the partition table {table}_parts has no row: run init_schema()")
    return int(row[0])
