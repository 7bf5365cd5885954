"""RedisStore against the machine's real Redis: semantics, races across processes, faults."""

from __future__ import annotations

import multiprocessing
import random
import time
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, StaleTokenError, UnavailableError
from dedupcore.record import State
from dedupcore.redis import RedisStore
from dedupcore.tiers.base import RequestRefusedError
from tests.support.cluster import free_port
from tests.support.servers import SERVERS, connect_redis

NS = "orders/billing"


@pytest.fixture
def store(redis_client: Any) -> RedisStore:
    return RedisStore(redis_client)


def test_outcomes_results_and_tokens(store: RedisStore) -> None:
    c = store.claim("k", namespace=NS)
    assert c.outcome is Outcome.NEW and c.token == 1
    assert store.claim("k", namespace=NS).outcome is Outcome.IN_PROGRESS
    store.complete("k", c.token, namespace=NS, result={"charged": 100})
    dup = store.claim("k", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == {"charged": 100}
    store.complete("k", c.token, namespace=NS, result={"charged": 100})  # retried completion
    rec = store.get("k", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.token == 1


def test_release_then_higher_token_and_stale_owner(store: RedisStore) -> None:
    c = store.claim(b"k", namespace=NS)
    store.release(b"k", c.token, namespace=NS)
    again = store.claim(b"k", namespace=NS)
    assert again.outcome is Outcome.NEW and again.token == 2
    with pytest.raises(StaleTokenError):
        store.complete(b"k", c.token, namespace=NS)
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.complete(b"never", 1, namespace=NS)


def test_lease_takeover_on_the_server_clock(store: RedisStore) -> None:
    first = store.claim("k", namespace=NS, lease=0.1, owner="a")
    assert store.claim("k", namespace=NS, owner="a").token == first.token  # own claim back
    time.sleep(0.05)
    assert store.claim("k", namespace=NS, owner="b").outcome is Outcome.IN_PROGRESS
    store.claim("k", namespace=NS, lease=0.1, owner="a")  # renew, then let it lapse
    time.sleep(0.2)
    taken = store.claim("k", namespace=NS, owner="b")
    assert taken.outcome is Outcome.NEW and taken.takeover and taken.token == first.token + 1
    with pytest.raises(StaleTokenError):
        store.complete("k", first.token, namespace=NS)


def test_conflict_and_stale_token_change_nothing(store: RedisStore) -> None:
    store.claim("k", namespace=NS, fingerprint=b"one")
    with pytest.raises(ConflictError):
        store.claim_many(["fresh", "k"], namespace=NS, fingerprints=[None, b"two"])
    assert store.claim("fresh", namespace=NS).outcome is Outcome.NEW
    a = store.claim("a", namespace=NS)
    with pytest.raises(StaleTokenError):
        store.complete_many([("a", a.token), ("fresh", 99)], namespace=NS)
    # Every key of a batch in one bucket is checked before any is written.
    assert store.get("a", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]


def test_batch_with_repeated_key(store: RedisStore) -> None:
    claims = store.claim_many([b"x", b"y", b"x"], namespace=NS)
    assert [c.outcome for c in claims] == [Outcome.NEW, Outcome.NEW, Outcome.IN_PROGRESS]


def test_bad_input(store: RedisStore) -> None:
    for key, error in ((b"", ValueError), (b"x" * 513, ValueError), (5, TypeError)):
        with pytest.raises(error):
            store.claim(key, namespace=NS)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.claim("k", namespace="bad namespace")
    with pytest.raises(ValueError):
        store.claim("k", namespace=NS, lease=0)


def test_every_argument_is_checked_before_anything_is_sent() -> None:
    """Against a port where nothing listens: bad input must be a ValueError/TypeError, not
    an UnavailableError from a round trip that was never needed."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    store = RedisStore(client)  # sends nothing
    for lease in (1e39, 30 * 86400 + 1, 0.0009, 0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lease"):
            store.claim("k", namespace=NS, lease=lease)
    for lease in ("1", True, None.__class__):
        with pytest.raises(TypeError):
            store.claim("k", namespace=NS, lease=lease)  # type: ignore[arg-type]
    for token, error in ((0, ValueError), (1 << 63, ValueError), (2.0, TypeError)):
        with pytest.raises(error):
            store.complete("k", token, namespace=NS)  # type: ignore[arg-type]
        with pytest.raises(error):
            store.release("k", token, namespace=NS)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.claim("k", namespace=NS, owner=b"o" * 256)
    with pytest.raises(ValueError):
        store.claim("k", namespace=NS, fingerprint=b"f" * 256)
    with pytest.raises(ValueError, match="max_result_bytes"):
        store.complete("k", 1, namespace=NS, result=b"r" * 70000)
    with pytest.raises(ValueError):
        store.get("k" * 513, namespace=NS)
    for count in (0, 10**20):
        with pytest.raises(ValueError, match="count"):
            store.expiring(NS, within=1, count=count)
    with pytest.raises(ValueError, match="within"):
        store.expiring(NS, within=float("nan"))
    huge = Retention(exact_window=1e39)
    for options in (
        {"lease": 1e39},
        {"retention": huge},
        {"namespaces": {NS: huge}},
        {"retention": Retention(cold_window=1e12)},
        {"buckets": 0},
        {"buckets": 1 << 20},
        {"max_result_bytes": 10**12},
        {"max_key_bytes": 0},
        {"prefix": "bad prefix"},
        {"namespaces": {"bad ns": Retention()}},
    ):
        with pytest.raises(ValueError):
            RedisStore(client, **options)
    for options in ({"buckets": 1.5}, {"retention": 7}, {"namespaces": {NS: 7}}):
        with pytest.raises(TypeError):
            RedisStore(client, **options)
    # What is left after the checks does need the server, and fails closed.
    with pytest.raises(UnavailableError):
        store.claim("k", namespace=NS, lease=30 * 86400)


def test_a_refused_request_is_a_value_error_not_unavailability(
    store: RedisStore, redis_client: Any
) -> None:
    # A key of ours holding another type: the server refuses the request (WRONGTYPE).
    name = store._names(NS.encode(), [b"taken"])[0]
    redis_client.set(name, b"not a hash")
    for call in (
        lambda: store.claim("taken", namespace=NS),
        lambda: store.complete("taken", 1, namespace=NS),
        lambda: store.get("taken", namespace=NS),
    ):
        with pytest.raises(RequestRefusedError) as info:
            call()
        assert isinstance(info.value, ValueError) and not isinstance(info.value, UnavailableError)
    # An out-of-range argument past the checks (a TTL that does not fit, as a lease of
    # 1e39 s once made): "value is not an integer or out of range" is refused, not down.
    other = store._names(NS.encode(), [b"other"])[0]
    with pytest.raises(RequestRefusedError, match="out of range"):
        store._run(store._claim, [([other], [1000, b"", 10**40, b"0"])])
    # A script stops at the error and keeps what it wrote before it (here a record with
    # no TTL): the reason why every argument is checked before it is sent.
    assert redis_client.hget(other, "s") == b"1" and redis_client.pttl(other) == -1
    # A server setting that refuses every request alike is no bad input: unavailable.
    import redis

    no_such_db = RedisStore(redis.Redis.from_url(f"{SERVERS.redis}/100000"))
    with pytest.raises(UnavailableError, match="DB index"):
        no_such_db.claim("k", namespace=NS)


def test_unreachable_redis_is_unavailable_never_new() -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    with pytest.raises(UnavailableError):
        store = RedisStore(client)
        store.claim("k", namespace=NS)


def _race(suite: str, keys: list[str], seed: int, queue: Any) -> None:
    store = RedisStore(connect_redis(suite))
    order = keys[:]
    random.Random(seed).shuffle(order)
    new = []
    for i in range(0, len(order), 500):
        new += [
            c.key
            for c in store.claim_many(order[i : i + 500], namespace=NS)
            if c.outcome is Outcome.NEW
        ]
    queue.put(new)


def test_processes_racing_on_the_same_keys_get_one_new_each(redis_client: Any) -> None:
    keys = [f"k{i}" for i in range(20000)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=("authorities", keys, seed, queue)) for seed in range(4)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    winners = [k for r in results for k in r]
    assert len(winners) == len(keys)
    assert set(winners) == set(keys)


def test_expiring_lists_processed_keys_near_their_ttl(redis_client: Any) -> None:
    from dedupcore.config import Retention

    store = RedisStore(redis_client, namespaces={"short": Retention(exact_window=5.0)})
    claims = store.claim_many([f"k{i}" for i in range(30)], namespace="short")
    store.complete_many([(c.key, c.token) for c in claims[:20]], namespace="short")
    store.release_many([(c.key, c.token) for c in claims[20:25]], namespace="short")
    # Keys with '}:' in them, and a namespace that extends "short" past a ':'.
    odd = store.claim("x}:y", namespace="short")
    store.complete("x}:y", odd.token, namespace="short")
    other = store.claim("k0", namespace="short:1")
    store.complete("k0", other.token, namespace="short:1")
    found = store.expiring("short", within=60, count=7)
    assert sorted(found) == sorted([f"k{i}".encode() for i in range(20)] + [b"x}:y"])
    assert store.expiring("short", within=0.001) == []
    assert store.expiring("short:1", within=60) == []  # the default window: 7 days
    assert store.expiring("short:1", within=8 * 86400) == [b"k0"]
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError):
            store.expiring("short", within=bad)
    with pytest.raises(TypeError):
        store.expiring("short", within="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.expiring("short", within=1, count=0)


def test_fresh_record_fields_and_get(store: RedisStore, redis_client: Any) -> None:
    # A new record has no empty owner, fingerprint or result and no 'u'; get()
    # reports updated = created until the first change.
    store.claim("plain", namespace=NS)
    store.claim("full", namespace=NS, owner=b"w", fingerprint=b"fp")
    (plain,) = [n for n in redis_client.keys("*") if n.endswith(b":plain")]
    (full,) = [n for n in redis_client.keys("*") if n.endswith(b":full")]
    assert sorted(redis_client.hgetall(plain)) == [b"c", b"d", b"s", b"t"]
    assert sorted(redis_client.hgetall(full)) == [b"c", b"d", b"f", b"o", b"s", b"t"]
    assert 0 < redis_client.pttl(plain) <= store._window_ms(NS, store.lease)
    rec = store.get("plain", namespace=NS)
    assert rec is not None and rec.owner is None and rec.fingerprint is None
    assert isinstance(rec.updated, float) and rec.updated == rec.created
    time.sleep(0.01)
    store.complete("plain", 1, namespace=NS, result=7)
    done = store.get("plain", namespace=NS)
    assert done is not None and done.created == rec.created and done.updated > rec.updated


def test_claim_of_a_released_key_forgets_its_owner_fingerprint_and_result(
    store: RedisStore,
) -> None:
    c = store.claim("k", namespace=NS, owner=b"a", fingerprint=b"one")
    store.release("k", c.token, namespace=NS)
    again = store.claim_many(["k"], namespace=NS)[0]
    assert again.outcome is Outcome.NEW and again.token == c.token + 1 and not again.takeover
    rec = store.get("k", namespace=NS)
    assert rec is not None and (rec.state, rec.owner, rec.fingerprint, rec.result) == (
        State.PROCESSING,
        None,
        None,
        None,
    )
    # Another fingerprint is no conflict after a release, and owner "a" is not the owner.
    assert store.claim("k", namespace=NS, owner=b"a").outcome is Outcome.IN_PROGRESS


def test_batch_mixing_every_outcome(store: RedisStore) -> None:
    d1 = store.claim("dup1", namespace=NS)
    store.complete("dup1", d1.token, namespace=NS, result={"n": 1})
    d2 = store.claim("dup2", namespace=NS)
    store.complete("dup2", d2.token, namespace=NS)  # no result
    d3 = store.claim("dup3", namespace=NS)
    store.complete("dup3", d3.token, namespace=NS, result=[3])
    store.claim("busy", namespace=NS)
    mine = store.claim("mine", namespace=NS, owner=b"me")
    store.claim("lapsed", namespace=NS, lease=0.05)
    gone = store.claim("gone", namespace=NS)
    store.release("gone", gone.token, namespace=NS)
    time.sleep(0.1)
    keys = ["dup1", "new", "busy", "dup2", "mine", "lapsed", "gone", "dup3", "new"]
    claims = store.claim_many(keys, namespace=NS, owner=b"me")
    got = [(c.key, c.outcome, c.token, c.result, c.takeover) for c in claims]
    assert got == [
        ("dup1", Outcome.DUPLICATE, 1, {"n": 1}, False),
        ("new", Outcome.NEW, 1, None, False),
        ("busy", Outcome.IN_PROGRESS, 1, None, False),
        ("dup2", Outcome.DUPLICATE, 1, None, False),
        ("mine", Outcome.NEW, mine.token, None, False),  # the owner's own claim back
        ("lapsed", Outcome.NEW, 2, None, True),
        ("gone", Outcome.NEW, 2, None, False),
        ("dup3", Outcome.DUPLICATE, 1, [3], False),
        ("new", Outcome.NEW, 1, None, False),  # repeated, same owner
    ]
    again = store.claim_many(["new", "fresh", "fresh"], namespace=NS)
    assert [c.outcome for c in again] == [Outcome.IN_PROGRESS, Outcome.NEW, Outcome.IN_PROGRESS]


def test_fingerprints_of_part_of_a_batch(store: RedisStore) -> None:
    store.claim("k", namespace=NS, fingerprint=b"one")
    fresh = store.claim_many(["a", "b"], namespace=NS, fingerprints=[b"x", None])
    assert [c.outcome for c in fresh] == [Outcome.NEW, Outcome.NEW]
    assert store.get("a", namespace=NS).fingerprint == b"x"  # type: ignore[union-attr]
    assert store.get("b", namespace=NS).fingerprint is None  # type: ignore[union-attr]
    with pytest.raises(ConflictError):
        store.claim_many(["c", "b", "k"], namespace=NS, fingerprints=[None, b"y", b"two"])
    assert store.get("c", namespace=NS) is None  # nothing written
    same = store.claim_many(["c", "k"], namespace=NS, fingerprints=[None, b"one"])
    assert [c.outcome for c in same] == [Outcome.NEW, Outcome.IN_PROGRESS]
