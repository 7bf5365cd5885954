"""PostgreSQL through psycopg 3: arrays sent in binary, advisory locks, declarative partitions."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

from dedupcore.sql.dialects.base import (
    PROCESSING,
    Catalog,
    Dialect,
    NewRows,
    Rows,
    RowUpdate,
    Run,
    horizon_of,
    part_name,
    part_start,
)

__all__ = ["PostgresDialect"]


class PostgresDialect(Dialect):
    """PostgreSQL (psycopg 3): ``postgresql://`` and ``postgres://`` URLs."""

    name = "postgresql"
    driver = "psycopg"
    schemes = ("postgresql", "postgres")
    max_key_bytes = 2048  # a btree index entry holds at most ~2.7 kB
    read_first = True
    autocommit_reads = True
    plain_insert = True
    partitions = True
    now = "now()"
    utc_now = "now()"
    namespace_type, bytes_type, small_int, big_int = (
        'text COLLATE "C"',
        "bytea",
        "smallint",
        "bigint",
    )
    time_type = "timestamptz"

    write_now = "clock_timestamp()"

    def shift(self, time: str, sign: str, seconds: float) -> str:
        return f"{time} {sign} make_interval(secs => {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return f"extract(epoch from {column})"

    # -- the driver -----------------------------------------------------------------------

    def connector(
        self, url: str, connect_args: dict[str, Any], timeout: float
    ) -> Callable[[], Any]:
        return functools.partial(_connect, url, {**_defaults(url, timeout), **connect_args})

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error,)

    def is_duplicate_key(self, exc: BaseException) -> bool:
        module = type(exc).__module__.split(".")[0]
        return module == self.driver and getattr(exc, "sqlstate", None) == "23505"

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
        # psycopg waits for a reply without a timeout of its own (see the watchdog).
        fd: int = conn.fileno()
        return fd

    # No arm(): libpq has no client-side wait limit; the watchdog is the deadline, and
    # statement_timeout (from_url) the server's own.

    def prepare(self, conn: Any) -> None:
        import psycopg

        conn.autocommit = False
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED

    def autocommit_of(self, raw: Any) -> str | None:
        return "psycopg connection autocommit=True" if raw.autocommit else None

    def catalog(self, run: Run, table: str) -> Catalog:
        _, rows = run(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [self.q(table)],
        )
        columns = tuple(str(r[0]) for r in rows)
        _, rows = run(
            "SELECT ci.relname, ARRAY(SELECT a.attname FROM unnest(i.indkey::int2[]) "
            "WITH ORDINALITY AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum WHERE k.n <= i.indnkeyatts ORDER BY k.n) "
            "FROM pg_index i JOIN pg_class ci ON ci.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indisvalid "
            "AND i.indpred IS NULL AND i.indexprs IS NULL",
            [self.q(table)],
        )
        return columns, tuple((str(name), tuple(cols)) for name, cols in rows)

    def consumed_schema(self, table: str, key_bytes: int) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                created timestamptz NOT NULL DEFAULT now(),
                result bytea,
                PRIMARY KEY (namespace, "key")
            )""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_created')} ON {t} (created)",
        ]

    # -- the dedup table ----------------------------------------------------------------

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

    def server_version(self, cur: Any) -> str:
        cur.execute("SHOW server_version")
        return f"PostgreSQL {cur.fetchone()[0]}"

    def insert(self, cur: Any, new: NewRows, plain: bool) -> set[bytes] | None:
        """One INSERT over ``unnest`` of arrays, any batch size.

        ``plain``: no ``ON CONFLICT`` (no speculative insertion: about 40 %
        less server time); otherwise the keys created are returned.
        """
        # The arrays go in binary (bytea in text needs escaping per element); a batch
        # without fingerprints sends no array of NULLs.
        parts = new.parts
        with_fps = any(f is not None for f in new.fingerprints)
        cols, arrays = ["k"], ["%b::bytea[]"]
        params: list[Any] = [new.namespace, new.owner, new.keys]
        if parts is not None:
            cols.append("p")
            arrays.append("%s::bigint[]")
            params.append(parts)
        if with_fps:
            cols.append("f")
            arrays.append("%b::bytea[]")
            params.append(new.fingerprints)
        target = ["namespace", "key", *(["part"] if parts is not None else [])]
        tail = "" if plain else f'{self.on_conflict_do_nothing(target)} RETURNING "key"'
        cur.execute(
            f'INSERT INTO {self.q(new.table)} (namespace, "key", '
            f"{'part, ' if parts is not None else ''}state, token, owner, fingerprint, "
            "lease_until, created, updated) "
            f"SELECT %s::text, u.k, {'u.p, ' if parts is not None else ''}{PROCESSING}, 1, "
            f"%s::bytea, {'u.f' if with_fps else 'NULL::bytea'}, {self.lease_until(new.lease)}, "
            f"now(), now() FROM unnest({', '.join(arrays)}) AS u({', '.join(cols)}) "
            f"ORDER BY u.k {tail}",
            params,
        )
        return set(new.keys) if plain else {bytes(r[0]) for r in cur.fetchall()}

    def _select_in(
        self, cur: Any, cols: str, table: str, ns: str, keys: list[bytes], tail: str = ""
    ) -> Rows:
        # The keys as one array (in binary), any batch size in one statement.
        cur.execute(
            f'SELECT "key", {cols} FROM {self.q(table)} '
            f'WHERE namespace = %s AND "key" = ANY(%b::bytea[]){tail}',
            [ns, keys],
        )
        rows: Rows = cur.fetchall()
        return rows

    def select_parted(
        self, cur: Any, cols: str, table: str, ns: str, keys: list[bytes], where: str, lock: bool
    ) -> Rows:
        # One index probe per key and partition (a lateral join on key = u.k): with
        # "key" = ANY(..) on the second index column, PostgreSQL (before 17) plans a
        # scan of the namespace's rows in each partition whose statistics are not
        # gathered yet (a new one). Keys in order, then partitions: one lock order.
        cur.execute(
            f'SELECT x.* FROM unnest(%b::bytea[]) AS u(k) CROSS JOIN LATERAL (SELECT "key", '
            f"{cols} FROM {self.q(table)} WHERE namespace = %s "
            # (OFFSET 0 keeps an unlocked subquery from being flattened into a join.)
            f'AND "key" = u.k{where}{" FOR UPDATE" if lock else " OFFSET 0"}) AS x',
            [sorted(keys), ns],
        )
        rows: Rows = cur.fetchall()
        return rows

    def update_rows(self, cur: Any, table: str, ns: str, update: RowUpdate) -> None:
        parted = update.parted
        lead = ["bytea", "bigint"] if parted else ["bytea"]
        cols = ["k", *(["p"] if parted else []), *(f"v{i}" for i in range(len(update.types)))]
        arrays = ", ".join(
            f"%{'b' if ty == 'bytea' else 's'}::{ty}[]" for ty in [*lead, *update.types]
        )
        set_sql = self.set_clause(update.sets, lambda i: f"u.v{i}")
        cur.execute(
            f"UPDATE {self.q(table)} AS d SET {set_sql} FROM unnest({arrays}) "
            f'AS u({", ".join(cols)}) WHERE d.namespace = %s AND d."key" = u.k'
            + (" AND d.part = u.p" if parted else ""),
            [*([r[j] for r in update.rows] for j in range(len(cols))), ns],
        )

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        cur.execute(
            f'DELETE FROM {self.q(table)} WHERE namespace = %s AND "key" = ANY(%b::bytea[]) '
            f"AND {where}",
            [ns, keys],
        )
        return int(cur.rowcount)

    # -- partitions by event time (docs/sql-partitions.md) ------------------------------

    def part_schema(self, table: str, first: int, span: int) -> list[str]:
        meta, edge = self.q(table + "_parts"), self.q(table + "_edge")
        return [
            self.dedup_table(table, part=True),
            f"""CREATE TABLE IF NOT EXISTS {meta} (
                id int PRIMARY KEY, span bigint NOT NULL, horizon bigint NOT NULL)""",
            f"INSERT INTO {meta} VALUES (1, {int(span)}, {int(first)}) "
            f"{self.on_conflict_do_nothing(['id'])}",
            f"""CREATE TABLE IF NOT EXISTS {edge} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                boundary bigint NOT NULL,
                PRIMARY KEY (namespace, "key", boundary))""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_edge_b')} ON {edge} (boundary)",
        ]

    def part_list(self, cur: Any, table: str) -> list[int]:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            [self.q(table)],
        )
        return sorted(part_start(table, str(r[0])) for r in cur.fetchall())

    def is_partitioned(self, cur: Any, table: str) -> bool:
        cur.execute(
            "SELECT count(*) FROM pg_partitioned_table WHERE partrelid = to_regclass(%s)",
            [self.q(table)],
        )
        return bool(cur.fetchone()[0])

    def part_create(self, cur: Any, table: str, starts: list[int], span: int) -> None:
        for start in starts:
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {self.q(part_name(table, start))} PARTITION OF "
                f"{self.q(table)} FOR VALUES FROM ({int(start)}) TO ({int(start + span)})"
            )

    def part_drop(self, cur: Any, table: str, start: int) -> None:
        cur.execute(f"DROP TABLE IF EXISTS {self.q(part_name(table, start))}")

    def part_from(self, table: str, start: int) -> str:
        return self.q(part_name(table, start))

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
        return horizon_of(cur.fetchone(), table)

    def lock_edges(self, cur: Any, table: str, ns: str, edges: list[tuple[bytes, int]]) -> None:
        cur.execute(
            f'INSERT INTO {self.q(table + "_edge")} (namespace, "key", boundary) '
            "SELECT %s::text, u.k, u.b FROM unnest(%b::bytea[], %s::bigint[]) AS u(k, b) "
            'ORDER BY u.k, u.b ON CONFLICT (namespace, "key", boundary) '
            "DO UPDATE SET boundary = EXCLUDED.boundary",
            [ns, [k for k, _ in edges], [b for _, b in edges]],
        )


def _connect(url: str, args: dict[str, Any]) -> Any:
    import psycopg

    return psycopg.connect(url, **args)


def _lock_id(table: str) -> int:
    """The advisory lock key of a table's partition horizon."""
    return int.from_bytes(
        hashlib.blake2b(table.encode(), digest_size=8).digest(), "big", signed=True
    )


def _defaults(url: str, timeout: float) -> dict[str, Any]:
    """Connect timeout, TCP keepalive and statement_timeout, where the URL sets none."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(url)
    except Exception as exc:  # psycopg.ProgrammingError: not a connection string
        raise ValueError(f"bad PostgreSQL URL: {exc}") from None
    out: dict[str, Any] = {
        "connect_timeout": max(2, round(timeout)),  # libpq waits whole seconds, 2 at least
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    out = {k: v for k, v in out.items() if k not in given}
    options = str(given.get("options") or "")
    if "statement_timeout" not in options:
        out["options"] = f"{options} -c statement_timeout={round(timeout * 1000)}".strip()
    return out
