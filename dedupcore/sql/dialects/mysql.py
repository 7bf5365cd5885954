"""The mysql dialect of the SQL authority."""

from __future__ import annotations

from typing import Any

from dedupcore.errors import SchemaError
from dedupcore.sql.dialects.base import (
    _CHUNK,
    _PROCESSING,
    _Dialect,
    _part_name,
    _part_start,
    _SetList,
)


class _MySQL(_Dialect):
    name = "mysql"
    max_key_bytes = 512  # the VARBINARY(512) column

    @property
    def now(self) -> str:
        return "CURRENT_TIMESTAMP(6)"

    def lease_until(self, lease: float) -> str:
        return f"CURRENT_TIMESTAMP(6) + INTERVAL {max(1, round(lease * 1e6))} MICROSECOND"

    def ago(self, seconds: float) -> str:
        return f"CURRENT_TIMESTAMP(6) - INTERVAL {max(1, round(seconds * 1e6))} MICROSECOND"

    def epoch(self, column: str) -> str:
        return f"UNIX_TIMESTAMP({column})"

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import pymysql

        return (pymysql.err.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        args: tuple[Any, ...] = exc.args
        return bool(args) and args[0] == 1146  # ER_NO_SUCH_TABLE

    def is_transient(self, exc: BaseException) -> bool:
        # 1213 deadlock, 1205 lock wait timeout (we roll the whole transaction back).
        args: tuple[Any, ...] = exc.args
        return bool(args) and args[0] in (1205, 1213)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        import pymysql

        args: tuple[Any, ...] = exc.args
        code = args[0] if args else None
        # 2006 gone away, 2013 lost during query, 1927 killed, 4031 idle timeout, 2003 refused.
        return (
            isinstance(exc, pymysql.err.InterfaceError)
            or code in (2003, 2006, 2013, 1927, 4031)
            or not getattr(conn, "open", True)
        )

    def is_refused(self, exc: BaseException) -> bool:
        import pymysql

        return isinstance(exc, (pymysql.err.DataError, pymysql.err.IntegrityError))

    def arm(self, conn: Any, wait: float) -> None:
        # PyMySQL sets its socket's timeout to these before every read and write; the
        # connection's own values (read_timeout=, write_timeout=) stay the caps.
        caps = getattr(conn, "_dedupcore_caps", None)
        if caps is None:
            caps = conn._dedupcore_caps = (conn._read_timeout, conn._write_timeout)
        conn._read_timeout = wait if caps[0] is None else min(wait, caps[0])
        conn._write_timeout = wait if caps[1] is None else min(wait, caps[1])

    def socket_of(self, conn: Any) -> int | None:
        sock = getattr(conn, "_sock", None)
        return None if sock is None else int(sock.fileno())

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
        mode = int(cur.fetchone()[0])
        if mode == 1:
            return 3, "innodb_flush_log_at_trx_commit 1: survives a crash and a power loss"
        if mode == 2:
            return (
                2,
                "innodb_flush_log_at_trx_commit 2: survives a server crash; an OS crash or a "
                "power loss can lose about the last second of committed claims",
            )
        return (
            1,
            f"innodb_flush_log_at_trx_commit {mode}: a server crash can lose about the last "
            "second of committed claims",
        )

    def prepare(self, conn: Any) -> None:
        conn.autocommit(False)
        with conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.commit()

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT VERSION()")
        return f"MySQL/MariaDB {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        return [
            f"""CREATE TABLE IF NOT EXISTS {self.q(table)} (
                namespace VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                `key` VARBINARY(512) NOT NULL,
                state TINYINT NOT NULL,
                token BIGINT NOT NULL,
                owner VARBINARY(255) NULL,
                fingerprint VARBINARY(255) NULL,
                result LONGBLOB NULL,
                lease_until DATETIME(6) NULL,
                created DATETIME(6) NOT NULL,
                updated DATETIME(6) NOT NULL,
                PRIMARY KEY (namespace, `key`),
                KEY {self.q(table + "_updated")} (updated),
                CONSTRAINT {self.q(table + "_state")} CHECK (state IN (1, 2, 3)),
                CONSTRAINT {self.q(table + "_token")} CHECK (token > 0)
            ) ENGINE=InnoDB ROW_FORMAT=DYNAMIC"""
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
        part_ph, part_col = ("%s, ", "part, ") if parts is not None else ("", "")
        row = (
            f"(%s, %s, {part_ph}{_PROCESSING}, 1, %s, %s, %s, {self.lease_until(lease)}, "
            "CURRENT_TIMESTAMP(6), CURRENT_TIMESTAMP(6))"
        )
        for i in range(0, len(keys), _CHUNK):
            params: list[Any] = []
            for j in range(i, min(i + _CHUNK, len(keys))):
                if parts is None:
                    params += (ns, keys[j], owner, fps[j], nonce)
                else:
                    params += (ns, keys[j], parts[j], owner, fps[j], nonce)
            cur.execute(
                f"INSERT INTO {self.q(table)} (namespace, `key`, {part_col}state, token, owner, "
                "fingerprint, result, lease_until, created, updated) VALUES "
                + ", ".join([row] * (min(i + _CHUNK, len(keys)) - i))
                + " ON DUPLICATE KEY UPDATE `key` = `key`",
                params,
            )
        return None  # the SELECT .. FOR UPDATE tells them by the nonce

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
        names = ["k", *(["p"] if parted else []), *(f"v{i}" for i in range(len(types)))]
        first = "SELECT " + ", ".join(f"%s AS {n}" for n in names)
        other = "SELECT " + ", ".join(["%s"] * len(names))
        set_sql = self.set_clause(sets, lambda i: f"u.v{i}")
        t = self.q(table)
        on_part = f" AND {t}.part = u.p" if parted else ""
        for i in range(0, len(rows), _CHUNK):
            chunk = rows[i : i + _CHUNK]
            derived = " UNION ALL ".join([first] + [other] * (len(chunk) - 1))
            cur.execute(
                f"UPDATE {t} JOIN ({derived}) AS u ON {t}.namespace = %s AND {t}.`key` = u.k"
                f"{on_part} SET {set_sql}",
                [*(v for r in chunk for v in r), ns],
            )

    where_repeats = 1

    def limited(self, verb: str, table: str, where: str, limit: int) -> str:
        return f"{verb} WHERE {where} LIMIT {int(limit)}"

    partitions = True

    def part_schema(self, table: str, first: int, span: int) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                `key` VARBINARY(512) NOT NULL,
                part BIGINT NOT NULL,
                state TINYINT NOT NULL,
                token BIGINT NOT NULL,
                owner VARBINARY(255) NULL,
                fingerprint VARBINARY(255) NULL,
                result LONGBLOB NULL,
                lease_until DATETIME(6) NULL,
                created DATETIME(6) NOT NULL,
                updated DATETIME(6) NOT NULL,
                PRIMARY KEY (namespace, `key`, part),
                CONSTRAINT {self.q(table + "_state")} CHECK (state IN (1, 2, 3)),
                CONSTRAINT {self.q(table + "_token")} CHECK (token > 0)
            ) ENGINE=InnoDB ROW_FORMAT=DYNAMIC PARTITION BY RANGE (part) (PARTITION
            {self.q(_part_name("p", first))} VALUES LESS THAN ({int(first + span)}))""",
            f"""CREATE TABLE IF NOT EXISTS {self.q(table + "_parts")} (
                id INT PRIMARY KEY, span BIGINT NOT NULL, horizon BIGINT NOT NULL
            ) ENGINE=InnoDB""",
            f"INSERT INTO {self.q(table + '_parts')} VALUES (1, {int(span)}, {int(first)}) "
            "ON DUPLICATE KEY UPDATE id = id",
            f"""CREATE TABLE IF NOT EXISTS {self.q(table + "_edge")} (
                namespace VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
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
        return sorted(_part_start("p", str(r[0])) for r in cur.fetchall())

    def is_partitioned(self, cur: Any, table: str) -> bool:
        cur.execute(
            "SELECT count(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = %s AND PARTITION_NAME IS NOT NULL",
            [table],
        )
        return bool(cur.fetchone()[0])

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        # RANGE partitions are added after the last one only; a concurrent store that
        # added them first makes this fail with 1517/1493, which the caller re-reads.
        if starts:
            cur.execute(
                f"ALTER TABLE {self.q(table)} ADD PARTITION ("
                + ", ".join(
                    f"PARTITION {self.q(_part_name('p', s))} VALUES LESS THAN ({int(s + span)})"
                    for s in starts
                )
                + ")"
            )

    def part_drop(self, cur: Any, table: str, start: int) -> None:
        try:
            cur.execute(
                f"ALTER TABLE {self.q(table)} DROP PARTITION {self.q(_part_name('p', start))}"
            )
        except Exception as exc:
            args: tuple[Any, ...] = exc.args
            if not (args and args[0] == 1507):  # ER_DROP_PARTITION_NON_EXISTENT: gone already
                raise

    def part_from(self, table: str, start: int) -> str:
        return f"{self.q(table)} PARTITION ({self.q(_part_name('p', start))})"

    def part_guard(self, cur: Any, table: str, exclusive: bool) -> int:
        mode = "FOR UPDATE" if exclusive else "LOCK IN SHARE MODE"
        cur.execute(f"SELECT horizon FROM {self.q(table + '_parts')} WHERE id = 1 {mode}")
        row = cur.fetchone()
        if row is None:
            raise SchemaError(f"the partition table {table}_parts has no row: run init_schema()")
        return int(row[0])

    def lock_edges(self, cur: Any, table: str, ns: str, edges: list[tuple[bytes, int]]) -> None:
        for i in range(0, len(edges), _CHUNK):
            chunk = edges[i : i + _CHUNK]
            cur.execute(
                f"INSERT INTO {self.q(table + '_edge')} (namespace, `key`, boundary) VALUES "
                + ", ".join(["(%s, %s, %s)"] * len(chunk))
                + " ON DUPLICATE KEY UPDATE boundary = boundary",
                [v for k, b in chunk for v in (ns, k, b)],
            )
