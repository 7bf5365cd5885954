"""The sqlite dialect of the SQL authority."""

from __future__ import annotations

from typing import Any

from dedupcore.sql.dialects.base import (
    _CHUNK,
    _PROCESSING,
    _Dialect,
    _SetList,
)
from dedupcore.sql.dialects.base import on_conflict_do_nothing as _do_nothing


class _SQLite(_Dialect):
    name = "sqlite"
    ph = "?"
    max_key_bytes = 65536
    for_update = ""  # BEGIN IMMEDIATE holds the database's write lock

    @property
    def now(self) -> str:
        return "((julianday('now') - 2440587.5) * 86400.0)"

    def lease_until(self, lease: float) -> str:
        return f"({self.now} + {lease:.6f})"

    def ago(self, seconds: float) -> str:
        return f"({self.now} - {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return column

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import sqlite3

        return (sqlite3.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        return "no such table" in str(exc)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        import sqlite3

        # "Cannot operate on a closed database."
        return isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc)

    def is_refused(self, exc: BaseException) -> bool:
        import sqlite3

        return isinstance(exc, (sqlite3.DataError, sqlite3.IntegrityError))

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

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT sqlite_version()")
        return f"SQLite {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace TEXT NOT NULL,
                "key" BLOB NOT NULL,
                state INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
                token INTEGER NOT NULL CHECK (token > 0),
                owner BLOB,
                fingerprint BLOB,
                result BLOB,
                lease_until REAL,
                created REAL NOT NULL,
                updated REAL NOT NULL,
                PRIMARY KEY (namespace, "key")
            ) WITHOUT ROWID""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_updated')} ON {t} (updated)",
        ]

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
        assert parts is None, "SQLite tables are not partitioned"
        row = f"(?, ?, {_PROCESSING}, 1, ?, ?, {self.lease_until(lease)}, {self.now}, {self.now})"
        created: set[bytes] = set()
        for i in range(0, len(keys), _CHUNK):
            params: list[Any] = []
            for k, fp in zip(keys[i : i + _CHUNK], fps[i : i + _CHUNK], strict=True):
                params += (ns, k, owner, fp)
            cur.execute(
                f'INSERT INTO {self.q(table)} (namespace, "key", state, token, owner, '
                "fingerprint, lease_until, created, updated) VALUES "
                + ", ".join([row] * (len(params) // 4))
                + f' {_do_nothing(self.name, ["namespace", "key"])} RETURNING "key"',
                params,
            )
            created.update(bytes(r[0]) for r in cur.fetchall())
        return created

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
        assert not parted, "SQLite tables are not partitioned"
        order = [e for _, e in sets if isinstance(e, int)]
        assert order == sorted(order), "per-row values must appear in order"
        cur.executemany(
            f"UPDATE {self.q(table)} SET {self.set_clause(sets, lambda i: '?')} "
            'WHERE namespace = ? AND "key" = ?',
            [[*r[1:], ns, r[0]] for r in rows],
        )
