"""MariaDB/MySQL through PyMySQL: no ON CONFLICT, InnoDB's locks, partitions added at the end."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dedupcore.sql.dialects.base import (
    CHUNK,
    KEY,
    Catalog,
    Dialect,
    Key,
    RowUpdate,
    Run,
    driver_error,
    horizon_of,
    part_name,
    part_start,
)
from dedupcore.tiers.base import check_timeout

__all__ = ["MYSQL_DUP_ENTRY", "MySQLDialect"]

#: ER_DUP_ENTRY and ER_DUP_ENTRY_WITH_KEY_NAME.
MYSQL_DUP_ENTRY = (1062, 1586)
#: The index a duplicate-key error names: ``... for key 'name'``.
_DUP_KEY_RE = re.compile(r"for key '(.*)'\Z", re.S)
#: What a committed claim survives, by innodb_flush_log_at_trx_commit (0 and others alike).
_FLUSH = {
    1: (3, "survives a crash and a power loss"),
    2: (
        2,
        "survives a server crash; an OS crash or a power loss can lose about the last "
        "second of committed claims",
    ),
    0: (1, "a server crash can lose about the last second of committed claims"),
}
#: Namespace and key columns, as in every table dedupcore makes.
_NAMESPACE = "namespace VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL"


def _code(exc: BaseException) -> object:
    """The error number of a PyMySQL error (its first argument), or None."""
    args: tuple[Any, ...] = exc.args
    return args[0] if args else None


def _connect(args: dict[str, Any]) -> Any:
    import pymysql

    return pymysql.connect(**args)


class MySQLDialect(Dialect):
    """MariaDB or MySQL (PyMySQL): ``mysql://`` and ``mariadb://`` URLs."""

    name = "mysql"
    driver = "pymysql"
    schemes = ("mysql", "mariadb")
    max_key_bytes = 512  # the VARBINARY(512) column
    supports_on_conflict = False
    marks_created = True
    partitions = True
    read_latest = " LOCK IN SHARE MODE"
    now = "CURRENT_TIMESTAMP(6)"  # the store's sessions are in UTC (prepare)
    utc_now = "UTC_TIMESTAMP(6)"

    def q(self, ident: str) -> str:
        return f"`{ident}`"

    write_now = now

    def shift(self, time: str, sign: str, seconds: float) -> str:
        return f"{time} {sign} INTERVAL {max(1, round(seconds * 1e6))} MICROSECOND"

    def epoch(self, column: str) -> str:
        return f"UNIX_TIMESTAMP({column})"

    def if_absent(self, columns: Sequence[str]) -> str:
        # Fires on any unique key: only for tables with one (never INSERT IGNORE, which
        # would turn every error into a warning).
        return f"ON DUPLICATE KEY UPDATE {self.q(columns[-1])} = {self.q(columns[-1])}"

    # -- the driver -----------------------------------------------------------------------

    def connector(
        self, url: str, connect_args: dict[str, Any], timeout: float
    ) -> Callable[[], Any]:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        # Caps of each wait; a store's call gives each one at most its time left.
        waits: dict[str, Any] = {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
        }
        for name in waits:
            if name in query:
                try:
                    waits[name] = check_timeout(float(query[name]), name)
                except ValueError as exc:
                    raise ValueError(f"{name} in the URL: {exc}") from None
        args = {
            "host": parts.hostname or "localhost",
            "port": parts.port or 3306,
            "user": unquote(parts.username) if parts.username else "root",
            "password": unquote(parts.password) if parts.password else "",
            "database": unquote(parts.path.lstrip("/")) or None,
            "charset": "utf8mb4",
            **waits,
            **({"unix_socket": query["unix_socket"]} if "unix_socket" in query else {}),
            **connect_args,
        }

        return functools.partial(_connect, args)

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import pymysql

        return (pymysql.err.Error,)

    def is_duplicate_key(self, exc: BaseException) -> bool:
        if type(exc).__module__.split(".")[0] != self.driver:
            return False
        import pymysql

        return isinstance(exc, pymysql.err.IntegrityError) and _code(exc) in MYSQL_DUP_ENTRY

    def duplicate_key_index(self, exc: BaseException, table: str) -> str | None:
        # MySQL 8 writes ``table.index``, MariaDB the index alone.
        args: tuple[Any, ...] = driver_error(exc).args
        match = _DUP_KEY_RE.search(str(args[1])) if len(args) > 1 else None
        if match is None:
            return None
        name = match.group(1)
        if name.lower().startswith(table.lower() + "."):
            name = name[len(table) + 1 :]
        return name.lower()

    def is_missing_table(self, exc: BaseException) -> bool:
        return _code(exc) == 1146  # ER_NO_SUCH_TABLE

    def is_transient(self, exc: BaseException) -> bool:
        # 1213 deadlock, 1205 lock wait timeout (we roll the whole transaction back).
        return _code(exc) in (1205, 1213)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        import pymysql

        # 2006 gone away, 2013 lost during query, 1927 killed, 4031 idle timeout, 2003 refused.
        return (
            isinstance(exc, pymysql.err.InterfaceError)
            or _code(exc) in (2003, 2006, 2013, 1927, 4031)
            or not getattr(conn, "open", True)
        )

    def is_refused(self, exc: BaseException) -> bool:
        import pymysql

        return isinstance(exc, (pymysql.err.DataError, pymysql.err.IntegrityError))

    def arm(self, conn: Any, wait: float) -> None:
        # PyMySQL sets its socket's timeout to these before every read and write; the
        # connection's own values (read_timeout=, write_timeout=) stay the caps.
        try:
            caps = conn._dedupcore_caps
        except AttributeError:  # the first transaction: its own values are the caps
            caps = conn._dedupcore_caps = (conn._read_timeout, conn._write_timeout)
        conn._read_timeout = wait if caps[0] is None else min(wait, caps[0])
        conn._write_timeout = wait if caps[1] is None else min(wait, caps[1])

    def socket_of(self, conn: Any) -> int | None:
        sock = conn._sock  # None once closed
        return None if sock is None else int(sock.fileno())

    def prepare(self, conn: Any) -> None:
        conn.autocommit(False)
        with conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.commit()

    def autocommit_of(self, raw: Any) -> str | None:
        if raw.get_autocommit():
            return "PyMySQL connection autocommit (connect(autocommit=True) or autocommit(True))"
        return None

    folds_names = True

    def catalog(self, run: Run, table: str) -> Catalog:
        _, rows = run(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            [table],
        )
        columns = tuple(str(r[0]) for r in rows)
        _, rows = run(
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
        return columns, unique

    def consumed_schema(self, table: str, key_bytes: int) -> list[str]:
        return [
            f"""CREATE TABLE IF NOT EXISTS {self.q(table)} (
                {_NAMESPACE},
                `key` VARBINARY({int(key_bytes)}) NOT NULL,
                created DATETIME(6) NOT NULL,
                result LONGBLOB NULL,
                PRIMARY KEY (namespace, `key`),
                KEY {self.q(table + "_created")} (created)
            ) ENGINE=InnoDB"""
        ]

    # -- the dedup table ----------------------------------------------------------------

    def schema(self, table: str) -> list[str]:
        return [self._table(table, None)]

    def _table(self, table: str, first: tuple[int, int] | None) -> str:
        """The dedup table; with ``first=(start, span)``, a ``part`` column and RANGE
        partitions of it, starting with that one."""
        part_col, key, index, tail = (
            "",
            "",
            f"\n                KEY {self.q(table + '_updated')} (updated),",
            "",
        )
        if first is not None:
            start, span = first
            part_col, key, index = "\n                part BIGINT NOT NULL,", ", part", ""
            tail = (
                " PARTITION BY RANGE (part) (PARTITION "
                f"{self.q(part_name('p', start))} VALUES LESS THAN ({int(start + span)}))"
            )
        return f"""CREATE TABLE IF NOT EXISTS {self.q(table)} (
                {_NAMESPACE},
                `key` VARBINARY(512) NOT NULL,{part_col}
                state TINYINT NOT NULL,
                token BIGINT NOT NULL,
                owner VARBINARY(255) NULL,
                fingerprint VARBINARY(255) NULL,
                result LONGBLOB NULL,
                lease_until DATETIME(6) NULL,
                created DATETIME(6) NOT NULL,
                updated DATETIME(6) NOT NULL,
                PRIMARY KEY (namespace, `key`{key}),{index}
                CONSTRAINT {self.q(table + "_state")} CHECK (state IN (1, 2, 3)),
                CONSTRAINT {self.q(table + "_token")} CHECK (token > 0)
            ) ENGINE=InnoDB ROW_FORMAT=DYNAMIC{tail}"""

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
        mode = int(cur.fetchone()[0])
        level, said = _FLUSH.get(mode, _FLUSH[0])
        return level, f"innodb_flush_log_at_trx_commit {mode}: {said}"

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT VERSION()")
        return f"MySQL/MariaDB {cur.fetchone()[0]}"

    def update_rows(self, cur: Any, table: str, ns: str, update: RowUpdate) -> None:
        # A join with a derived table of the rows, CHUNK rows a statement.
        parted = update.parted
        names = ["k", *(["p"] if parted else []), *(f"v{i}" for i in range(len(update.types)))]
        first = "SELECT " + ", ".join(f"%s AS {n}" for n in names)
        other = "SELECT " + ", ".join(["%s"] * len(names))
        set_sql = self.set_clause(update.sets, lambda i: f"u.v{i}")
        t = self.q(table)
        on_part = f" AND {t}.part = u.p" if parted else ""
        for i in range(0, len(update.rows), CHUNK):
            chunk = update.rows[i : i + CHUNK]
            derived = " UNION ALL ".join([first] + [other] * (len(chunk) - 1))
            cur.execute(
                f"UPDATE {t} JOIN ({derived}) AS u ON {t}.namespace = %s AND {t}.`key` = u.k"
                f"{on_part} SET {set_sql}",
                [*(v for r in chunk for v in r), ns],
            )

    where_repeats = 1

    def limited(self, verb: str, table: str, where: str, limit: int, key: Key = KEY) -> str:
        return f"{verb} WHERE {where} LIMIT {int(limit)}"

    # -- partitions by event time (docs/sql-partitions.md) ------------------------------

    def part_schema(self, table: str, first: int, span: int) -> list[str]:
        meta = self.q(table + "_parts")
        return [
            self._table(table, (first, span)),
            f"""CREATE TABLE IF NOT EXISTS {meta} (
                id INT PRIMARY KEY, span BIGINT NOT NULL, horizon BIGINT NOT NULL
            ) ENGINE=InnoDB""",
            f"INSERT INTO {meta} VALUES (1, {int(span)}, {int(first)}) {self.if_absent(['id'])}",
            f"""CREATE TABLE IF NOT EXISTS {self.q(table + "_edge")} (
                {_NAMESPACE},
                `key` VARBINARY(512) NOT NULL,
                boundary BIGINT NOT NULL,
                PRIMARY KEY (namespace, `key`, boundary),
                KEY {self.q(table + "_edge_b")} (boundary)
            ) ENGINE=InnoDB""",
        ]

    def part_list(self, cur: Any, table: str) -> list[int]:
        cur.execute(
            "SELECT PARTITION_NAME FROM information_schema.PARTITIONS WHERE "
            "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL",
            [table],
        )
        return sorted(part_start("p", str(r[0])) for r in cur.fetchall())

    def is_partitioned(self, cur: Any, table: str) -> bool:
        cur.execute(
            "SELECT count(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL",
            [table],
        )
        return bool(cur.fetchone()[0])

    def missing_parts(self, have: list[int], horizon: int, top: int, span: int) -> list[int]:
        # RANGE partitions are added after the last one only.
        start = have[-1] + span if have else horizon
        return list(range(start, top + 1, span))

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        # A concurrent store that added them first makes this fail with 1517/1493,
        # which the caller re-reads.
        if starts:
            cur.execute(
                f"ALTER TABLE {self.q(table)} ADD PARTITION ("
                + ", ".join(
                    f"PARTITION {self.q(part_name('p', s))} VALUES LESS THAN ({int(s + span)})"
                    for s in starts
                )
                + ")"
            )

    def part_drop(self, cur: Any, table: str, start: int) -> None:
        try:
            cur.execute(
                f"ALTER TABLE {self.q(table)} DROP PARTITION {self.q(part_name('p', start))}"
            )
        except Exception as exc:
            if _code(exc) != 1507:  # ER_DROP_PARTITION_NON_EXISTENT: gone already
                raise

    def part_from(self, table: str, start: int) -> str:
        return f"{self.q(table)} PARTITION ({self.q(part_name('p', start))})"

    def part_guard(self, cur: Any, table: str, exclusive: bool) -> int:
        mode = "FOR UPDATE" if exclusive else "LOCK IN SHARE MODE"
        cur.execute(f"SELECT horizon FROM {self.q(table + '_parts')} WHERE id = 1 {mode}")
        return horizon_of(cur.fetchone(), table)

    def lock_edges(self, cur: Any, table: str, ns: str, edges: list[tuple[bytes, int]]) -> None:
        for i in range(0, len(edges), CHUNK):
            chunk = edges[i : i + CHUNK]
            cur.execute(
                f"INSERT INTO {self.q(table + '_edge')} (namespace, `key`, boundary) VALUES "
                + ", ".join(["(%s, %s, %s)"] * len(chunk))
                + f" {self.if_absent(['boundary'])}",
                [v for k, b in chunk for v in (ns, k, b)],
            )
