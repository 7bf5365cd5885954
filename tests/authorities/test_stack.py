"""Stacked and sharded stores on the real servers: order of the tiers, failures, races.

The claim semantics of every stack are checked by tests/conformance/;
this module checks what is specific to stacking: which tier is asked (tier
call counters and the SQL statements actually sent), a cache that is down
or paused, an authority that is down, sharding (routing, one concurrent
call per shard, partial failures), opening by URL, the daemon and CLI with
a remote authority, and 8 processes racing on the same keys.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from dedupcore import hash64, shard_many
from dedupcore._core import jump_hash
from dedupcore.api import ClaimAPI, KeyRecord, Outcome
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.factory import open_store
from dedupcore.redis import RedisStore
from dedupcore.sql import SqlStore
from dedupcore.stack import SHARD_SEED, ShardedStore, TieredStore
from dedupcore.store import DedupStore
from dedupcore.tiers.cache import RedisCache
from tests.support.cluster import free_port, redis_server
from tests.support.daemon import Lab
from tests.support.procs import run_cli
from tests.support.servers import (
    SERVERS,
    connect_redis,
    flushed_redis,
    forget_redis_keys,
    redis_url,
    require_server,
    uid,
)
from tests.support.stores import SqlTable, counting_store

NS = "orders/billing"
REDIS_URL = redis_url("stack")


@pytest.fixture
def rdb() -> Iterator[redis.Redis]:
    yield from flushed_redis("stack")


@pytest.fixture
def pg_table() -> Iterator[str]:
    require_server("postgresql")
    table = f"stack_{uuid.uuid4().hex[:10]}"
    yield table
    SqlTable("postgresql", SERVERS.postgresql, table).drop()


def _pg(table: str) -> SqlStore:
    s = SqlStore.from_url(SERVERS.postgresql, table=table)
    s.init_schema()
    return s


# -- which tier is asked ---------------------------------------------------------------


def test_fresh_keys_through_the_front_read_no_tier(rdb: redis.Redis, pg_table: str) -> None:
    authority, conns = counting_store(SqlTable("postgresql", SERVERS.postgresql, pg_table))
    authority.init_schema()
    store = TieredStore(authority, cache=RedisCache(rdb))
    keys = [f"order-{i}" for i in range(2000)]
    del conns[0].statements[:]
    claims = store.claim_many(keys, namespace=NS)
    assert all(c.outcome is Outcome.NEW for c in claims)
    counts = store.stats()["counts"]
    assert counts["front_negative"] == 2000
    assert counts.get("cache_reads", 0) == 0  # the front said "never seen": no cache read
    # The authority's atomic create alone: no SELECT of the fresh keys.
    sent = [s.split()[0] for s in conns[0].statements if not s.startswith("BEGIN")]
    assert sent == ["INSERT"] * (sent.count("INSERT")) and "SELECT" not in sent
    store.complete_many([(c.key, c.token, {"n": i}) for i, c in enumerate(claims)], namespace=NS)

    # Seen keys: the cache answers, the authority is not asked at all.
    del conns[0].statements[:]
    dups = store.claim_many(keys, namespace=NS)
    assert [c.outcome for c in dups] == [Outcome.DUPLICATE] * 2000
    assert [c.result for c in dups] == [{"n": i} for i in range(2000)]
    assert conns[0].statements == []
    counts = store.stats()["counts"]
    assert counts["cache_reads"] == 1 and counts["cache_hits"] == 2000
    assert counts["authority_claims"] == 1
    store.close()


def test_cache_is_written_only_after_the_authority_has_the_key(
    rdb: redis.Redis, pg_table: str
) -> None:
    store = TieredStore(_pg(pg_table), cache=RedisCache(rdb, prefix="wt"))
    c = store.claim("k", namespace=NS)
    assert rdb.keys("wt:*") == []  # a claim in progress is the authority's alone
    store.release("k", c.token, namespace=NS)
    assert rdb.keys("wt:*") == []
    c = store.claim("k", namespace=NS)
    store.complete("k", c.token, namespace=NS, result="done")
    assert rdb.keys("wt:*") == [b"wt:" + NS.encode() + b":k"]
    assert store.authority.get("k", namespace=NS).result == "done"  # type: ignore[union-attr]
    store.close()


def test_cache_filled_from_another_process_answer_still_checks_fingerprints(
    rdb: redis.Redis, pg_table: str
) -> None:
    # Another host completed the key: this stack learns it from the authority
    # (without its fingerprint) and fills the cache.
    other = _pg(pg_table)
    c = other.claim("k", namespace=NS, fingerprint=b"A")
    other.complete("k", c.token, namespace=NS, result=1)
    other.close()
    store = TieredStore(_pg(pg_table), cache=RedisCache(rdb))
    assert store.claim("k", namespace=NS).outcome is Outcome.DUPLICATE  # fills the cache
    assert store.claim("k", namespace=NS).outcome is Outcome.DUPLICATE
    assert store.stats()["counts"]["cache_hits"] == 1
    # A claim with a fingerprint cannot be settled by an entry without one:
    # the authority checks it.
    with pytest.raises(ConflictError):
        store.claim("k", namespace=NS, fingerprint=b"B")
    assert store.claim("k", namespace=NS, fingerprint=b"A").outcome is Outcome.DUPLICATE
    assert store.stats()["counts"]["cache_hits"] == 1
    assert store.stats()["counts"]["authority_claims"] == 3
    store.close()


def test_cache_entry_with_its_fingerprint_answers_conflicts_itself(
    rdb: redis.Redis, pg_table: str
) -> None:
    store = TieredStore(_pg(pg_table), cache=RedisCache(rdb))
    c = store.claim("k", namespace=NS, fingerprint=b"A")
    store.complete("k", c.token, namespace=NS, result="r")
    calls = store.stats()["counts"]["authority_claims"]
    with pytest.raises(ConflictError):
        store.claim_many(["fresh", "k"], namespace=NS, fingerprints=[None, b"B"])
    assert store.stats()["counts"]["authority_claims"] == calls  # decided by the cache
    assert store.authority.get("fresh", namespace=NS) is None  # nothing claimed
    assert store.claim("k", namespace=NS, fingerprint=b"A").result == "r"
    store.close()


# -- failures --------------------------------------------------------------------------


def test_cache_down_is_skipped_with_a_counter_and_a_log_line(
    pg_table: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = RedisCache.from_url(f"redis://127.0.0.1:{free_port()}/0")
    store = TieredStore(_pg(pg_table), cache=dead, cache_retry_after=0.0)
    claims = store.claim_many(["a", "b"], namespace=NS)
    with caplog.at_level(logging.WARNING, logger="dedupcore"):
        store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        assert [c.outcome for c in store.claim_many(["a", "b", "c"], namespace=NS)] == [
            Outcome.DUPLICATE,
            Outcome.DUPLICATE,
            Outcome.NEW,
        ]
    assert store.stats()["counts"]["cache_errors"] >= 2
    assert any("cache redis-cache failed" in r.getMessage() for r in caplog.records)
    store.close()


def test_paused_cache_is_skipped_after_its_timeout(tmp_path: Path, pg_table: str) -> None:
    with redis_server(tmp_path / "cache") as server:
        cache = RedisCache.from_url(f"redis://127.0.0.1:{server.port}/0", socket_timeout=0.3)
        store = TieredStore(_pg(pg_table), cache=cache, cache_retry_after=30.0)
        c = store.claim("k", namespace=NS)
        store.complete("k", c.token, namespace=NS, result="r")
        server.pause()
        try:
            dup = store.claim("k", namespace=NS)  # cache read times out: the authority answers
            assert dup.outcome is Outcome.DUPLICATE and dup.result == "r"
            assert store.stats()["counts"]["cache_errors"] == 1
            # Skipped for cache_retry_after: no more waiting on the paused cache.
            assert store.claim("k", namespace=NS).outcome is Outcome.DUPLICATE
            assert store.stats()["counts"]["cache_errors"] == 1
            assert store.stats()["cache"]["skipped_until"] > 0
        finally:
            server.resume()
        store.close()


def test_authority_down_is_unavailable_never_new(tmp_path: Path, rdb: redis.Redis) -> None:
    with redis_server(tmp_path / "auth") as server:
        authority = RedisStore(server.client(socket_timeout=2))
        store = TieredStore(authority, cache=RedisCache(rdb))
        c = store.claim("done", namespace=NS)
        store.complete("done", c.token, namespace=NS)
        held = store.claim("held", namespace=NS)
        assert held.outcome is Outcome.NEW
        server.kill()
        for key in ("fresh", "held"):
            with pytest.raises(UnavailableError):
                store.claim(key, namespace=NS)
        # The cache still knows the completed key: DUPLICATE is a correct answer.
        assert store.claim("done", namespace=NS).outcome is Outcome.DUPLICATE
        with pytest.raises(UnavailableError):
            store.complete("held", held.token, namespace=NS)
        store.close()


# -- cold archive ----------------------------------------------------------------------


def test_cold_archive_answers_for_keys_the_authority_no_longer_holds(
    tmp_path: Path, pg_table: str
) -> None:
    authority = _pg(pg_table)
    store = TieredStore(authority, archive=tmp_path / "cold")
    c = store.claim("old", namespace=NS)
    store.complete("old", c.token, namespace=NS)
    # As a demotion does: copy into the archive, then delete from the authority.
    assert store.archive is not None
    from dedupcore import keys as _keys

    hashes = _keys.front_hashes(_keys.digests(NS.encode(), [b"old"]))
    store.archive.add_many(store.retention.cold_window, hashes, 1e9)
    authority._tx(lambda cur: cur.execute(f"DELETE FROM {pg_table}"))
    dup = store.claim("old", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and not dup.exact
    rec = store.get("old", namespace=NS)
    assert rec == KeyRecord(rec.state, 0, None, None, None, 0.0, 0.0, exact=False)  # type: ignore[union-attr]
    assert store.claim("new", namespace=NS).outcome is Outcome.NEW
    store.close()
    # The archive is on disk: a new stack over it still answers.
    again = TieredStore(_pg(pg_table), archive=tmp_path / "cold")
    assert again.claim("old", namespace=NS).exact is False
    again.close()


def test_sweep_demotes_a_sql_authority_copy_then_delete(tmp_path: Path) -> None:
    short = Retention(exact_window=1.0)
    authority = SqlStore.from_url(f"sqlite:///{tmp_path}/a.db", retention=short)
    authority.init_schema()
    store = TieredStore(authority, archive=tmp_path / "cold", retention=short)
    done = store.claim_many([f"d{i}" for i in range(50)], namespace=NS)
    store.complete_many([(c.key, c.token) for c in done], namespace=NS)
    gone = store.claim("released", namespace=NS)
    store.release("released", gone.token, namespace=NS)
    time.sleep(1.5)
    assert store.archive is not None

    def broken(*args: Any) -> int:
        raise OSError(28, "No space left on device")

    real_add = store.archive.add_many
    store.archive.add_many = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="No space"):
        store.sweep()
    assert authority.get("d0", namespace=NS) is not None  # copy failed: nothing deleted
    store.archive.add_many = real_add  # type: ignore[method-assign]
    assert store.sweep() == 50
    assert authority.get("d0", namespace=NS) is None
    answers = store.claim_many([f"d{i}" for i in range(50)], namespace=NS)
    assert all(c.outcome is Outcome.DUPLICATE and not c.exact for c in answers)
    # A released claim's work was never done: it is not archived.
    assert store.claim("released", namespace=NS).outcome is Outcome.NEW
    store.close()


def test_sweep_archives_redis_keys_before_their_ttl_ends(tmp_path: Path, rdb: redis.Redis) -> None:
    short = Retention(exact_window=2.0)
    authority = RedisStore(rdb, retention=short, prefix="sweep")
    store = TieredStore(authority, archive=tmp_path / "cold", retention=short, front=False)
    store.sweep_interval = 5.0  # keys expiring within 10 s are archived
    done = store.claim_many([f"d{i}" for i in range(20)], namespace=NS)
    store.complete_many([(c.key, c.token) for c in done], namespace=NS)
    held = store.claim("held", namespace=NS)
    assert store.sweep() == 20  # the processed keys; a claim in progress is not archived
    deadline = time.monotonic() + 30
    while rdb.exists(*(authority._names(NS.encode(), [b"d0"]))):
        assert time.monotonic() < deadline, "redis did not expire the key"
        time.sleep(0.2)
    answers = store.claim_many([f"d{i}" for i in range(20)], namespace=NS)
    assert all(c.outcome is Outcome.DUPLICATE and not c.exact for c in answers)
    store.release("held", held.token, namespace=NS)
    store.close()


# -- sharding --------------------------------------------------------------------------


class _Recorder(ClaimAPI):
    """A shard that records its calls and can block or fail (wraps a real store)."""

    def __init__(self, inner: ClaimAPI, barrier: threading.Barrier | None = None) -> None:
        self.inner = inner
        self.barrier = barrier
        self.calls: list[tuple[str, int]] = []
        self.fail: BaseException | None = None

    def claim_many(self, keys: Any, **kw: Any) -> Any:
        keys = list(keys)
        self.calls.append(("claim_many", len(keys)))
        if self.barrier is not None:
            self.barrier.wait(timeout=20)  # every shard must be in flight at once
        if self.fail is not None:
            raise self.fail
        return self.inner.claim_many(keys, **kw)

    def complete_many(self, items: Any, **kw: Any) -> None:
        items = list(items)
        self.calls.append(("complete_many", len(items)))
        self.inner.complete_many(items, **kw)

    def release_many(self, items: Any, **kw: Any) -> None:
        items = list(items)
        self.calls.append(("release_many", len(items)))
        self.inner.release_many(items, **kw)

    def get(self, key: Any, **kw: Any) -> Any:
        return self.inner.get(key, **kw)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[list[DedupStore]]:
    stores = [DedupStore.open(tmp_path / f"s{i}", durability="power-loss-unsafe") for i in range(3)]
    yield stores
    for s in stores:
        s.close()


def test_sharding_routes_by_jump_hash_one_concurrent_call_per_shard(
    shards: list[DedupStore],
) -> None:
    barrier = threading.Barrier(3)
    rec = [_Recorder(s, barrier) for s in shards]
    store = ShardedStore(rec)
    keys = [f"k{i}" for i in range(3000)]
    claims = store.claim_many(keys, namespace=NS)  # would time out unless run concurrently
    assert [c.key for c in claims] == keys and all(c.outcome is Outcome.NEW for c in claims)
    expected = [jump_hash(hash64(NS.encode() + b"\x00" + k.encode(), SHARD_SEED), 3) for k in keys]
    for i, r in enumerate(rec):
        assert r.calls == [("claim_many", expected.count(i))]
        assert 800 < expected.count(i) < 1200
    for k, s in zip(keys[:50], expected, strict=False):
        assert store.shard_of(k, namespace=NS) == s
        assert shards[s].get(k, namespace=NS) is not None
        assert all(shards[o].get(k, namespace=NS) is None for o in range(3) if o != s)
    for r in rec:
        r.barrier = None
    store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
    assert [r.calls[-1] for r in rec] == [("complete_many", expected.count(i)) for i in range(3)]
    assert all(c.outcome is Outcome.DUPLICATE for c in store.claim_many(keys, namespace=NS))
    assert store.stats()["namespaces"][NS]["new"] == 3000


def test_a_failed_shard_releases_the_claims_the_others_made(shards: list[DedupStore]) -> None:
    rec = [_Recorder(s) for s in shards]
    store = ShardedStore(rec)
    rec[1].fail = UnavailableError("shard 1 is down")
    keys = [f"k{i}" for i in range(300)]
    with pytest.raises(UnavailableError, match="shard 1"):
        store.claim_many(keys, namespace=NS)
    assert ("release_many", 0) not in rec[0].calls and rec[0].calls[-1][0] == "release_many"
    rec[1].fail = None
    # Nothing stayed claimed by the caller that never saw the claims.
    assert all(c.outcome is Outcome.NEW for c in store.claim_many(keys, namespace=NS))


def test_input_errors_win_over_unavailability(shards: list[DedupStore]) -> None:
    rec = [_Recorder(s) for s in shards]
    store = ShardedStore(rec)
    keys = [f"k{i}" for i in range(60)]
    claims = store.claim_many(keys, namespace=NS, fingerprints=[b"A"] * 60)
    store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
    rec[2].fail = UnavailableError("down")
    with pytest.raises(ConflictError):
        store.claim_many(keys, namespace=NS, fingerprints=[b"B"] * 60)


def test_stale_token_on_one_shard_is_raised_after_the_others_applied(
    shards: list[DedupStore],
) -> None:
    store = ShardedStore(shards)
    keys = [f"k{i}" for i in range(50)]
    claims = store.claim_many(keys, namespace=NS)
    bad = claims[0]
    items = [(c.key, c.token + (7 if c is bad else 0)) for c in claims]
    with pytest.raises(StaleTokenError):
        store.complete_many(items, namespace=NS)
    bad_shard = store.shard_of(bad.key, namespace=NS)
    for c in claims:
        outcome = store.claim(c.key, namespace=NS).outcome
        if store.shard_of(c.key, namespace=NS) == bad_shard:
            assert outcome is Outcome.IN_PROGRESS  # that shard's batch changed nothing
        else:
            assert outcome is Outcome.DUPLICATE  # the other shards applied theirs


@pytest.mark.parametrize("n", [4, 16])
def test_sharded_redis_spreads_every_shard_over_every_bucket(rdb: redis.Redis, n: int) -> None:
    """The shard and the Redis hash-tag bucket of a key are independent hashes.

    With both taken from one hash, shard s only held buckets {s} and n..15
    (one cluster slot per namespace and server at n = 16).
    """
    stores = [RedisStore(rdb, prefix=f"sh{s}") for s in range(n)]
    store = ShardedStore(stores)
    keys = [f"k{i}" for i in range(n * 200)]
    assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.NEW}
    buckets: dict[int, set[int]] = {s: set() for s in range(n)}
    for name in rdb.scan_iter(match=b"sh*", count=1000):
        shard = int(name[2 : name.index(b":")])
        buckets[shard].add(int(name[name.index(b"{") :].split(b":")[1].rstrip(b"}")))
    assert sum(1 for _ in rdb.scan_iter(match=b"sh*", count=1000)) == len(keys)
    assert buckets == {s: set(range(16)) for s in range(n)}
    # What routing by the bucket's own hash did: shard s only ever saw buckets {s} and n..15.
    joined = [NS.encode() + b"\x00" + k.encode() for k in keys]
    old: dict[int, set[int]] = {s: set() for s in range(n)}
    for shard, bucket in zip(shard_many(joined, n), shard_many(joined, 16), strict=True):
        old[shard].add(bucket)
    assert all(old[s] <= {s, *range(n, 16)} for s in range(n))
    store.close()


# -- opening by URL ----------------------------------------------------------------------


def test_open_store_by_url(tmp_path: Path, rdb: redis.Redis, pg_table: str) -> None:
    embedded = open_store(tmp_path / "data")
    assert isinstance(embedded, DedupStore)
    embedded.close()
    stack = open_store(SERVERS.postgresql, cache=REDIS_URL, table=pg_table)
    assert isinstance(stack, TieredStore) and isinstance(stack.authority, SqlStore)
    assert isinstance(stack.cache, RedisCache) and stack.front is not None
    stack.close()
    sqlite = f"sqlite:///{tmp_path}/a.db"
    sharded = open_store([REDIS_URL, sqlite], init_schema=True, archive=tmp_path / "c")
    assert isinstance(sharded, ShardedStore) and len(sharded.shards) == 2
    assert all(isinstance(s, TieredStore) for s in sharded.shards)
    assert sharded.claim("k", namespace=NS).outcome is Outcome.NEW
    sharded.close()
    assert (tmp_path / "c" / "shard-1").is_dir()


def test_open_store_without_a_tier_to_add_returns_the_authority(
    tmp_path: Path, rdb: redis.Redis, pg_table: str
) -> None:
    """No cache and no archive: no stack (a front filter alone saves no authority call)."""
    url = REDIS_URL
    for front in (None, True, False):
        plain = open_store(url, front=front)
        assert type(plain) is RedisStore
        plain.close()
    sql = open_store(SERVERS.postgresql, table=pg_table, init_schema=True)
    assert type(sql) is SqlStore and sql.claim("k", namespace=NS).outcome is Outcome.NEW
    sql.close()
    sharded = open_store([url, f"sqlite:///{tmp_path}/s.db"], init_schema=True)
    assert isinstance(sharded, ShardedStore)
    assert [type(s) for s in sharded.shards] == [RedisStore, SqlStore]
    sharded.close()
    with open_store(url, archive=tmp_path / "cold") as archived:
        assert isinstance(archived, TieredStore) and archived.front is not None
    with open_store(tmp_path / "data", cache=RedisCache(rdb)) as cached:
        assert isinstance(cached, TieredStore) and cached.front is None  # DedupStore has one


def test_sql_authority_alone_applies_retention_by_its_own_sweep(tmp_path: Path) -> None:
    store = open_store(
        f"sqlite:///{tmp_path}/r.db",
        init_schema=True,
        retention=Retention(exact_window=0.2),
        namespaces={"keep": Retention(exact_window=3600)},
    )
    assert type(store) is SqlStore
    for ns, n in ((NS, 30), ("keep", 5)):
        claims = store.claim_many([f"k{i}" for i in range(n)], namespace=ns)
        store.complete_many([(c.key, c.token) for c in claims], namespace=ns)
    time.sleep(0.3)  # past the short window (on the same machine's clock)
    assert store.sweep(limit=7) == 30  # several purge rounds of at most 7 rows
    assert store.get("k0", namespace=NS) is None
    assert store.get("k0", namespace="keep") is not None
    store.close()


def test_embedded_stacks_and_shards_report_durability(tmp_path: Path) -> None:
    safe = DedupStore.open(tmp_path / "safe")
    fast = DedupStore.open(tmp_path / "fast", durability="power-loss-unsafe")
    assert safe.durability().startswith("durable: the write-ahead log is fdatasynced")
    assert fast.durability().startswith("power-loss-unsafe: survives a process crash")
    stack = TieredStore(fast, archive=tmp_path / "cold")
    assert stack.durability() == fast.durability()
    sharded = ShardedStore([safe, stack])
    assert sharded.durability() == f"shard 1 of 2 (the weakest): {fast.durability()}"
    assert ShardedStore([safe]).durability() == safe.durability()
    # A claim API store that does not say is "unknown", the weakest of all.
    unknown = ShardedStore([safe, _Recorder(safe)])
    assert unknown.durability().startswith("shard 1 of 2 (the weakest): unknown")
    sharded.close()


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("http://example.com/x", ValueError, "unknown store URL scheme 'http'"),
        ("", TypeError, "authority is a URL"),
        (42, TypeError, "not int"),
        ([], ValueError, "empty list"),
        ("sqlite://relative.db", ValueError, "sqlite"),
    ],
)
def test_open_store_bad_targets(target: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        open_store(target)


def test_dedupstore_open_points_urls_to_open_store() -> None:
    with pytest.raises(ValueError, match=r"dedupcore\.open_store"):
        DedupStore.open("postgresql://postgres@127.0.0.1/test")


def test_open_store_unreachable_authority_is_unavailable(tmp_path: Path) -> None:
    # Opening sends nothing (redis-py and the SQL drivers connect on demand); the first
    # call fails closed.
    for url in (
        f"redis://127.0.0.1:{free_port()}/0",
        f"postgresql://postgres@127.0.0.1:{free_port()}/test",
        f"mysql://root@127.0.0.1:{free_port()}/test",
    ):
        store = open_store(url, timeout=1)
        with pytest.raises(UnavailableError):
            store.claim("k", namespace=NS)
        store.close()
    stack = open_store(f"redis://127.0.0.1:{free_port()}/0", archive=tmp_path / "c")
    with pytest.raises(UnavailableError):
        stack.claim("k", namespace=NS)
    stack.close()


def test_stack_rejects_objects_that_are_not_tiers(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="authority must be a claim API"):
        TieredStore(object())  # type: ignore[arg-type]
    with DedupStore.open(tmp_path / "d") as s:
        with pytest.raises(TypeError, match="cache must be a CacheTier"):
            TieredStore(s, cache=object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="front must be"):
            TieredStore(s, front="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="hot_window"):
            TieredStore(s, retention=Retention(hot_window=1e39))  # a cache TTL out of range
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedStore([])
    with pytest.raises(TypeError, match="each shard"):
        ShardedStore([object()])  # type: ignore[list-item]


# -- CLI and daemon ----------------------------------------------------------------------


def test_sql_init_command(tmp_path: Path, pg_table: str) -> None:
    for _ in range(2):  # idempotent
        out = run_cli("sql", "init", "--url", SERVERS.postgresql, "--table", pg_table)
        assert out.returncode == 0, out.stderr
        assert f"dedup table {pg_table!r} ready on postgresql" in out.stdout
    with SqlStore.from_url(SERVERS.postgresql, table=pg_table) as s:
        assert s.claim("k", namespace=NS).outcome is Outcome.NEW
    bad = run_cli("sql", "init", "--url", f"postgresql://postgres@127.0.0.1:{free_port()}/test")
    assert bad.returncode == 1 and "cannot connect" in bad.stderr
    bad = run_cli("sql", "init", "--url", "sqlite:///x.db", "--table", "no-such;table")
    assert bad.returncode == 1 and "SQL identifier" in bad.stderr


def test_daemon_serves_a_stack_by_url(tmp_path: Path, rdb: redis.Redis, lab: Lab) -> None:
    db = tmp_path / "auth.db"
    assert run_cli("sql", "init", "--url", f"sqlite:///{db}").returncode == 0
    daemon = lab.daemon(
        *("--authority", f"sqlite:///{db}", "--cache", REDIS_URL),
        *("--archive", str(tmp_path / "cold")),
    )
    with daemon.client(timeout=30) as client:
        c = client.claim("k", namespace=NS)
        assert c.outcome is Outcome.NEW
        client.complete("k", c.token, namespace=NS, result="r")
        assert client.claim("k", namespace=NS).result == "r"
        st = client.stats()
        assert st["counts"]["cache_hits"] == 1 and "authority" in st
    assert daemon.stop() == 0, daemon.log_text()
    with SqlStore.from_url(f"sqlite:///{db}") as s:
        assert s.claim("k", namespace=NS).outcome is Outcome.DUPLICATE


def test_daemon_refuses_a_bad_authority_url(tmp_path: Path) -> None:
    out = run_cli("serve", "--socket", str(tmp_path / "s.sock"), "--authority", "ftp://x")
    assert out.returncode == 1 and "unknown store URL scheme 'ftp'" in out.stderr


# -- races -------------------------------------------------------------------------------


def _race_worker(spec: dict[str, Any], keys: list[str], out: Any) -> None:
    store = open_store(**spec)
    won: list[str] = []
    for start in range(0, len(keys), 250):
        batch = keys[start : start + 250]
        claims = store.claim_many(batch, namespace=NS, owner=f"p{os.getpid()}")
        new = [c for c in claims if c.outcome is Outcome.NEW]
        won.extend(str(c.key) for c in new)
        store.complete_many([(c.key, c.token) for c in new], namespace=NS)
    store.close()
    out.put(won)


@pytest.mark.parametrize(
    "stack", ["redis", "mysql", "sqlite", "pg+redis-cache", "sharded-redis", "sharded-pg+sqlite"]
)
def test_eight_processes_racing_see_one_new_per_key(
    stack: str, rdb: redis.Redis, pg_table: str, tmp_path: Path
) -> None:
    """Each authority and stack: 8 processes, the same 3000 keys, one NEW per key overall.

    Each case starts from nothing of an earlier run: the stack's Redis database is
    flushed (``rdb``), tables are new (``pg_table``), SQLite is in ``tmp_path``.
    """
    sqlite = f"sqlite:///{tmp_path}/race.db"
    second = connect_redis("integrations")
    if stack == "redis":
        spec: dict[str, Any] = {"authority": REDIS_URL}
    elif stack == "mysql":
        require_server("mariadb")
        spec = {"authority": SERVERS.mariadb, "table": pg_table}
        SqlStore.from_url(SERVERS.mariadb, table=pg_table).init_schema()
    elif stack == "sqlite":
        spec = {"authority": sqlite}
        SqlStore.from_url(sqlite).init_schema()
    elif stack == "pg+redis-cache":
        # The table is made once; each process opens the stack by URL.
        _pg(pg_table).close()
        spec = {
            "authority": SERVERS.postgresql,
            "cache": REDIS_URL,
            "table": pg_table,
        }
    elif stack == "sharded-redis":
        # The second shard is in the database that tests/integrations share: this run's
        # keys get a prefix of their own, deleted before the race and after it.
        prefix = uid("race")
        spec = {"authority": [REDIS_URL, redis_url("integrations")], "prefix": prefix}
        forget_redis_keys(second, prefix)
    else:
        _pg(pg_table).close()
        SqlStore.from_url(sqlite, table=pg_table).init_schema()
        spec = {"authority": [SERVERS.postgresql, sqlite], "table": pg_table}
    keys = [f"race-{i}" for i in range(3000)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for n in range(8):
        mine = keys[n * 100 :] + keys[: n * 100]  # each starts elsewhere, all overlap
        procs.append(ctx.Process(target=_race_worker, args=(spec, mine, out)))
    try:
        for p in procs:
            p.start()
        won = [k for _ in procs for k in out.get(timeout=240)]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert sorted(won) == sorted(keys)  # every key NEW exactly once over all processes
    finally:
        for p in procs:
            if p.is_alive():  # a failed run: nothing may write after the cleanup
                p.kill()
                p.join(60)
        if stack == "sharded-redis":
            forget_redis_keys(second, spec["prefix"])
        if stack == "mysql":
            SqlTable("mysql", SERVERS.mariadb, pg_table).drop()
        second.close()
