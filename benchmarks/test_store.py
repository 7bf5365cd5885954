"""The embedded dedup store against what users would pick instead (benchmarks/README.md).

Peers, on the same 16-byte keys, in the same batches of 1000, in the same run:

- redis-py against the local Redis: pipelined ``SET key 1 NX PX 30000``
  (``pipeline(transaction=False)``, one ``execute`` per batch), and the
  single non-pipelined ``SET NX`` round trip for latency. Redis runs with no
  persistence (``--save "" --appendonly no``): it syncs nothing.
- SQLite ``INSERT OR IGNORE`` into a ``WITHOUT ROWID`` dedup table, WAL
  journal, one transaction per batch, with ``synchronous=FULL`` (durable) and
  ``synchronous=NORMAL`` (in WAL mode a power loss may roll back the last
  commits); plus, for reference, a ``... RETURNING k`` form that tells which
  keys were new (``executemany`` tells nothing per key).

dedupcore runs with its defaults (``durability="durable"``: every
``claim_many`` returns after an fdatasync of the write-ahead log) unless a
benchmark says otherwise. Every round gets a fresh data directory / SQLite
file / flushed Redis db, built in the untimed setup. Redis uses db
``DEDUPCORE_BENCH_REDIS_DB`` (15), which is FLUSHDB'd, and a key prefix; the
suite skips Redis if that db holds keys without the prefix.

Sizes come from the environment (``--quick``: the second figure)::

    DEDUPCORE_BENCH_STORE_N       keys of the claim_many benchmarks (1_000_000; 50_000)
    DEDUPCORE_BENCH_STORE_BIG     keys of the sustained run (10_000_000; 200_000)
    DEDUPCORE_BENCH_STORE_SINGLE  single calls of the latency benchmark (20_000; 2_000)
    DEDUPCORE_BENCH_STORE_BATCH   keys per batch (1000)
    DEDUPCORE_BENCH_STORE_ROUNDS  rounds of the N-key benchmarks (3)
    DEDUPCORE_BENCH_REDIS_URL     redis://127.0.0.1:6379 (db from DEDUPCORE_BENCH_REDIS_DB)

Every benchmark stores ``library``, ``operation``, ``n_keys``, ``call`` and
its own figures (p50/p99 latencies, bytes/key) in ``extra_info``;
``python -m benchmarks.report store`` turns the JSON into ratios and verdicts.
Only sanity checks are asserted (every fresh key NEW, every repeated key
DUPLICATE), never timings.
"""

from __future__ import annotations

import functools
import gc
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support import (
    REDIS_PREFIX,
    SuiteConfig,
    Tenths,
    Workspace,
    claim_and_complete,
    claim_batches,
    env_int,
    outcomes,
    percentiles,
    random_keys,
    record,
    redis_claim_batches,
    redis_db,
    redis_info,
    timed_calls,
)

NS = "bench/store"


@dataclass(frozen=True)
class StoreBenchConfig(SuiteConfig):
    big: int


SCFG = StoreBenchConfig(
    big=env_int("DEDUPCORE_BENCH_STORE_BIG", 10_000_000, quick=200_000),
    **SuiteConfig.common("STORE", n=(1_000_000, 50_000), single=(20_000, 2_000), redis_db=15),
)
WARMUP = 500  # single calls made before the latency measurement (not recorded)
_record = functools.partial(record, store_bench=asdict(SCFG))


# ------------------------------------------------------------------ keys --


@pytest.fixture(scope="module")
def store_keys() -> list[bytes]:
    """N fresh 16-byte keys, shared by every claim_many benchmark."""
    return random_keys(SCFG.n, SCFG.seed + 10)


@pytest.fixture(scope="module")
def single_keys() -> list[bytes]:
    """WARMUP + SINGLE keys of the latency benchmark."""
    return random_keys(WARMUP + SCFG.single, SCFG.seed + 12)


@pytest.fixture(scope="module")
def big_keys() -> Any:
    """BIG fresh keys of the sustained run (and their Redis form), freed after the module."""
    keys = random_keys(SCFG.big, SCFG.seed + 11)
    data = {"keys": keys, "redis": None}
    yield data
    data.clear()
    gc.collect()


# Peer-shaped copies of a key list, built once and outside any timing (generous to
# the peers). The source list is kept alive with its copy so its id is not reused.
_prefixed: dict[int, tuple[list[bytes], list[bytes]]] = {}
_rows: dict[int, tuple[list[bytes], list[tuple[bytes]]]] = {}


def redis_form(keys: list[bytes]) -> list[bytes]:
    """The keys with the Redis prefix."""
    if id(keys) not in _prefixed:
        _prefixed[id(keys)] = (keys, [REDIS_PREFIX + k for k in keys])
    return _prefixed[id(keys)][1]


def sqlite_rows(keys: list[bytes]) -> list[tuple[bytes]]:
    """The keys as 1-tuples for executemany."""
    if id(keys) not in _rows:
        _rows[id(keys)] = (keys, [(k,) for k in keys])
    return _rows[id(keys)][1]


@pytest.fixture(scope="module")
def redis_client() -> Any:
    yield from redis_db(SCFG.redis_url, SCFG.redis_db)


# ---------------------------------------------------------------- sqlite --

SQLITE_SCHEMA = "CREATE TABLE dedup (k BLOB PRIMARY KEY) WITHOUT ROWID"
SQLITE_INSERT = "INSERT OR IGNORE INTO dedup (k) VALUES (?)"


def sqlite_open(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    assert mode == "wal", mode
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(SQLITE_SCHEMA)
    return conn


def sqlite_claim_batches(conn: sqlite3.Connection, rows: list[tuple[bytes]], batch: int) -> int:
    """INSERT OR IGNORE per batch, one transaction each; returns rows inserted."""
    before = conn.total_changes
    execute, executemany = conn.execute, conn.executemany
    for i in range(0, len(rows), batch):
        execute("BEGIN")
        executemany(SQLITE_INSERT, rows[i : i + batch])
        execute("COMMIT")
    return conn.total_changes - before


_returning_sql: dict[int, str] = {}


def sqlite_returning_batches(conn: sqlite3.Connection, keys: list[bytes], batch: int) -> int:
    """One multi-row INSERT OR IGNORE .. RETURNING k per batch: the per-key answer."""
    fresh = 0
    execute = conn.execute
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        sql = _returning_sql.get(len(chunk))
        if sql is None:
            sql = "INSERT OR IGNORE INTO dedup (k) VALUES " + ",".join(["(?)"] * len(chunk))
            sql = _returning_sql[len(chunk)] = sql + " RETURNING k"
        execute("BEGIN")
        fresh += len(execute(sql, chunk).fetchall())
        execute("COMMIT")
    return fresh


# ------------------------------------------------------------- dedupcore --


def _footprint(store: Any, n_keys: int) -> dict[str, Any]:
    """LMDB and front sizes after a checkpoint: everything acknowledged is in LMDB."""
    during = store.stats()
    started = time.perf_counter()
    store.checkpoint()
    final_checkpoint_s = time.perf_counter() - started
    st = store.stats()
    lmdb_dir = Path(store.path) / "lmdb"
    data_mdb = lmdb_dir / "data.mdb"
    allocated = data_mdb.stat().st_blocks * 512 if data_mdb.exists() else None
    dir_bytes = sum(p.stat().st_blocks * 512 for p in Path(store.path).rglob("*") if p.is_file())
    return {
        "checkpoints_during_run": during["checkpoints"],
        "checkpoint_seconds_during_run": during["checkpoint_seconds"],
        "recent_records_at_end": during["recent_records"],
        "final_checkpoint_s": final_checkpoint_s,
        "lmdb_records": st["lmdb"]["records"],
        "lmdb_disk_bytes": st["lmdb"]["disk_bytes"],
        "lmdb_bytes_per_key": st["lmdb"]["disk_bytes"] / n_keys,
        "lmdb_file_allocated_bytes": allocated,
        "store_dir_allocated_bytes": dir_bytes,
        "front_nbytes": st["front"]["nbytes"],
        "front_bytes_per_key": st["front"]["nbytes"] / n_keys,
        "front_estimated_fpr": st["front"]["estimated_fpr"],
        "front_slices": len(st["front"]["slices"]),
        "footprint_keys": n_keys,
    }


# ------------------------------------------------- claim_many, fresh keys --

FRESH_PEERS = [
    "dedupcore",
    "redis-pipelined",
    "sqlite-wal-full",
    "sqlite-wal-normal",
    "sqlite-wal-full-returning",
]
CALLS = {
    "dedupcore": "store.claim_many(keys[i:i+B], namespace=ns)  (durability='durable')",
    "dedupcore-in-memory": "store.claim_many(...)  records still in memory (not yet checkpointed)",
    "redis-pipelined": "pipe=r.pipeline(transaction=False); pipe.set(k,1,nx=True,px=30000)×B; "
    "pipe.execute()",
    "redis-single": "r.set(k, 1, nx=True, px=30000)  (one round trip)",
    "sqlite-wal-full": "BEGIN; executemany('INSERT OR IGNORE ..', rows[i:i+B]); COMMIT  "
    "(WAL, synchronous=FULL)",
    "sqlite-wal-normal": "BEGIN; executemany('INSERT OR IGNORE ..', rows[i:i+B]); COMMIT  "
    "(WAL, synchronous=NORMAL)",
    "sqlite-wal-full-returning": "BEGIN; INSERT OR IGNORE .. VALUES (?)×B RETURNING k; COMMIT  "
    "(WAL, synchronous=FULL)",
    "dedupcore-durable": "store.claim(k, namespace=ns)  (durability='durable')",
    "dedupcore-power-loss-unsafe": "store.claim(k, namespace=ns)  (power-loss-unsafe)",
}


def _sqlite_setup(ws: Workspace, name: str) -> sqlite3.Connection:
    sync = "NORMAL" if name == "sqlite-wal-normal" else "FULL"
    conn = sqlite_open(ws.fresh() / "dedup.db", sync)
    ws.on_clear(conn.close)
    return conn


@pytest.mark.parametrize("name", FRESH_PEERS)
def test_claim_many_fresh(
    benchmark: Any,
    request: pytest.FixtureRequest,
    store_keys: list[bytes],
    name: str,
) -> None:
    """claim_many of N fresh keys in batches of B into an empty store (fresh per round)."""
    benchmark.group = "store_claim_many_fresh"
    n, batch = len(store_keys), SCFG.batch
    ws = Workspace(name)
    extra: dict[str, Any] = {}
    try:
        if name == "dedupcore":
            holder: list[Any] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                holder[:] = [ws.open_store(durability="durable")]
                return (holder[0], store_keys, batch, NS), {}

            benchmark.pedantic(claim_batches, setup=setup, rounds=SCFG.rounds, iterations=1)
            store = holder[0]
            assert outcomes(store, NS) == {"new": n, "duplicate": 0, "in_progress": 0}
            extra.update(_footprint(store, n))
        elif name == "redis-pipelined":
            client = request.getfixturevalue("redis_client")
            rkeys = redis_form(store_keys)
            used: list[int] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client.flushdb()
                used[:] = [client.info("memory")["used_memory"]]
                return (client, rkeys, batch, SCFG.px_ms), {}

            fresh = benchmark.pedantic(
                redis_claim_batches, setup=setup, rounds=SCFG.rounds, iterations=1
            )
            assert fresh == n, f"{n - fresh} keys were not new"
            extra.update(redis_info(client))
            extra["redis_bytes_per_key"] = (client.info("memory")["used_memory"] - used[0]) / n
            client.flushdb()
        else:
            returning = name.endswith("-returning")
            data: Any = store_keys if returning else sqlite_rows(store_keys)
            run = sqlite_returning_batches if returning else sqlite_claim_batches
            conns: list[sqlite3.Connection] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                conns[:] = [_sqlite_setup(ws, name)]
                return (conns[0], data, batch), {}

            fresh = benchmark.pedantic(run, setup=setup, rounds=SCFG.rounds, iterations=1)
            assert fresh == n, f"{n - fresh} keys were not new"
            assert ws.dir is not None
            db_bytes = sum(p.stat().st_size for p in ws.dir.iterdir())
            extra["sqlite_bytes_per_key"] = db_bytes / n
    finally:
        ws.clear()
    if ws.close_seconds:
        extra["close_seconds"] = ws.close_seconds
    _record(
        benchmark,
        library=name,
        operation="store_claim_many_fresh",
        n_keys=n,
        call=CALLS[name],
        batch=batch,
        **extra,
    )


# ------------------------------------------------------ complete_many --


@pytest.mark.parametrize("name", ["dedupcore", "redis-pipelined"])
def test_complete_many(
    benchmark: Any,
    request: pytest.FixtureRequest,
    store_keys: list[bytes],
    name: str,
) -> None:
    """complete_many of N claimed keys in batches of B (the claims are set up untimed);
    Redis: pipelined ``SET k 2 XX PX`` over keys set with ``SET NX PX``."""
    benchmark.group = "store_complete_many"
    n, batch = len(store_keys), SCFG.batch
    ws = Workspace("complete-" + name)
    try:
        if name == "dedupcore":
            work: list[Any] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                store = ws.open_store(durability="durable")
                items = []
                for i in range(0, n, batch):
                    claims = store.claim_many(store_keys[i : i + batch], namespace=NS)
                    items.append([(c.key, c.token) for c in claims])
                work[:] = [store]
                return (store, items), {}

            def complete(store: Any, items: list[list[tuple[bytes, int]]]) -> None:
                for part in items:
                    store.complete_many(part, namespace=NS)

            benchmark.pedantic(complete, setup=setup, rounds=SCFG.rounds, iterations=1)
            assert work[0].get(store_keys[0], namespace=NS).state.name == "PROCESSED"
        else:
            client = request.getfixturevalue("redis_client")
            rkeys = redis_form(store_keys)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client.flushdb()
                redis_claim_batches(client, rkeys, batch, SCFG.px_ms)
                return (client, rkeys), {}

            def complete(client: Any, keys: list[bytes]) -> int:
                done = 0
                for i in range(0, n, batch):
                    pipe = client.pipeline(transaction=False)
                    for k in keys[i : i + batch]:
                        pipe.set(k, 2, xx=True, px=SCFG.px_ms)
                    done += pipe.execute().count(True)
                return done

            done = benchmark.pedantic(complete, setup=setup, rounds=SCFG.rounds, iterations=1)
            assert done == n
            client.flushdb()
    finally:
        ws.clear()
    _record(
        benchmark,
        library=name,
        operation="store_complete_many",
        n_keys=n,
        call="store.complete_many(items[i:i+B], namespace=ns)"
        if name == "dedupcore"
        else "pipe.set(k, 2, xx=True, px=30000)×B; pipe.execute()",
        batch=batch,
    )


# ----------------------------------------- claim_many, all duplicates --

DUP_PEERS = ["dedupcore", "dedupcore-in-memory", "redis-pipelined", "sqlite-wal-full"]


def _dedupcore_filled(ws: Workspace, keys: list[bytes], batch: int, in_memory: bool) -> Any:
    """A fresh store where every key is claimed and completed (PROCESSED)."""
    config: dict[str, Any] = {"durability": "durable"}
    if in_memory:
        config.update(checkpoint_records=4 * len(keys) + 1, checkpoint_interval=86400.0)
    store = ws.open_store(**config)
    claim_and_complete(store, keys, batch, NS)
    if not in_memory:
        store.checkpoint()  # every record in LMDB: duplicates go front -> LMDB
    before = store.stats()
    assert before["recent_records"] == (len(keys) if in_memory else 0), before["recent_records"]
    return store


@pytest.mark.parametrize("name", DUP_PEERS)
def test_claim_many_duplicate(
    benchmark: Any,
    request: pytest.FixtureRequest,
    store_keys: list[bytes],
    name: str,
) -> None:
    """The same N keys again, all already processed (DUPLICATE), batches of B.

    Setup (untimed, per round) claims and completes every key into a fresh
    store; ``dedupcore`` then checkpoints, so every answer comes from the
    front filter (positive) and an LMDB read, while ``dedupcore-in-memory``
    keeps them in its recent records (no checkpoint yet). Redis setup sets
    the keys with a long PX so none expires before it is asked again with the
    same ``SET NX PX 30000``.
    """
    benchmark.group = "store_claim_many_duplicate"
    n, batch = len(store_keys), SCFG.batch
    ws = Workspace(name)
    extra: dict[str, Any] = {}
    try:
        if name.startswith("dedupcore"):
            holder: list[Any] = []
            in_memory = name == "dedupcore-in-memory"

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                holder[:] = [_dedupcore_filled(ws, store_keys, batch, in_memory)]
                holder.append(outcomes(holder[0], NS))
                return (holder[0], store_keys, batch, NS), {}

            benchmark.pedantic(claim_batches, setup=setup, rounds=SCFG.rounds, iterations=1)
            store, before = holder
            after = outcomes(store, NS)
            assert after["duplicate"] - before["duplicate"] == n, (before, after)
            assert after["new"] == before["new"] == n
            st = store.stats()
            extra.update(lmdb_reads=st["lmdb"]["reads"], recent_records=st["recent_records"])
        elif name == "redis-pipelined":
            client = request.getfixturevalue("redis_client")
            rkeys = redis_form(store_keys)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client.flushdb()
                loaded = redis_claim_batches(client, rkeys, batch, 3_600_000)
                assert loaded == n
                return (client, rkeys, batch, SCFG.px_ms), {}

            fresh = benchmark.pedantic(
                redis_claim_batches, setup=setup, rounds=SCFG.rounds, iterations=1
            )
            assert fresh == 0, f"{fresh} keys were new again"
            extra.update(redis_info(client))
            client.flushdb()
        else:
            rows = sqlite_rows(store_keys)
            conns: list[sqlite3.Connection] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                conns[:] = [_sqlite_setup(ws, name)]
                assert sqlite_claim_batches(conns[0], rows, batch) == n
                return (conns[0], rows, batch), {}

            fresh = benchmark.pedantic(
                sqlite_claim_batches, setup=setup, rounds=SCFG.rounds, iterations=1
            )
            assert fresh == 0, f"{fresh} keys were new again"
    finally:
        ws.clear()
    _record(
        benchmark,
        library=name,
        operation="store_claim_many_duplicate",
        n_keys=n,
        call=CALLS[name],
        batch=batch,
        **extra,
    )


# ------------------------------------------------------- sustained, BIG --


@pytest.mark.parametrize("name", ["dedupcore", "redis-pipelined"])
def test_sustained(
    benchmark: Any,
    request: pytest.FixtureRequest,
    big_keys: Any,
    name: str,
) -> None:
    """BIG fresh keys in batches of B, durable, ONE round (checkpoints run during it).

    dedupcore runs with its defaults: a background checkpoint every 200,000
    records (or 30 s) writes the recent records into LMDB while claims go on.
    Throughput per tenth of the run is kept in ``extra_info`` (``tenths_claims_per_s``);
    the LMDB and front footprint at BIG keys is measured after a final checkpoint.
    """
    benchmark.group = "store_sustained"
    keys = big_keys["keys"]
    n, batch = len(keys), SCFG.batch
    ws = Workspace("sustained-" + name)
    tenths = Tenths(n)
    extra: dict[str, Any] = {}
    try:
        if name == "dedupcore":
            holder: list[Any] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                holder[:] = [ws.open_store(durability="durable")]
                gc.collect()
                tenths.begin()
                return (holder[0], keys, batch, NS, tenths), {}

            benchmark.pedantic(claim_batches, setup=setup, rounds=1, iterations=1)
            store = holder[0]
            assert outcomes(store, NS) == {"new": n, "duplicate": 0, "in_progress": 0}
            extra.update(_footprint(store, n))
        else:
            client = request.getfixturevalue("redis_client")
            if big_keys["redis"] is None:
                big_keys["redis"] = [REDIS_PREFIX + k for k in keys]
            rkeys = big_keys["redis"]

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client.flushdb()
                gc.collect()
                tenths.begin()
                return (client, rkeys, batch, SCFG.px_ms, tenths), {}

            fresh = benchmark.pedantic(redis_claim_batches, setup=setup, rounds=1, iterations=1)
            assert fresh == n, f"{n - fresh} keys were not new"
            extra.update(redis_info(client))
            client.flushdb()
    finally:
        ws.clear()
    extra["tenths_claims_per_s"] = tenths.rates()
    _record(
        benchmark,
        library=name,
        operation="store_sustained",
        n_keys=n,
        call=CALLS[name],
        batch=batch,
        rounds_note="one round",
        **extra,
    )


# ------------------------------------------------- single-claim latency --

LATENCY_PEERS = ["dedupcore-durable", "dedupcore-power-loss-unsafe", "redis-single"]


@pytest.mark.parametrize("name", LATENCY_PEERS)
def test_claim_latency(
    benchmark: Any,
    request: pytest.FixtureRequest,
    single_keys: list[bytes],
    name: str,
) -> None:
    """SINGLE one-key calls on fresh keys, each timed with perf_counter_ns (p50/p99 kept).

    dedupcore: ``store.claim(k, namespace=ns)`` in-process (durable: each
    call waits for its own fdatasync of the log). redis-single: one
    non-pipelined ``SET k 1 NX PX 30000`` round trip (Redis syncs nothing).
    The first WARMUP calls (other keys) are not recorded.
    """
    benchmark.group = "store_claim_latency"
    warm, keys = single_keys[:WARMUP], single_keys[WARMUP:]
    lat: list[int] = []
    ws = Workspace(name)
    extra: dict[str, Any] = {}

    def timed(call: Callable[[bytes], Any], keys: list[bytes]) -> None:
        lat[:] = timed_calls(call, keys)

    try:
        if name.startswith("dedupcore"):
            durability = name.removeprefix("dedupcore-")
            holder: list[Any] = []

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                store = ws.open_store(durability=durability)
                holder[:] = [store]
                for k in warm:
                    store.claim(k, namespace=NS)

                def call(k: bytes) -> Any:
                    return store.claim(k, namespace=NS)

                return (call, keys), {}

            benchmark.pedantic(timed, setup=setup, rounds=1, iterations=1)
            counts = outcomes(holder[0], NS)
            assert counts["new"] == len(keys) + len(warm), counts
        else:
            client = request.getfixturevalue("redis_client")
            rwarm, rkeys = redis_form(warm), redis_form(keys)

            def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
                client.flushdb()
                for k in rwarm:
                    client.set(k, 1, nx=True, px=SCFG.px_ms)

                def call(k: bytes) -> Any:
                    return client.set(k, 1, nx=True, px=SCFG.px_ms)

                return (call, rkeys), {}

            benchmark.pedantic(timed, setup=setup, rounds=1, iterations=1)
            extra.update(redis_info(client))
            client.flushdb()
    finally:
        ws.clear()
    extra.update(percentiles(lat))
    _record(
        benchmark,
        library=name,
        operation="store_claim_latency",
        n_keys=len(keys),
        call=CALLS[name],
        warmup=len(warm),
        **extra,
    )
