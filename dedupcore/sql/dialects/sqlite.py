"""SQLite through sqlite3: one writer at a time (``BEGIN IMMEDIATE``), times as unix seconds."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import Any

from dedupcore.sql.dialects.base import Catalog, Dialect, RowUpdate, Run

__all__ = ["SQLiteDialect"]

# sqlite3 extended result codes (Python 3.11+ exposes them as exc.sqlite_errorcode).
_SQLITE_CONSTRAINT_PRIMARYKEY = 1555
_SQLITE_CONSTRAINT_UNIQUE = 2067
#: Unix seconds, from the Julian day.
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class SQLiteDialect(Dialect):
    """SQLite (sqlite3): ``sqlite:///relative/path.db`` and ``sqlite:////absolute/path.db``."""

    name = "sqlite"
    driver = "sqlite3"
    schemes = ("sqlite",)
    ph = "?"
    max_key_bytes = 65536
    for_update = ""  # BEGIN IMMEDIATE holds the database's write lock
    connects_locally = True  # a file: nothing to wait for but its lock
    # WAL: readers do not block the writer (a no-op for :memory: databases).
    database_setup = ("PRAGMA journal_mode = WAL",)
    folds_names = True
    now = _NOW
    utc_now = _NOW
    namespace_type, bytes_type, small_int, big_int, time_type = (
        "TEXT",
        "BLOB",
        *["INTEGER"] * 2,
        "REAL",
    )
    table_options = " WITHOUT ROWID"

    write_now = _NOW

    def shift(self, time: str, sign: str, seconds: float) -> str:
        return f"({time} {sign} {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return column

    # -- the driver -----------------------------------------------------------------------

    def connector(
        self, url: str, connect_args: dict[str, Any], timeout: float
    ) -> Callable[[], Any]:
        if not url.startswith("sqlite:///"):
            raise ValueError(
                f"sqlite URLs are sqlite:///relative/path.db or sqlite:////absolute/path.db, "
                f"got {url!r}"
            )
        path = url[len("sqlite:///") :]
        if not path:
            raise ValueError("sqlite URL has no path")
        args = {"timeout": 30.0, "check_same_thread": False, **connect_args}
        return functools.partial(sqlite3.connect, path, **args)

    def error_classes(self) -> tuple[type[BaseException], ...]:
        return (sqlite3.Error,)

    def is_duplicate_key(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.IntegrityError):
            return False
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            return code in (_SQLITE_CONSTRAINT_UNIQUE, _SQLITE_CONSTRAINT_PRIMARYKEY)
        return str(exc).startswith("UNIQUE constraint failed")  # Python < 3.11

    def is_missing_table(self, exc: BaseException) -> bool:
        return "no such table" in str(exc)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        # "Cannot operate on a closed database."
        return isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc)

    def is_refused(self, exc: BaseException) -> bool:
        return isinstance(exc, (sqlite3.DataError, sqlite3.IntegrityError))

    def prepare(self, conn: Any) -> None:
        conn.isolation_level = None  # explicit BEGIN IMMEDIATE / COMMIT
        cur = conn.cursor()
        try:
            cur.execute("PRAGMA busy_timeout")
            if not cur.fetchone()[0]:
                cur.execute("PRAGMA busy_timeout = 30000")
        finally:
            cur.close()

    def arm(self, conn: Any, wait: float) -> None:
        # The busy wait for another writer's lock: the time left, in whole milliseconds.
        conn.execute(f"PRAGMA busy_timeout = {max(1, int(wait * 1000))}")

    def begin(self, cur: Any, write: bool) -> None:
        if write:
            cur.execute("BEGIN IMMEDIATE")

    # -- a caller's connection (the patterns) ---------------------------------------------

    def autocommit_of(self, raw: Any) -> str | None:
        if getattr(raw, "autocommit", None) is True:  # Python 3.12+
            return "sqlite3 connection autocommit=True"
        return None

    def manual_begin(self, raw: Any) -> str | None:
        return "sqlite3 connection isolation_level=None" if raw.isolation_level is None else None

    def in_transaction(self, raw: Any) -> bool:
        return bool(raw.in_transaction)

    def immediate_begin(self, raw: Any) -> str | None:
        # sqlite3 opens a *deferred* transaction before the first write; one that has
        # read anything (even the schema) and then finds the writer lock taken fails at
        # once with "database is locked" instead of waiting out the busy timeout.
        # Autocommit connections and open transactions are left alone.
        if (
            not raw.in_transaction
            and raw.isolation_level is not None
            and getattr(raw, "autocommit", None) is not True
        ):
            return "BEGIN IMMEDIATE"
        return None

    def catalog(self, run: Run, table: str) -> Catalog:
        _, rows = run("SELECT name, pk FROM pragma_table_info(?) ORDER BY cid", [table])
        columns = tuple(str(r[0]) for r in rows)
        pk = tuple(str(name) for name, n in sorted(rows, key=lambda r: r[1]) if n)
        _, rows = run('SELECT name, "unique", partial FROM pragma_index_list(?)', [table])
        found: list[tuple[str, tuple[str, ...]]] = [("PRIMARY KEY", pk)] if pk else []
        for name, is_unique, partial in rows:
            if not is_unique or partial:
                continue
            _, cols = run("SELECT name FROM pragma_index_info(?) ORDER BY seqno", [name])
            if any(col[0] is None for col in cols):
                continue  # an expression
            found.append((str(name), tuple(str(col[0]) for col in cols)))
        return columns, tuple(found)

    def consumed_schema(self, table: str, key_bytes: int) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
            namespace TEXT NOT NULL,
            "key" BLOB NOT NULL,
            created REAL NOT NULL,
            result BLOB,
            PRIMARY KEY (namespace, "key")
        ) WITHOUT ROWID""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_created')} ON {t} (created)",
        ]

    # -- the dedup table ----------------------------------------------------------------

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("PRAGMA synchronous")
        level = int(cur.fetchone()[0])
        cur.execute("PRAGMA journal_mode")
        journal = str(cur.fetchone()[0]).lower()
        if level >= 2:
            return 3, f"synchronous {level} ({journal}): survives a crash and a power loss"
        if level == 1 and journal == "wal":
            return (
                2,
                "synchronous NORMAL (wal): survives a process crash; a power loss can lose "
                "the last committed claims",
            )
        return (
            0,
            f"synchronous {level} ({journal}): an OS crash or a power loss can lose or "
            "corrupt committed claims",
        )

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT sqlite_version()")
        return f"SQLite {cur.fetchone()[0]}"

    def update_rows(self, cur: Any, table: str, ns: str, update: RowUpdate) -> None:
        if update.parted:
            raise ValueError("SQLite tables are not partitioned")
        order = [e for _, e in update.sets if isinstance(e, int)]
        assert order == sorted(order), "per-row values must appear in order"
        cur.executemany(
            f"UPDATE {self.q(table)} SET {self.set_clause(update.sets, lambda i: '?')} "
            'WHERE namespace = ? AND "key" = ?',
            [[*r[1:], ns, r[0]] for r in update.rows],
        )
