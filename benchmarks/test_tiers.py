"""Shared tiers against what users would pick instead (benchmarks/README.md).

On the machine's real servers, same 16-byte keys, same batches of 1000, same run:

- **Redis authority**: ``RedisStore.claim_many`` against redis-py pipelined
  ``SET key 1 NX PX <ms>`` (``pipeline(transaction=False)``, one ``execute``
  per batch; ``<ms>`` is the TTL RedisStore gives its records), on fresh keys
  and on the same keys again (all DUPLICATE: setup claims and completes every
  key). Single-key ``claim`` against one ``SET NX PX`` round trip, for
  reference (p50/p99).
- **PostgreSQL authority**: ``SqlStore.claim_many`` against
  ``cursor.executemany("INSERT INTO t (ns, k) VALUES (%s, %s) ON CONFLICT DO
  NOTHING", rows)`` and a ``commit`` per batch, on fresh keys and on all
  duplicates (setup claims and completes every key, then ``ANALYZE``).
- **MariaDB** (``INSERT .. ON DUPLICATE KEY UPDATE k = k``) and **SQLite**
  (``INSERT .. ON CONFLICT DO NOTHING``, WAL) the same way, for reference.

Every timed round of a fresh-key benchmark starts from an empty Redis db /
truncated table / new SQLite file, made in the untimed setup; duplicate
rounds repeat on the same filled state (a DUPLICATE answer writes nothing).
The first ``WARMUP`` round(s) are not recorded. Redis uses db
``DEDUPCORE_BENCH_TIER_REDIS_DB`` (11), which is FLUSHDB'd before and after
(the suite skips Redis if it holds keys it did not write); SQL tables are
``dcbench_<random>_*`` and are dropped afterwards.

Sizes and servers come from the environment (see benchmarks/README.md)::

    DEDUPCORE_BENCH_TIER_QUICK     1: N=20_000, 2_000 single calls (a smoke run)
    DEDUPCORE_BENCH_TIER_N         keys of every claim_many benchmark (200_000)
    DEDUPCORE_BENCH_TIER_BATCH     keys per batch (1000)
    DEDUPCORE_BENCH_TIER_ROUNDS    recorded rounds (3) after DEDUPCORE_BENCH_TIER_WARMUP (1)
    DEDUPCORE_BENCH_TIER_SINGLE    timed single calls (5_000, after 200 warm-up calls)
    DEDUPCORE_BENCH_TIER_ENGINES   comma list of redis,postgresql,mariadb,sqlite (all)

``DEDUPCORE_BENCH_TIER_ALT_REDIS`` / ``DEDUPCORE_BENCH_TIER_ALT_SQL`` name a
``module:Class`` with RedisStore's / SqlStore's constructor that is measured
too, as ``dedupcore-alt-*`` (to try a change to a tier side by side with the
current code on the same keys in the same run).

Each benchmark stores ``library``, ``operation``, ``n_keys``, ``call``,
``ns_per_key`` (median round; ``_min`` too), ``keys_per_s`` and, for Redis, the
server's own time for the calls (``INFO commandstats`` usec of EVALSHA / SET,
``server_ns_per_key``) in ``extra_info``; ``python -m benchmarks.report_tiers``
prints ratios and verdicts. Only outcomes are asserted, never timings.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.conftest import _env_int, random_keys, record_info
from benchmarks.test_store import PROVENANCE, _percentiles, _redis_info
from dedupcore.api import Outcome

NS = "bench/tiers"
PEER_PREFIX = b"dcbench:"  # the SET NX peer's keys (RedisStore's start with "dcbench:{")
QUICK = os.environ.get("DEDUPCORE_BENCH_TIER_QUICK", "") not in ("", "0")


@dataclass(frozen=True)
class TierBenchConfig:
    n: int
    batch: int
    rounds: int
    warmup: int
    single: int
    seed: int
    engines: tuple[str, ...]
    redis_url: str
    redis_db: int
    pg_url: str
    mariadb_url: str
    sqlite_dir: str
    quick: bool


TCFG = TierBenchConfig(
    n=_env_int("DEDUPCORE_BENCH_TIER_N", 20_000 if QUICK else 200_000),
    batch=_env_int("DEDUPCORE_BENCH_TIER_BATCH", 1000),
    rounds=_env_int("DEDUPCORE_BENCH_TIER_ROUNDS", 3),
    warmup=int(os.environ.get("DEDUPCORE_BENCH_TIER_WARMUP", "1")),
    single=_env_int("DEDUPCORE_BENCH_TIER_SINGLE", 2_000 if QUICK else 5_000),
    seed=_env_int("DEDUPCORE_BENCH_SEED", 20240601),
    engines=tuple(
        e.strip()
        for e in os.environ.get("DEDUPCORE_BENCH_TIER_ENGINES", "redis,postgresql,mariadb,sqlite")
        .lower()
        .split(",")
        if e.strip()
    ),
    redis_url=os.environ.get("DEDUPCORE_BENCH_TIER_REDIS_URL", "redis://127.0.0.1:6379"),
    redis_db=int(os.environ.get("DEDUPCORE_BENCH_TIER_REDIS_DB", "11")),
    pg_url=os.environ.get(
        "DEDUPCORE_BENCH_TIER_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"
    ),
    mariadb_url=os.environ.get(
        "DEDUPCORE_BENCH_TIER_MARIADB_URL", "mysql://root@127.0.0.1:3306/test"
    ),
    sqlite_dir=os.environ.get("DEDUPCORE_BENCH_TIER_SQLITE_DIR", "") or tempfile.gettempdir(),
    quick=QUICK,
)
SINGLE_WARMUP = 200
ALT_REDIS = os.environ.get("DEDUPCORE_BENCH_TIER_ALT_REDIS", "")
ALT_SQL = os.environ.get("DEDUPCORE_BENCH_TIER_ALT_SQL", "")


def _needs(engine: str) -> None:
    if engine not in TCFG.engines:
        pytest.skip(f"{engine} not in DEDUPCORE_BENCH_TIER_ENGINES")


def _import(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _record(
    benchmark: Any, *, library: str, operation: str, n_keys: int, call: str, **extra: Any
) -> None:
    info = record_info(
        benchmark,
        library=library,
        operation=operation,
        n_keys=n_keys,
        call=call,
        tier_bench=asdict(TCFG),
        **PROVENANCE,
        **extra,
    )
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None and n_keys:
        info["ns_per_key"] = stats.median / n_keys * 1e9
        info["ns_per_key_min"] = stats.min / n_keys * 1e9
        info["keys_per_s"] = n_keys / stats.median
        info["round_seconds"] = list(stats.data)


def _batches(keys: list[Any], batch: int) -> list[list[Any]]:
    return [keys[i : i + batch] for i in range(0, len(keys), batch)]


# ------------------------------------------------------------------ keys --


@pytest.fixture(scope="session")
def tcfg() -> TierBenchConfig:
    return TCFG


@pytest.fixture(scope="session")
def tier_keys(tcfg: TierBenchConfig) -> list[bytes]:
    """N fresh 16-byte keys, shared by every claim_many benchmark of the run."""
    return random_keys(tcfg.n, tcfg.seed + 20)


@pytest.fixture(scope="session")
def tier_single_keys(tcfg: TierBenchConfig) -> list[bytes]:
    return random_keys(SINGLE_WARMUP + tcfg.single, tcfg.seed + 21)


# ---------------------------------------------------------------- redis --


@pytest.fixture(scope="session")
def tier_redis(tcfg: TierBenchConfig) -> Iterator[Any]:
    _needs("redis")
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(tcfg.redis_url, db=tcfg.redis_db)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {tcfg.redis_url}: {exc}")
    for key in client.scan_iter(count=1000):
        if not key.startswith(PEER_PREFIX):
            pytest.skip(
                f"Redis db {tcfg.redis_db} holds keys this suite did not write (e.g. {key!r}); "
                "set DEDUPCORE_BENCH_TIER_REDIS_DB to an unused db"
            )
        break
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _redis_store(client: Any, alt: bool = False) -> Any:
    from dedupcore.tiers.redis import RedisStore

    cls = _import(ALT_REDIS) if alt else RedisStore
    return cls(client, prefix="dcbench")


def _px_ms(store: Any) -> int:
    """The TTL (ms) RedisStore gives a fresh claim: the peer's SET gets the same."""
    return int(store._window_ms(NS, store.lease))


class CommandStats:
    """Server-side usec of one command (INFO commandstats), as a delta over a span."""

    def __init__(self, client: Any, command: str) -> None:
        self.client, self.command = client, command
        self.start = self._read()

    def _read(self) -> tuple[int, int]:
        stat = self.client.info("commandstats").get(f"cmdstat_{self.command}", {})
        return int(stat.get("calls", 0)), int(stat.get("usec", 0))

    def delta(self) -> tuple[int, int]:
        calls, usec = self._read()
        return calls - self.start[0], usec - self.start[1]


def dc_redis_batches(store: Any, batches: list[list[bytes]]) -> int:
    """``store.claim_many`` per batch; returns how many claims were NEW."""
    claim_many, new, fresh = store.claim_many, 0, Outcome.NEW
    for chunk in batches:
        new += sum(c.outcome is fresh for c in claim_many(chunk, namespace=NS))
    return new


def peer_redis_batches(client: Any, batches: list[list[bytes]], px: int) -> int:
    """Pipelined ``SET k 1 NX PX px`` per batch; returns how many SETs were applied."""
    new = 0
    for chunk in batches:
        pipe = client.pipeline(transaction=False)
        set_ = pipe.set
        for k in chunk:
            set_(k, 1, nx=True, px=px)
        new += pipe.execute().count(True)
    return new


REDIS_CALLS = {
    "dedupcore-redis": "store.claim_many(keys[i:i+B], namespace=ns)  (RedisStore, EVALSHA "
    "per hash-tag bucket)",
    "dedupcore-alt-redis": f"{ALT_REDIS}.claim_many(...)",
    "redis-pipelined": "pipe=r.pipeline(transaction=False); pipe.set(k,1,nx=True,px=TTL)×B; "
    "pipe.execute()",
    "dedupcore-redis-single": "store.claim(k, namespace=ns)",
    "redis-single": "r.set(k, 1, nx=True, px=TTL)  (one round trip)",
}
REDIS_LIBS = ["dedupcore-redis", "redis-pipelined"] + (["dedupcore-alt-redis"] if ALT_REDIS else [])


def _run_redis(
    benchmark: Any,
    client: Any,
    keys: list[bytes],
    name: str,
    operation: str,
    duplicate: bool,
) -> None:
    tcfg = TCFG
    n = len(keys)
    dc = name.startswith("dedupcore")
    store = _redis_store(client, alt="-alt-" in name) if dc else None
    px = _px_ms(store or _redis_store(client))
    batches = _batches(keys if dc else [PEER_PREFIX + k for k in keys], tcfg.batch)
    client.flushdb()
    if duplicate:  # every key claimed and completed once, untimed; rounds repeat on it
        if dc:
            for chunk in batches:
                claims = store.claim_many(chunk, namespace=NS)
                store.complete_many(
                    [(k, c.token) for k, c in zip(chunk, claims, strict=True)], namespace=NS
                )
        else:
            assert peer_redis_batches(client, batches, 3_600_000) == n

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not duplicate:
            client.flushdb()
        return ((store, batches) if dc else (client, batches, px)), {}

    stats = CommandStats(client, "evalsha" if dc else "set")
    new = benchmark.pedantic(
        dc_redis_batches if dc else peer_redis_batches,
        setup=setup,
        rounds=tcfg.rounds,
        warmup_rounds=tcfg.warmup,
        iterations=1,
    )
    calls, usec = stats.delta()
    assert new == (0 if duplicate else n), f"{new} of {n} keys NEW"
    runs = tcfg.rounds + tcfg.warmup
    extra = {
        **_redis_info(client),
        "px_ms": px,
        "server_calls": calls,
        "server_ns_per_key": usec * 1000 / (runs * n),
        "server_calls_expected": runs * len(batches) if not dc else None,
    }
    if dc:
        extra["buckets"] = store.buckets
    client.flushdb()
    _record(
        benchmark,
        library=name,
        operation=operation,
        n_keys=n,
        call=REDIS_CALLS[name],
        batch=tcfg.batch,
        **extra,
    )


@pytest.mark.parametrize("name", REDIS_LIBS)
def test_redis_fresh(
    benchmark: Any, request: pytest.FixtureRequest, tier_keys: list[bytes], name: str
) -> None:
    """N fresh keys in batches of B into an empty db: every claim NEW / every SET applied."""
    benchmark.group = "tier_redis_fresh"
    client = request.getfixturevalue("tier_redis")
    _run_redis(benchmark, client, tier_keys, name, "tier_redis_fresh", duplicate=False)


@pytest.mark.parametrize("name", REDIS_LIBS)
def test_redis_duplicate(
    benchmark: Any, request: pytest.FixtureRequest, tier_keys: list[bytes], name: str
) -> None:
    """The same N keys again, all claimed and completed (DUPLICATE) / all SET already."""
    benchmark.group = "tier_redis_duplicate"
    client = request.getfixturevalue("tier_redis")
    _run_redis(benchmark, client, tier_keys, name, "tier_redis_duplicate", duplicate=True)


@pytest.mark.parametrize("name", ["dedupcore-redis-single", "redis-single"])
def test_redis_single(
    benchmark: Any, request: pytest.FixtureRequest, tier_single_keys: list[bytes], name: str
) -> None:
    """SINGLE one-key calls on fresh keys, each timed with perf_counter_ns (one round)."""
    benchmark.group = "tier_redis_single"
    client = request.getfixturevalue("tier_redis")
    warm, keys = tier_single_keys[:SINGLE_WARMUP], tier_single_keys[SINGLE_WARMUP:]
    store = _redis_store(client)
    px = _px_ms(store)
    if name == "redis-single":
        warm = [PEER_PREFIX + k for k in warm]
        keys = [PEER_PREFIX + k for k in keys]

        def call(k: bytes) -> Any:
            return client.set(k, 1, nx=True, px=px)
    else:

        def call(k: bytes) -> Any:
            return store.claim(k, namespace=NS)

    lat: list[int] = []

    def timed() -> None:
        clock, append = time.perf_counter_ns, lat.append
        lat.clear()
        for k in keys:
            t0 = clock()
            call(k)
            append(clock() - t0)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        client.flushdb()
        for k in warm:
            call(k)
        return (), {}

    benchmark.pedantic(timed, setup=setup, rounds=1, iterations=1)
    client.flushdb()
    _record(
        benchmark,
        library=name,
        operation="tier_redis_single",
        n_keys=len(keys),
        call=REDIS_CALLS[name],
        warmup=len(warm),
        **_redis_info(client),
        **_percentiles(lat),
    )


# ------------------------------------------------------------------ SQL --


@dataclass
class SqlEngine:
    """One SQL server: dedupcore's table and the peer's table, raw connections, cleanup."""

    name: str  # postgresql | mariadb | sqlite
    url: str
    tag: str
    sqlite_path: Path | None = None

    @property
    def dc_table(self) -> str:
        return f"dcbench_{self.tag}_dedup"

    @property
    def peer_table(self) -> str:
        return f"dcbench_{self.tag}_peer"

    def connect(self) -> Any:
        if self.name == "postgresql":
            import psycopg

            return psycopg.connect(self.url)
        if self.name == "mariadb":
            from dedupcore.tiers.sql import _factory

            return _factory(self.url, {})[1]()
        assert self.sqlite_path is not None
        conn = sqlite3.connect(self.sqlite_path, isolation_level=None, check_same_thread=False)
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        return conn

    def admin(self, *statements: str) -> None:
        conn = self.connect()
        try:
            cur = conn.cursor()
            for s in statements:
                cur.execute(s)
            cur.close()
            if self.name != "sqlite":
                conn.commit()
        finally:
            conn.close()

    def peer_schema(self) -> str:
        t = self.peer_table
        if self.name == "postgresql":
            return (
                f'CREATE TABLE {t} (ns text COLLATE "C" NOT NULL, k bytea NOT NULL, '
                "PRIMARY KEY (ns, k))"
            )
        if self.name == "mariadb":
            return (
                f"CREATE TABLE {t} (ns VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT "
                "NULL, k VARBINARY(512) NOT NULL, PRIMARY KEY (ns, k)) ENGINE=InnoDB"
            )
        return (
            f"CREATE TABLE {t} (ns TEXT NOT NULL, k BLOB NOT NULL, PRIMARY KEY (ns, k)) "
            "WITHOUT ROWID"
        )

    def peer_insert(self) -> str:
        t = self.peer_table
        if self.name == "postgresql":
            return f"INSERT INTO {t} (ns, k) VALUES (%s, %s) ON CONFLICT DO NOTHING"
        if self.name == "mariadb":
            return f"INSERT INTO {t} (ns, k) VALUES (%s, %s) ON DUPLICATE KEY UPDATE k = k"
        return f"INSERT INTO {t} (ns, k) VALUES (?, ?) ON CONFLICT DO NOTHING"

    def empty(self, table: str) -> None:
        if self.name == "sqlite":
            self.admin(f"DELETE FROM {table}")
        else:
            self.admin(f"TRUNCATE TABLE {table}")

    def analyze(self, table: str) -> None:
        self.admin(f"ANALYZE {'TABLE ' if self.name == 'mariadb' else ''}{table}")

    def drop(self) -> None:
        if self.name == "sqlite":
            assert self.sqlite_path is not None
            for suffix in ("", "-wal", "-shm"):
                Path(str(self.sqlite_path) + suffix).unlink(missing_ok=True)
            return
        for attempt in range(30):  # a shared server may be out of connections for a while
            try:
                self._drop_tables()
                return
            except Exception:
                if attempt == 29:
                    raise
                time.sleep(2.0)

    def _drop_tables(self) -> None:
        self.admin(
            f"DROP TABLE IF EXISTS {self.dc_table}", f"DROP TABLE IF EXISTS {self.peer_table}"
        )

    def version(self) -> str:
        conn = self.connect()
        try:
            cur = conn.cursor()
            cur.execute("SELECT sqlite_version()" if self.name == "sqlite" else "SELECT version()")
            return f"{self.name} {cur.fetchone()[0]}"
        finally:
            conn.close()

    def settings(self) -> dict[str, Any]:
        """What makes a commit durable or not on this server."""
        conn = self.connect()
        try:
            cur = conn.cursor()
            if self.name == "postgresql":
                cur.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN "
                    "('synchronous_commit', 'fsync', 'wal_sync_method', 'shared_buffers')"
                )
            elif self.name == "mariadb":
                cur.execute(
                    "SHOW VARIABLES WHERE Variable_name IN "
                    "('innodb_flush_log_at_trx_commit', 'sync_binlog', 'log_bin', "
                    "'innodb_buffer_pool_size')"
                )
            else:
                cur.execute("PRAGMA synchronous")
                return {"synchronous": cur.fetchone()[0], "journal_mode": "wal"}
            return {str(k): str(v) for k, v in cur.fetchall()}
        finally:
            conn.close()


def _sql_engine(name: str, tcfg: TierBenchConfig) -> Iterator[SqlEngine]:
    _needs(name)
    tag = uuid.uuid4().hex[:10]
    if name == "sqlite":
        path = Path(tcfg.sqlite_dir) / f"dcbench-{tag}.db"
        eng = SqlEngine(name, f"sqlite:///{path}", tag, sqlite_path=path)
    else:
        if name == "postgresql":
            pytest.importorskip("psycopg")
        else:
            pytest.importorskip("pymysql")
        eng = SqlEngine(name, tcfg.pg_url if name == "postgresql" else tcfg.mariadb_url, tag)
        try:
            eng.version()
        except Exception as exc:  # any driver error: the server is not there
            pytest.skip(f"no {name} at {eng.url}: {exc}")
    try:
        yield eng
    finally:
        eng.drop()


@pytest.fixture(scope="module")
def pg_engine(tcfg: TierBenchConfig) -> Iterator[SqlEngine]:
    yield from _sql_engine("postgresql", tcfg)


@pytest.fixture(scope="module")
def mariadb_engine(tcfg: TierBenchConfig) -> Iterator[SqlEngine]:
    yield from _sql_engine("mariadb", tcfg)


@pytest.fixture(scope="module")
def sqlite_engine(tcfg: TierBenchConfig) -> Iterator[SqlEngine]:
    yield from _sql_engine("sqlite", tcfg)


def _sql_store(eng: SqlEngine, alt: bool = False) -> Any:
    from dedupcore.tiers.sql import SqlStore

    cls = _import(ALT_SQL) if alt else SqlStore
    store = cls.from_url(eng.url, table=eng.dc_table)
    store.init_schema()
    return store


def dc_sql_batches(store: Any, batches: list[list[bytes]]) -> None:
    """``store.claim_many`` per batch (one transaction each); outcomes are counted in stats()."""
    claim_many = store.claim_many
    for chunk in batches:
        claim_many(chunk, namespace=NS)


def peer_sql_batches(conn: Any, sql: str, batches: list[list[tuple[str, bytes]]]) -> None:
    """``executemany(INSERT .. ON CONFLICT DO NOTHING)`` and a commit per batch."""
    cur = conn.cursor()
    executemany, commit = cur.executemany, conn.commit
    for rows in batches:
        executemany(sql, rows)
        commit()
    cur.close()


def peer_sqlite_batches(conn: Any, sql: str, batches: list[list[tuple[str, bytes]]]) -> None:
    """The same for sqlite3 in autocommit mode: BEGIN, executemany, COMMIT per batch."""
    execute, executemany = conn.execute, conn.executemany
    for rows in batches:
        execute("BEGIN")
        executemany(sql, rows)
        execute("COMMIT")


def _count_rows(eng: SqlEngine, table: str) -> int:
    conn = eng.connect()
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT COUNT(*) FROM {table}")
        return int(cur.fetchone()[0])
    finally:
        conn.close()


def _sql_calls(eng: SqlEngine) -> dict[str, str]:
    return {
        f"dedupcore-{eng.name}": "store.claim_many(keys[i:i+B], namespace=ns)  (SqlStore, one "
        "transaction per batch)",
        f"dedupcore-alt-{eng.name}": f"{ALT_SQL}.claim_many(...)",
        f"{eng.name}-executemany": f"cur.executemany({eng.peer_insert()!r}, rows[i:i+B]); "
        + ("COMMIT" if eng.name == "sqlite" else "conn.commit()"),
    }


def _run_sql(benchmark: Any, eng: SqlEngine, keys: list[bytes], lib: str, duplicate: bool) -> None:
    tcfg = TCFG
    n = len(keys)
    op = f"tier_{eng.name}_{'duplicate' if duplicate else 'fresh'}"
    benchmark.group = op
    dc = lib.startswith("dedupcore")
    extra: dict[str, Any] = {"server": eng.version(), "server_settings": eng.settings()}
    opened: list[Any] = []

    def close_all() -> None:
        while opened:
            opened.pop().close()

    try:
        if dc:
            if eng.name == "sqlite":
                eng.drop()
            store = _sql_store(eng, alt="-alt-" in lib)
            opened.append(store)
            eng.empty(eng.dc_table)
            batches = _batches(keys, tcfg.batch)
            if duplicate:
                for chunk in batches:
                    claims = store.claim_many(chunk, namespace=NS)
                    store.complete_many(
                        [(k, c.token) for k, c in zip(chunk, claims, strict=True)], namespace=NS
                    )
                eng.analyze(eng.dc_table)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                if not duplicate:
                    eng.empty(eng.dc_table)
                return (store, batches), {}

            before = store.stats()
            benchmark.pedantic(
                dc_sql_batches,
                setup=setup,
                rounds=tcfg.rounds,
                warmup_rounds=tcfg.warmup,
                iterations=1,
            )
            after = store.stats()
            runs = tcfg.rounds + tcfg.warmup
            want = "duplicate" if duplicate else "new"
            got = after.get(want, 0) - before.get(want, 0)
            assert got == runs * n, f"{got} {want} claims, expected {runs * n}"
            extra["outcomes"] = {
                k: after.get(k, 0) - before.get(k, 0)
                for k in ("new", "duplicate", "in_progress", "retries")
            }
        else:
            if eng.name == "sqlite":
                eng.drop()
            conn = eng.connect()
            opened.append(conn)
            conn.cursor().execute(eng.peer_schema())
            if eng.name != "sqlite":
                conn.commit()
            sql = eng.peer_insert()
            batches = _batches([(NS, k) for k in keys], tcfg.batch)
            run: Callable[..., None] = (
                peer_sqlite_batches if eng.name == "sqlite" else peer_sql_batches
            )
            if duplicate:
                run(conn, sql, batches)
                eng.analyze(eng.peer_table)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                if not duplicate:
                    eng.empty(eng.peer_table)
                return (conn, sql, batches), {}

            benchmark.pedantic(
                run, setup=setup, rounds=tcfg.rounds, warmup_rounds=tcfg.warmup, iterations=1
            )
            assert _count_rows(eng, eng.peer_table) == n
            eng.admin(f"DROP TABLE {eng.peer_table}")
    finally:
        close_all()
    _record(
        benchmark,
        library=lib,
        operation=op,
        n_keys=n,
        call=_sql_calls(eng)[lib],
        batch=tcfg.batch,
        **extra,
    )


def _sql_libs(engine: str) -> list[str]:
    return [f"dedupcore-{engine}", f"{engine}-executemany"] + (
        [f"dedupcore-alt-{engine}"] if ALT_SQL else []
    )


@pytest.mark.parametrize("lib", _sql_libs("postgresql"))
@pytest.mark.parametrize("duplicate", [False, True], ids=["fresh", "duplicate"])
def test_postgresql(
    benchmark: Any, pg_engine: SqlEngine, tier_keys: list[bytes], lib: str, duplicate: bool
) -> None:
    """PostgreSQL authority: fresh keys (empty table per round), then all duplicates."""
    _run_sql(benchmark, pg_engine, tier_keys, lib, duplicate)


@pytest.mark.parametrize("lib", _sql_libs("mariadb"))
@pytest.mark.parametrize("duplicate", [False, True], ids=["fresh", "duplicate"])
def test_mariadb(
    benchmark: Any, mariadb_engine: SqlEngine, tier_keys: list[bytes], lib: str, duplicate: bool
) -> None:
    """MariaDB authority (reference): fresh keys, then all duplicates."""
    _run_sql(benchmark, mariadb_engine, tier_keys, lib, duplicate)


@pytest.mark.parametrize("lib", _sql_libs("sqlite"))
@pytest.mark.parametrize("duplicate", [False, True], ids=["fresh", "duplicate"])
def test_sqlite(
    benchmark: Any, sqlite_engine: SqlEngine, tier_keys: list[bytes], lib: str, duplicate: bool
) -> None:
    """SQLite authority (reference): fresh keys, then all duplicates (WAL, one file)."""
    _run_sql(benchmark, sqlite_engine, tier_keys, lib, duplicate)
