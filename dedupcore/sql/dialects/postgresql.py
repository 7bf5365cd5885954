"""The postgresql dialect of the SQL authority."""

from __future__ import annotations

from typing import Any

from dedupcore.errors import SchemaError
from dedupcore.sql.dialects.base import (
    _PROCESSING,
    _Dialect,
    _lock_id,
    _part_name,
    _part_range,
    _part_start,
    _SetList,
)
from dedupcore.sql.dialects.base import on_conflict_do_nothing as _do_nothing


class _Postgres(_Dialect):
    name = "postgresql"
    max_key_bytes = 2048  # a btree index entry holds at most ~2.7 kB
    read_first = True
    autocommit_reads = True
    plain_insert = True

    @property
    def now(self) -> str:
        return "now()"

    def lease_until(self, lease: float) -> str:
        # The clock at the write, not the transaction's start (it may have waited for locks).
        return f"clock_timestamp() + make_interval(secs => {lease:.6f})"

    def ago(self, seconds: float) -> str:
        return f"now() - make_interval(secs => {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return f"extract(epoch from {column})"

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(exc, psycopg.errors.UndefinedTable)

    def is_transient(self, exc: BaseException) -> bool:
        # 40001 serialization failure, 40P01 deadlock: the transaction was rolled back.
        # (By SQLSTATE: psycopg's DeadlockDetected is no TransactionRollback subclass.)
        return getattr(exc, "sqlstate", None) in ("40001", "40P01")

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        return bool(getattr(conn, "broken", False) or getattr(conn, "closed", False))

    def is_refused(self, exc: BaseException) -> bool:
        import psycopg

        # SQLSTATE 22 (data exception: out of range, too long) and 23 (integrity).
        return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError))

    def socket_of(self, conn: Any) -> int | None:
        # psycopg waits for a reply without a timeout of its own (see _Watchdog).
        fd: int = conn.fileno()
        return fd

    # No arm(): libpq has no client-side wait limit; the watchdog is the deadline, and
    # statement_timeout (from_url) the server's own.

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit')")
        fsync, commit = cur.fetchone()
        if fsync != "on":
            return (
                0,
                "fsync off: an OS crash or a power loss can lose or corrupt committed claims",
            )
        if commit == "off":
            return (
                1,
                "synchronous_commit off: a server crash can lose the last committed claims "
                "(up to three wal_writer_delay periods)",
            )
        return 3, f"fsync on, synchronous_commit {commit}: survives a crash and a power loss"

    def prepare(self, conn: Any) -> None:
        import psycopg

        conn.autocommit = False
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED

    def server_version(self, cur: Any) -> str:
        cur.execute("SHOW server_version")
        return f"PostgreSQL {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                state smallint NOT NULL CHECK (state IN (1, 2, 3)),
                token bigint NOT NULL CHECK (token > 0),
                owner bytea,
                fingerprint bytea,
                result bytea,
                lease_until timestamptz,
                created timestamptz NOT NULL,
                updated timestamptz NOT NULL,
                PRIMARY KEY (namespace, "key")
            )""",
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
        target = ["namespace", "key", *(["part"] if parts is not None else [])]
        self._insert(
            cur,
            table,
            ns,
            keys,
            fps,
            owner,
            lease,
            f'{_do_nothing(self.name, target)} RETURNING "key"',
            parts,
        )
        return {bytes(r[0]) for r in cur.fetchall()}

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
        # No speculative insertion: about 40 % less server time than ON CONFLICT.
        self._insert(cur, table, ns, keys, fps, owner, lease, "", parts)

    def _insert(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        tail: str,
        parts: list[int] | None = None,
    ) -> None:
        # The arrays go in binary (bytea in text needs escaping per element); a batch
        # without fingerprints sends no array of NULLs.
        with_fps = any(f is not None for f in fps)
        cols, arrays = ["k"], ["%b::bytea[]"]
        params: list[Any] = [ns, owner, keys]
        if parts is not None:
            cols.append("p")
            arrays.append("%s::bigint[]")
            params.append(parts)
        if with_fps:
            cols.append("f")
            arrays.append("%b::bytea[]")
            params.append(fps)
        cur.execute(
            f'INSERT INTO {self.q(table)} (namespace, "key", '
            f"{'part, ' if parts is not None else ''}state, token, owner, fingerprint, "
            "lease_until, created, updated) "
            f"SELECT %s::text, u.k, {'u.p, ' if parts is not None else ''}{_PROCESSING}, 1, "
            f"%s::bytea, {'u.f' if with_fps else 'NULL::bytea'}, {self.lease_until(lease)}, "
            f"now(), now() FROM unnest({', '.join(arrays)}) AS u({', '.join(cols)}) "
            f"ORDER BY u.k {tail}",
            params,
        )

    def read_rows(self, cur: Any, table: str, ns: str, keys: list[bytes]) -> list[tuple[Any, ...]]:
        cur.execute(
            f'SELECT "key", state, token, owner, fingerprint, result FROM {self.q(table)} '
            'WHERE namespace = %s AND "key" = ANY(%b::bytea[])',
            [ns, keys],
        )
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows

    def select_rows(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        parts: tuple[int, int | None] | None = None,
        lock: bool = True,
    ) -> list[tuple[Any, ...]]:
        cols = "state, token, owner, fingerprint, result, lease_until > now()"
        if parts is None:
            cur.execute(
                f'SELECT "key", {cols} FROM {self.q(table)} WHERE namespace = %s '
                'AND "key" = ANY(%b::bytea[]) ORDER BY "key" FOR UPDATE',
                [ns, keys],
            )
        else:
            # One index probe per key and partition (a lateral join on key = u.k): with
            # "key" = ANY(..) on the second index column, PostgreSQL (before 17) plans a
            # scan of the namespace's rows in each partition whose statistics are not
            # gathered yet (a new one). Keys in order, then partitions: one lock order.
            _, where, _ = _part_range(parts, '"key"')
            cur.execute(
                f'SELECT x.* FROM unnest(%b::bytea[]) AS u(k) CROSS JOIN LATERAL (SELECT "key", '
                f"part, {cols} FROM {self.q(table)} WHERE namespace = %s "
                # (OFFSET 0 keeps an unlocked subquery from being flattened into a join.)
                f'AND "key" = u.k{where}{" FOR UPDATE" if lock else " OFFSET 0"}) AS x',
                [sorted(keys), ns],
            )
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows

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
        lead = ["bytea", "bigint"] if parted else ["bytea"]
        cols = ["k", *(["p"] if parted else []), *(f"v{i}" for i in range(len(types)))]
        arrays = ", ".join(f"%{'b' if ty == 'bytea' else 's'}::{ty}[]" for ty in [*lead, *types])
        set_sql = self.set_clause(sets, lambda i: f"u.v{i}")
        cur.execute(
            f"UPDATE {self.q(table)} AS d SET {set_sql} FROM unnest({arrays}) "
            f'AS u({", ".join(cols)}) WHERE d.namespace = %s AND d."key" = u.k'
            + (" AND d.part = u.p" if parted else ""),
            [*([r[j] for r in rows] for j in range(len(cols))), ns],
        )

    partitions = True

    def part_schema(self, table: str, first: int, span: int) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                part bigint NOT NULL,
                state smallint NOT NULL CHECK (state IN (1, 2, 3)),
                token bigint NOT NULL CHECK (token > 0),
                owner bytea,
                fingerprint bytea,
                result bytea,
                lease_until timestamptz,
                created timestamptz NOT NULL,
                updated timestamptz NOT NULL,
                PRIMARY KEY (namespace, "key", part)
            ) PARTITION BY RANGE (part)""",
            f"""CREATE TABLE IF NOT EXISTS {self.q(table + "_parts")} (
                id int PRIMARY KEY, span bigint NOT NULL, horizon bigint NOT NULL)""",
            f"INSERT INTO {self.q(table + '_parts')} VALUES (1, {int(span)}, {int(first)}) "
            f"{_do_nothing(self.name, ['id'])}",
            f"""CREATE TABLE IF NOT EXISTS {self.q(table + "_edge")} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                boundary bigint NOT NULL,
                PRIMARY KEY (namespace, "key", boundary))""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_edge_b')} "
            f"ON {self.q(table + '_edge')} (boundary)",
        ]

    def part_list(self, cur: Any, table: str) -> list[int]:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            [self.q(table)],
        )
        return sorted(_part_start(table, str(r[0])) for r in cur.fetchall())

    def is_partitioned(self, cur: Any, table: str) -> bool:
        cur.execute(
            "SELECT count(*) FROM pg_partitioned_table WHERE partrelid = to_regclass(%s)",
            [self.q(table)],
        )
        return bool(cur.fetchone()[0])

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        for start in starts:
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {self.q(_part_name(table, start))} PARTITION OF "
                f"{self.q(table)} FOR VALUES FROM ({int(start)}) TO ({int(start + span)})"
            )

    def part_drop(self, cur: Any, table: str, start: int) -> None:
        cur.execute(f"DROP TABLE IF EXISTS {self.q(_part_name(table, start))}")

    def part_from(self, table: str, start: int) -> str:
        return self.q(_part_name(table, start))

    def part_guard(self, cur: Any, table: str, exclusive: bool) -> int:
        # An advisory lock lives in memory only (a row lock FOR SHARE would write the
        # row); the horizon is read by a statement of its own, after the lock.
        # One round trip: without parameters the two statements go as one simple query,
        # and each statement of it takes its own snapshot (READ COMMITTED).
        fn = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        cur.execute(
            f"SELECT {fn}({_lock_id(table)}); "
            f"SELECT horizon FROM {self.q(table + '_parts')} WHERE id = 1"
        )
        cur.nextset()
        row = cur.fetchone()
        if row is None:
            raise SchemaError(f"the partition table {table}_parts has no row: run init_schema()")
        return int(row[0])

    def lock_edges(self, cur: Any, table: str, ns: str, edges: list[tuple[bytes, int]]) -> None:
        cur.execute(
            f'INSERT INTO {self.q(table + "_edge")} (namespace, "key", boundary) '
            "SELECT %s::text, u.k, u.b FROM unnest(%b::bytea[], %s::bigint[]) AS u(k, b) "
            'ORDER BY u.k, u.b ON CONFLICT (namespace, "key", boundary) '
            "DO UPDATE SET boundary = EXCLUDED.boundary",
            [ns, [k for k, _ in edges], [b for _, b in edges]],
        )

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        cur.execute(
            f'DELETE FROM {self.q(table)} WHERE namespace = %s AND "key" = ANY(%b::bytea[]) '
            f"AND {where}",
            [ns, keys],
        )
        return int(cur.rowcount)
