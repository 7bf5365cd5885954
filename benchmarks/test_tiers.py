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

Sizes and servers come from the environment (see benchmarks/README.md; ``--quick``:
the second figure)::

    DEDUPCORE_BENCH_TIER_N         keys of every claim_many benchmark (200_000; 20_000)
    DEDUPCORE_BENCH_TIER_BATCH     keys per batch (1000)
    DEDUPCORE_BENCH_TIER_ROUNDS    recorded rounds (3) after DEDUPCORE_BENCH_TIER_WARMUP (1)
    DEDUPCORE_BENCH_TIER_SINGLE    timed single calls (5_000; 2_000; after 200 warm-up calls)
    DEDUPCORE_BENCH_TIER_ENGINES   comma list of redis,postgresql,mariadb,sqlite (all)

``DEDUPCORE_BENCH_TIER_ALT_REDIS`` / ``DEDUPCORE_BENCH_TIER_ALT_SQL`` name a
``module:Class`` with RedisStore's / SqlStore's constructor that is measured
too, as ``dedupcore-alt-*`` (to try a change to a tier side by side with the
current code on the same keys in the same run).

Each benchmark stores ``library``, ``operation``, ``n_keys``, ``call``, the
per-key figures of its fastest and median rounds and, for Redis, the server's
own time for the calls (``INFO commandstats`` usec of EVALSHA / SET,
``server_ns_per_key``) in ``extra_info``; ``python -m benchmarks.report tiers``
prints ratios (of the median rounds) and verdicts. Only outcomes are asserted, never timings.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pytest

from benchmarks._support import (
    QUICK,
    REDIS_PREFIX,
    SqlEngine,
    SuiteConfig,
    claim_and_complete,
    env_int,
    env_str,
    percentiles,
    random_keys,
    record,
    redis_claim_batches,
    redis_db,
    redis_info,
    sql_engine,
    timed_calls,
)
from dedupcore.api import Outcome

NS = "bench/tiers"


@dataclass(frozen=True)
class TierBenchConfig(SuiteConfig):
    warmup: int
    engines: tuple[str, ...]
    pg_url: str
    mariadb_url: str
    quick: bool


TCFG = TierBenchConfig(
    warmup=env_int("DEDUPCORE_BENCH_TIER_WARMUP", 1, minimum=0),
    engines=tuple(
        e.strip()
        for e in env_str("DEDUPCORE_BENCH_TIER_ENGINES", "redis,postgresql,mariadb,sqlite")
        .lower()
        .split(",")
        if e.strip()
    ),
    pg_url=env_str("DEDUPCORE_BENCH_TIER_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    mariadb_url=env_str("DEDUPCORE_BENCH_TIER_MARIADB_URL", "mysql://root@127.0.0.1:3306/test"),
    quick=QUICK,
    **SuiteConfig.common("TIER", n=(200_000, 20_000), single=(5_000, 2_000), redis_db=11),
)
SINGLE_WARMUP = 200
ALT_REDIS = os.environ.get("DEDUPCORE_BENCH_TIER_ALT_REDIS", "")
ALT_SQL = os.environ.get("DEDUPCORE_BENCH_TIER_ALT_SQL", "")
_record = functools.partial(record, tier_bench=asdict(TCFG))


def _needs(engine: str) -> None:
    if engine not in TCFG.engines:
        pytest.skip(f"{engine} not in DEDUPCORE_BENCH_TIER_ENGINES")


def _import(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _batches(keys: list[Any], batch: int) -> list[list[Any]]:
    return [keys[i : i + batch] for i in range(0, len(keys), batch)]


# ------------------------------------------------------------------ keys --


@pytest.fixture(scope="module")
def tier_keys() -> list[bytes]:
    """N fresh 16-byte keys, shared by every claim_many benchmark of the run."""
    return random_keys(TCFG.n, TCFG.seed + 20)


@pytest.fixture(scope="module")
def tier_single_keys() -> list[bytes]:
    return random_keys(SINGLE_WARMUP + TCFG.single, TCFG.seed + 21)


# ---------------------------------------------------------------- redis --


@pytest.fixture(scope="module")
def tier_redis() -> Iterator[Any]:
    _needs("redis")
    yield from redis_db(TCFG.redis_url, TCFG.redis_db)


def _redis_store(client: Any, alt: bool = False) -> Any:
    from dedupcore.redis import RedisStore

    cls = _import(ALT_REDIS) if alt else RedisStore
    return cls(client, prefix="dcbench")


def _px_ms(store: Any) -> int:
    """The TTL (ms) RedisStore gives a fresh claim, the longer of the namespace's exact
    window and twice the lease (docs/architecture.md): the peer's SET gets the same."""
    policy = store.namespaces.get(NS, store.retention)
    return int(max(policy.exact_window, 2 * store.lease) * 1000)


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


def dc_redis_batches(store: Any, keys: list[bytes], batch: int) -> int:
    """``store.claim_many`` per batch; returns how many claims were NEW."""
    claim_many, new, fresh = store.claim_many, 0, Outcome.NEW
    for i in range(0, len(keys), batch):
        new += sum(c.outcome is fresh for c in claim_many(keys[i : i + batch], namespace=NS))
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
    n = len(keys)
    dc = name.startswith("dedupcore")
    store = _redis_store(client, alt="-alt-" in name) if dc else None
    px = _px_ms(store or _redis_store(client))
    batch = TCFG.batch
    if not dc:
        keys = [REDIS_PREFIX + k for k in keys]
    client.flushdb()
    if duplicate:  # every key claimed and completed once, untimed; rounds repeat on it
        if dc:
            claim_and_complete(store, keys, batch, NS)
        else:
            assert redis_claim_batches(client, keys, batch, 3_600_000) == n

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not duplicate:
            client.flushdb()
        return ((store, keys, batch) if dc else (client, keys, batch, px)), {}

    stats = CommandStats(client, "evalsha" if dc else "set")
    new = benchmark.pedantic(
        dc_redis_batches if dc else redis_claim_batches,
        setup=setup,
        rounds=TCFG.rounds,
        warmup_rounds=TCFG.warmup,
        iterations=1,
    )
    calls, usec = stats.delta()
    assert new == (0 if duplicate else n), f"{new} of {n} keys NEW"
    runs = TCFG.rounds + TCFG.warmup
    extra = {
        **redis_info(client),
        "px_ms": px,
        "server_calls": calls,
        "server_ns_per_key": usec * 1000 / (runs * n),
        "server_calls_expected": runs * -(-n // batch) if not dc else None,
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
        batch=TCFG.batch,
        **extra,
    )


@pytest.mark.parametrize("name", REDIS_LIBS)
@pytest.mark.parametrize("duplicate", [False, True], ids=["fresh", "duplicate"])
def test_redis(
    benchmark: Any,
    request: pytest.FixtureRequest,
    tier_keys: list[bytes],
    name: str,
    duplicate: bool,
) -> None:
    """N fresh keys in batches of B into an empty db (every claim NEW / every SET applied),
    then the same keys again, all claimed and completed (DUPLICATE) / all SET already."""
    operation = f"tier_redis_{'duplicate' if duplicate else 'fresh'}"
    benchmark.group = operation
    client = request.getfixturevalue("tier_redis")
    _run_redis(benchmark, client, tier_keys, name, operation, duplicate)


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
        warm = [REDIS_PREFIX + k for k in warm]
        keys = [REDIS_PREFIX + k for k in keys]

        def call(k: bytes) -> Any:
            return client.set(k, 1, nx=True, px=px)
    else:

        def call(k: bytes) -> Any:
            return store.claim(k, namespace=NS)

    lat: list[int] = []

    def timed() -> None:
        lat[:] = timed_calls(call, keys)

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
        **redis_info(client),
        **percentiles(lat),
    )


# ------------------------------------------------------------------ SQL --


@pytest.fixture(scope="module", params=["postgresql", "mariadb", "sqlite"])
def sql_server(request: pytest.FixtureRequest) -> Iterator[SqlEngine]:
    """PostgreSQL and MariaDB on the machine's servers, SQLite (WAL, one file) in the
    benchmarks' temporary directory."""
    _needs(request.param)
    url = TCFG.pg_url if request.param == "postgresql" else TCFG.mariadb_url
    yield from sql_engine(request.param, url)


def _sql_store(eng: SqlEngine, alt: bool = False) -> Any:
    from dedupcore.sql import SqlStore

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


def _sql_calls(eng: SqlEngine) -> dict[str, str]:
    return {
        f"dedupcore-{eng.name}": "store.claim_many(keys[i:i+B], namespace=ns)  (SqlStore, one "
        "transaction per batch)",
        f"dedupcore-alt-{eng.name}": f"{ALT_SQL}.claim_many(...)",
        f"{eng.name}-executemany": f"cur.executemany({eng.peer_insert()!r}, rows[i:i+B]); "
        + ("COMMIT" if eng.name == "sqlite" else "conn.commit()"),
    }


def _run_sql(benchmark: Any, eng: SqlEngine, keys: list[bytes], lib: str, duplicate: bool) -> None:
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
            batches = _batches(keys, TCFG.batch)
            if duplicate:
                claim_and_complete(store, keys, TCFG.batch, NS)
                eng.analyze(eng.dc_table)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                if not duplicate:
                    eng.empty(eng.dc_table)
                return (store, batches), {}

            before = store.stats()
            benchmark.pedantic(
                dc_sql_batches,
                setup=setup,
                rounds=TCFG.rounds,
                warmup_rounds=TCFG.warmup,
                iterations=1,
            )
            after = store.stats()
            runs = TCFG.rounds + TCFG.warmup
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
            batches = _batches([(NS, k) for k in keys], TCFG.batch)
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
                run, setup=setup, rounds=TCFG.rounds, warmup_rounds=TCFG.warmup, iterations=1
            )
            assert eng.query(f"SELECT COUNT(*) FROM {eng.peer_table}")[0][0] == n
            eng.admin(f"DROP TABLE {eng.peer_table}")
    finally:
        close_all()
    _record(
        benchmark,
        library=lib,
        operation=op,
        n_keys=n,
        call=_sql_calls(eng)[lib],
        batch=TCFG.batch,
        **extra,
    )


SQL_SIDES = ["dedupcore", "peer"] + (["dedupcore-alt"] if ALT_SQL else [])


@pytest.mark.parametrize("side", SQL_SIDES)
@pytest.mark.parametrize("duplicate", [False, True], ids=["fresh", "duplicate"])
def test_sql(
    benchmark: Any, sql_server: SqlEngine, tier_keys: list[bytes], side: str, duplicate: bool
) -> None:
    """A SQL authority (PostgreSQL; MariaDB and SQLite for reference) against the peer's
    executemany: fresh keys (an empty table per round), then all duplicates."""
    name = sql_server.name
    lib = f"{name}-executemany" if side == "peer" else f"{side}-{name}"
    _run_sql(benchmark, sql_server, tier_keys, lib, duplicate)
