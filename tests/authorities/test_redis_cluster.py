"""RedisStore over a private 3-master Redis Cluster: semantics, slots, races, a killed node."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from dedupcore.api import Outcome
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, DedupError, StaleTokenError, UnavailableError
from dedupcore.record import State
from dedupcore.redis import RedisStore
from tests.support.cluster import Cluster, free_port, redis_cluster

NS = "orders/billing"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module (every test flushes it first)."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> Iterator[Any]:
    c = cluster.client()
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def store(client: Any) -> RedisStore:
    return RedisStore(client)


def _owner_ports(cluster: Cluster, store: RedisStore, keys: list[str]) -> dict[str, int]:
    """The port of the master that holds each key, from CLUSTER SLOTS."""
    names = store._names(NS.encode(), [k.encode() for k in keys])
    by_slot: dict[int, int] = {}
    out = {}
    for k, name in zip(keys, names, strict=True):
        slot = key_slot(name)
        if slot not in by_slot:
            by_slot[slot] = cluster.node_of_slot(slot)
        out[k] = by_slot[slot]
    return out


def test_claim_complete_release_across_the_cluster(store: RedisStore, cluster: Cluster) -> None:
    assert store.cluster
    keys = [f"k{i}" for i in range(200)]
    assert len(set(_owner_ports(cluster, store, keys).values())) == 3
    claims = store.claim_many(keys, namespace=NS, fingerprints=[b"fp"] * len(keys))
    assert all(c.outcome is Outcome.NEW and c.token == 1 for c in claims)
    assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.IN_PROGRESS}
    done, back = keys[:100], keys[100:]
    store.complete_many([(k, 1, {"k": k}) for k in done], namespace=NS)
    store.release_many([(k, 1) for k in back], namespace=NS)
    again = store.claim_many(keys, namespace=NS)
    assert [(c.outcome, c.token) for c in again[:100]] == [(Outcome.DUPLICATE, 1)] * 100
    assert [c.result for c in again[:100]] == [{"k": k} for k in done]
    assert [(c.outcome, c.token) for c in again[100:]] == [(Outcome.NEW, 2)] * 100
    rec = store.get("k0", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.result == {"k": "k0"}
    # Checks span every slot before anything is written: a stale token anywhere in a
    # batch that spans all masters changes nothing.
    with pytest.raises(StaleTokenError):
        store.complete_many([*((k, 2) for k in back), ("k150", 1)], namespace=NS)
    assert {store.get(k, namespace=NS).state for k in back} == {State.PROCESSING}  # type: ignore[union-attr]
    with pytest.raises(StaleTokenError, match="already completed"):
        store.release_many([(k, 2) for k in back] + [("k0", 1)], namespace=NS)
    assert {store.get(k, namespace=NS).state for k in back} == {State.PROCESSING}  # type: ignore[union-attr]
    # A fingerprint conflict on one master claims nothing on the others.
    fresh = [f"f{i}" for i in range(100)]
    with pytest.raises(ConflictError):
        store.claim_many([*fresh, "k0"], namespace=NS, fingerprints=[None] * 100 + [b"other"])
    assert all(store.get(k, namespace=NS) is None for k in fresh)
    # Owner reclaim and takeover on the servers' clocks.
    mine = store.claim_many(fresh, namespace=NS, owner="a", lease=0.2)
    assert store.claim_many(fresh, namespace=NS, owner="a", lease=0.2) == mine
    time.sleep(0.5)
    taken = store.claim_many(fresh, namespace=NS, owner="b")
    assert all(c.outcome is Outcome.NEW and c.takeover and c.token == 2 for c in taken)
    with pytest.raises(StaleTokenError):
        store.complete("f0", 1, namespace=NS)


def test_a_renewal_across_the_cluster_is_all_or_nothing(
    store: RedisStore, cluster: Cluster, client: Any
) -> None:
    keys = [f"k{i}" for i in range(200)]
    assert len(set(_owner_ports(cluster, store, keys).values())) == 3
    claims = store.claim_many(keys, namespace=NS, lease=30.0)
    names = store._names(NS.encode(), [k.encode() for k in keys])

    def deadlines() -> list[int]:
        return [int(client.hget(n, "d")) for n in names]

    before = deadlines()
    store.complete("k150", claims[150].token, namespace=NS)
    items = [(c.key, c.token) for c in claims]
    # The completed key on one master refuses the renewal on all of them.
    with pytest.raises(StaleTokenError, match="cannot be extended"):
        store.extend_many(items, namespace=NS, lease=600.0)
    assert deadlines() == before
    held = items[:150] + items[151:]
    store.extend_many(held, namespace=NS, lease=600.0)
    after = deadlines()
    # Renewed on the servers' clocks: 600 s from now is past any 30 s deadline.
    assert all(
        a - b > 500_000 for i, (a, b) in enumerate(zip(after, before, strict=True)) if i != 150
    )
    assert all(client.pttl(n) > 500_000 for i, n in enumerate(names) if i != 150)


def test_a_batch_spans_every_master_with_one_script_call_per_slot(
    store: RedisStore, cluster: Cluster
) -> None:
    keys = [f"order-{i}" for i in range(1000)]
    owners = _owner_ports(cluster, store, [*keys, "warm-up"])
    assert {owners[k] for k in keys} == set(cluster.ports)
    store.claim_many(["warm-up"], namespace=NS)  # the scripts are loaded on every master
    store.release_many([("warm-up", 1)], namespace=NS)
    servers = [n.client() for n in cluster.nodes]
    for s in servers:
        s.config_resetstat()
    claims = store.claim_many(keys, namespace=NS)
    assert {c.outcome for c in claims} == {Outcome.NEW}
    names = store._names(NS.encode(), [k.encode() for k in keys])
    slots = {key_slot(n) for n in names}
    calls = [s.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) for s in servers]
    assert sum(calls) == len(slots)  # one EVALSHA per slot, none per key
    # Each master holds exactly the keys CLUSTER SLOTS says it owns.
    for node, server in zip(cluster.nodes, servers, strict=True):
        mine = [n for n, k in zip(names, keys, strict=True) if owners[k] == node.port]
        tombstone = int(owners["warm-up"] == node.port)
        assert mine and server.dbsize() == len(mine) + tombstone
        for name in mine:
            assert server.execute_command("CLUSTER KEYSLOT", name) == key_slot(name)
        server.close()
    store.complete_many([(k, 1) for k in keys], namespace=NS)
    assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.DUPLICATE}


def test_settings_are_read_from_every_node(client: Any, cluster: Cluster) -> None:
    store = RedisStore(client)
    assert store.stats()["servers"] == 3
    assert "no AOF (weakest node 127.0.0.1:" in store.durability()
    unsafe = cluster.nodes[2].client()
    unsafe.config_set("maxmemory-policy", "volatile-lru")
    try:
        refused = RedisStore(client)  # checked on its first call
        with pytest.raises(DedupError, match=f"volatile-lru.*{cluster.nodes[2].port}"):
            refused.claim("k", namespace=NS)
        assert RedisStore(client, allow_eviction=True).stats()["maxmemory_policy"] == (
            "volatile-lru"
        )
    finally:
        unsafe.config_set("maxmemory-policy", "noeviction")
        unsafe.close()
    # One node with an fsync-always AOF does not make the cluster durable.
    for n in cluster.nodes[:2]:
        n.client().config_set("appendonly", "yes")
    try:
        assert "no AOF (weakest node 127.0.0.1:" in store.durability()
    finally:
        for n in cluster.nodes[:2]:
            n.client().config_set("appendonly", "no")


def test_store_from_a_cluster_url(cluster: Cluster, client: Any) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{cluster.ports[0]}", cluster=True)
    assert store.cluster and store.stats()["servers"] == 3
    keys = [f"u{i}" for i in range(100)]
    assert {c.outcome for c in store.claim_many(keys, namespace=NS)} == {Outcome.NEW}
    assert {c.outcome for c in RedisStore(client).claim_many(keys, namespace=NS)} == {
        Outcome.IN_PROGRESS
    }
    store.client.close()
    # The cluster client reads the slot map when it is made: a cluster that cannot answer
    # fails the open, as UnavailableError.
    with pytest.raises(UnavailableError):
        RedisStore.from_url(f"redis://127.0.0.1:{free_port()}", cluster=True, timeout=1)


def test_expiring_scans_every_master(cluster: Cluster, client: Any) -> None:
    store = RedisStore(client, namespaces={"short": Retention(exact_window=3.0)})
    keys = [f"s{i}" for i in range(300)]
    claims = store.claim_many(keys, namespace="short")
    store.complete_many([(c.key, c.token) for c in claims[:200]], namespace="short")
    long_keys = [f"l{i}" for i in range(50)]
    store.complete_many(
        [(c.key, c.token) for c in store.claim_many(long_keys, namespace=NS)], namespace=NS
    )
    # A namespace that extends "short" past a ':' is not "short".
    store.complete_many(
        [(c.key, c.token) for c in store.claim_many(["x"], namespace="short:2")],
        namespace="short:2",
    )
    found = store.expiring("short", within=60, count=50)
    assert sorted(found) == sorted(k.encode() for k in keys[:200])  # processed only
    assert set(_owner_ports(cluster, store, keys[:200]).values()) == set(cluster.ports)
    assert store.expiring("short", within=0.001) == []
    assert store.expiring(NS, within=60) == []  # 7-day window: nothing expires soon


def _move_empty_slot(slot: int, src: Any, dst: Any) -> None:
    dst_id = dst.execute_command("CLUSTER MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    src.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    dst.execute_command("CLUSTER BUMPEPOCH")  # the new owner's claim wins everywhere


def test_a_moved_slot_is_followed(cluster: Cluster, client: Any) -> None:
    store = RedisStore(client)
    store.claim_many(["warm-up"], namespace=NS)  # the client has read the slot map
    name = store._names(NS.encode(), [b"m0"])[0]
    slot = key_slot(name)
    src_port = cluster.node_of_slot(slot)
    src_node = next(n for n in cluster.nodes if n.port == src_port)
    dst_node = next(n for n in cluster.nodes if n.port != src_port)
    src, dst = src_node.client(), dst_node.client()
    assert src.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
    src.config_resetstat()
    _move_empty_slot(slot, src, dst)
    try:
        # The client still routes the slot to its old master: MOVED, re-read, sent again.
        claims = store.claim_many(["m0", "other-1", "other-2"], namespace=NS)
        assert {c.outcome for c in claims} == {Outcome.NEW}
        assert "errorstat_MOVED" in src.info("errorstats")
        assert dst.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 1
        assert src.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
        assert store.claim("m0", namespace=NS).outcome is Outcome.IN_PROGRESS
    finally:
        client.flushall()
        _move_empty_slot(slot, dst, src)
        src.close()
        dst.close()


def _race(ports: list[int], keys: list[str], seed: int, start: Any, queue: Any) -> None:
    from redis.cluster import ClusterNode, RedisCluster

    store = RedisStore(RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports]))
    order = keys[:]
    random.Random(seed).shuffle(order)
    start.wait(60)
    new = []
    for i in range(0, len(order), 250):
        new += [
            c.key
            for c in store.claim_many(order[i : i + 250], namespace=NS)
            if c.outcome is Outcome.NEW
        ]
    queue.put(new)


def test_processes_racing_on_the_same_keys_get_one_new_each(cluster: Cluster, client: Any) -> None:
    keys = [f"k{i}" for i in range(5000)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_race, args=(cluster.ports, keys, seed, start, queue))
        for seed in range(4)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    winners = [k for r in results for k in r]
    assert sorted(winners) == sorted(keys)
    assert all(len(r) > 0 for r in results)  # the batches really overlapped


def test_killed_node_fails_closed_and_the_others_keep_answering(tmp_path: Path) -> None:
    # A cluster of its own (this one loses a master). Without full coverage the
    # surviving masters keep serving their slots once the cluster marks the node failed.
    with redis_cluster(
        tmp_path, 3, "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"
    ) as cluster:
        client = cluster.client(socket_timeout=2, socket_connect_timeout=1)
        store = RedisStore(client)
        before = [f"pre{i}" for i in range(300)]
        claims = store.claim_many(before, namespace=NS)
        store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        victim = cluster.nodes[1]
        keys = [f"run{i}" for i in range(3000)]
        owner = _owner_ports(cluster, store, before + keys)
        killed = threading.Event()
        done: list[str] = []  # completions acknowledged to the worker
        after: list[tuple[str, Any]] = []  # (key, outcome or error) of claims begun after the kill
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                for k in keys:
                    was_killed = killed.is_set()
                    try:
                        c = store.claim(k, namespace=NS)
                        if c.outcome is Outcome.NEW:
                            store.complete(k, c.token, namespace=NS)
                            done.append(k)
                        if was_killed:
                            after.append((k, c.outcome))
                    except UnavailableError as exc:
                        if was_killed:
                            after.append((k, exc))
                    if was_killed and len(after) >= 300:
                        return
            except BaseException as exc:  # surfaced by the main thread
                errors.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        while len(done) < 200 and thread.is_alive():
            time.sleep(0.01)
        victim.kill()
        killed.set()
        thread.join(120)
        assert not thread.is_alive() and not errors
        lost = [(k, r) for k, r in after if owner[k] == victim.port]
        kept = [(k, r) for k, r in after if owner[k] != victim.port]
        assert lost and kept
        assert all(isinstance(r, UnavailableError) for _, r in lost), lost[:5]
        assert all(r is Outcome.NEW for _, r in kept), kept[:5]
        # Nothing acknowledged on a surviving master comes back NEW; the dead master's
        # keys are errors, never NEW.
        for k in before + done:
            if owner[k] == victim.port:
                with pytest.raises(UnavailableError):
                    store.claim(k, namespace=NS)
            else:
                assert store.claim(k, namespace=NS).outcome is Outcome.DUPLICATE, k
        # A batch that needs the dead master fails as a whole; what the other masters
        # did apply is held for the caller (an owner gets it back), never lost to another.
        batch = [f"late{i}" for i in range(100)]
        late = _owner_ports(cluster, store, batch)
        with pytest.raises(UnavailableError):
            store.claim_many(batch, namespace=NS, owner="me")
        alive = [k for k in batch if late[k] != victim.port]
        for k in alive:
            rec = store.get(k, namespace=NS)
            assert rec is None or (rec.state, rec.owner, rec.token) == (
                State.PROCESSING,
                b"me",
                1,
            )
        mine = store.claim_many(alive, namespace=NS, owner="me")
        assert {(c.outcome, c.token) for c in mine} == {(Outcome.NEW, 1)}
        assert {c.outcome for c in store.claim_many(alive, namespace=NS)} == {Outcome.IN_PROGRESS}
        with pytest.raises(UnavailableError):
            store.expiring(NS, within=60)  # a partial scan would let a demoter miss keys
        client.close()


def test_cluster_marked_down_fails_closed_everywhere(tmp_path: Path) -> None:
    # Default cluster-require-full-coverage: once the cluster marks the killed master
    # failed, the surviving masters refuse every command (CLUSTERDOWN).
    with redis_cluster(tmp_path, 3, "--cluster-node-timeout", "1000") as cluster:
        client = cluster.client(socket_timeout=2, socket_connect_timeout=1)
        store = RedisStore(client)
        keys = [f"k{i}" for i in range(200)]
        claims = store.claim_many(keys, namespace=NS)
        store.complete_many([(c.key, c.token) for c in claims], namespace=NS)
        owner = _owner_ports(cluster, store, keys)
        victim, survivor = cluster.nodes[0], cluster.nodes[1]
        victim.kill()
        probe = survivor.client()
        deadline = time.monotonic() + 60  # a guard against a hang, not a timing check
        while probe.execute_command("CLUSTER INFO").get("cluster_state") != "fail":
            assert time.monotonic() < deadline, "the cluster never marked the node failed"
            time.sleep(0.1)
        probe.close()
        elsewhere = [k for k in keys if owner[k] != victim.port]
        for k in elsewhere[:10]:
            with pytest.raises(UnavailableError, match=r"CLUSTERDOWN|ClusterDown"):
                store.claim(k, namespace=NS)
        with pytest.raises(UnavailableError):
            store.claim_many(keys, namespace=NS)
        client.close()
