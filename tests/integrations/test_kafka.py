"""KafkaDedupLoop against the stand-in consumer of tests/support/fakes.py (no broker runs here)."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.integrations.kafka import KafkaDedupLoop, MissingKeyError
from dedupcore.integrations.rabbitmq import Delivery, TransactionalTable
from dedupcore.record import State
from tests.support.fakes import FirstBlocks, KafkaCluster, Record, StandInConsumer

NS = "payments/ledger"
TOPIC = "payments"


def body_key(body: bytes, headers: Any) -> Any:
    return json.loads(body).get("id")


def rec(key: str | None, **extra: Any) -> Record:
    body = {"id": key, **extra} if key is not None else extra
    return Record(json.dumps(body).encode())


class Spy:
    """Wraps a store and logs its batch calls (to check order and batching)."""

    def __init__(self, store: Any, log: list[str]) -> None:
        self.store, self.log = store, log

    def claim_many(self, keys: Any, **kw: Any) -> Any:
        keys = list(keys)
        self.log.append(f"claim_many:{len(keys)}")
        return self.store.claim_many(keys, **kw)

    def complete_many(self, items: Any, **kw: Any) -> Any:
        items = list(items)
        self.log.append(f"complete_many:{len(items)}")
        return self.store.complete_many(items, **kw)

    def release_many(self, items: Any, **kw: Any) -> Any:
        items = list(items)
        self.log.append(f"release_many:{len(items)}")
        return self.store.release_many(items, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class Handler:
    def __init__(self, fail: set[str] | None = None, fail_times: int = 1) -> None:
        self.calls: list[tuple[int, int, str]] = []  # (partition, offset, key)
        self.fail = fail or set()
        self.fail_times = fail_times

    def __call__(self, d: Delivery) -> None:
        key = str(d.key)
        self.calls.append((d.raw.partition(), d.raw.offset(), key))
        if key in self.fail and sum(c[2] == key for c in self.calls) <= self.fail_times:
            raise RuntimeError(f"handler fails on {key}")

    def keys(self) -> list[str]:
        return [c[2] for c in self.calls]


def make(
    cluster: KafkaCluster, store: Any, handler: Any, **kw: Any
) -> tuple[KafkaDedupLoop, StandInConsumer]:
    consumer = StandInConsumer(cluster)
    kw.setdefault("key", body_key)
    kw.setdefault("retry_delay", 0.0)
    loop = KafkaDedupLoop(consumer, store, handler, namespace=NS, **kw)
    loop.subscribe([TOPIC])
    return loop, consumer


def drain(loop: KafkaDedupLoop, rounds: int = 20) -> None:
    for _ in range(rounds):
        r = loop.run_once()
        if r.messages == 0:
            return
    raise AssertionError("the loop kept receiving messages")


@pytest.mark.parametrize("kind", ["embedded", "daemon", "redis"])
def test_batch_claims_once_completes_then_commits(kind: str, store_factory: Any) -> None:
    cluster = KafkaCluster()
    for i, k in enumerate(["a", "b", "a", "c", "b"]):
        cluster.produce(TOPIC, i % 2, rec(k))
    log: list[str] = []
    store = Spy(store_factory(kind), log)
    handler = Handler()
    loop, _ = make(cluster, store, handler, batch_size=100)

    def before_commit(offsets: dict[Any, int]) -> None:
        log.append("commit")
        for k in "abc":  # every completion is durable before the offsets move
            r = store.get(k, namespace=NS)
            assert r is not None and r.state is State.PROCESSED

    loop.before_commit = before_commit
    report = loop.run_once()
    assert (report.messages, report.new, report.duplicate) == (5, 3, 2)
    assert sorted(handler.keys()) == ["a", "b", "c"]
    assert log == ["claim_many:3", "complete_many:3", "commit"]  # one claim call per batch
    assert cluster.committed == {(TOPIC, 0): 3, (TOPIC, 1): 2}


def test_kill_between_completion_and_commit_replays_as_duplicates(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in "abcd":
        cluster.produce(TOPIC, 0, rec(k))
    handler = Handler()

    class Killed(BaseException):
        pass

    def die(offsets: Any) -> None:
        raise Killed

    loop, _ = make(cluster, store, handler, before_commit=die)
    with pytest.raises(Killed):
        loop.run_once()
    assert cluster.committed == {}
    # A new consumer of the group starts from the committed offsets (none): all replayed.
    loop2, _ = make(cluster, store, handler)
    report = loop2.run_once()
    assert (report.new, report.duplicate) == (0, 4)
    assert handler.keys() == list("abcd")  # the handler ran once per key in all
    assert cluster.committed == {(TOPIC, 0): 4}


def test_failure_stops_the_partition_releases_and_retries_in_order(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in ["p0-a", "p0-bad", "p0-c", "p0-d"]:
        cluster.produce(TOPIC, 0, rec(k))
    for k in ["p1-a", "p1-b"]:
        cluster.produce(TOPIC, 1, rec(k))
    log: list[str] = []
    handler = Handler(fail={"p0-bad"})
    loop, consumer = make(cluster, Spy(store, log), handler)
    report = loop.run_once()
    assert (report.new, report.failed, report.retried) == (3, 1, 3)
    # Partition 0 stopped at the failure: committed up to it, later messages not run.
    assert cluster.committed == {(TOPIC, 0): 1, (TOPIC, 1): 2}
    assert "release_many:1" in log  # the failed claim
    assert "release_many:2" in log  # p0-c and p0-d were claimed, never run: given back
    for k in ("p0-bad", "p0-c", "p0-d"):
        r = store.get(k, namespace=NS)
        assert r is None or r.state is not State.PROCESSING
    assert consumer.position[(TOPIC, 0)] == 1  # rewound to the failed message
    drain(loop)
    assert cluster.committed == {(TOPIC, 0): 4, (TOPIC, 1): 2}
    p0 = [k for p, _, k in handler.calls if p == 0]
    assert p0 == ["p0-a", "p0-bad", "p0-bad", "p0-c", "p0-d"]  # order kept in the partition


def test_in_progress_pauses_the_partition_until_the_other_owner_is_done(
    store_factory: Any,
) -> None:
    store = store_factory("embedded")
    other = store.claim("x", namespace=NS, lease=120.0, owner="another-consumer")
    cluster = KafkaCluster()
    for k in ["w", "x", "y"]:
        cluster.produce(TOPIC, 0, rec(k))
    handler = Handler()
    loop, consumer = make(cluster, store, handler, retry_delay=3600.0)
    report = loop.run_once()
    assert (report.new, report.retried) == (1, 2)
    assert cluster.committed == {(TOPIC, 0): 1}
    assert (TOPIC, 0) in consumer.paused  # waits retry_delay before asking again
    assert loop.run_once().messages == 0
    store.complete("x", other.token, namespace=NS)
    loop.retry_delay = 0.0
    loop._paused = dict.fromkeys(loop._paused, 0.0)  # the delay is over
    drain(loop)
    assert handler.keys() == ["w", "y"]  # x was done by the other owner: a DUPLICATE
    assert cluster.committed == {(TOPIC, 0): 3}


def test_revoked_partitions_release_in_flight_claims(store_factory: Any) -> None:
    """An interrupted batch leaves claims in flight; the revoke settles them."""
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in "abcde":
        cluster.produce(TOPIC, 0, rec(k))
    handled: list[str] = []

    def handler(d: Delivery) -> None:
        if d.key == "c":
            raise KeyboardInterrupt  # the process is being stopped mid-batch
        handled.append(str(d.key))

    loop, consumer = make(cluster, store, handler)
    with pytest.raises(KeyboardInterrupt):
        loop.run_once()
    state = {k: store.get(k, namespace=NS) for k in "abcde"}
    assert all(state[k] is not None and state[k].state is State.PROCESSING for k in "abde")
    assert cluster.committed == {}
    # The group takes the partition away; the revoke callback runs inside the next consume.
    consumer.revoke([(TOPIC, 0)])
    assert loop.run_once().messages == 0
    for k in "ab":  # handled: completed, and their offsets committed before the partition went
        r = store.get(k, namespace=NS)
        assert r is not None and r.state is State.PROCESSED
    for k in "cde":  # not handled: released, so the next owner need not wait for their leases
        r = store.get(k, namespace=NS)
        assert r is None or r.state is not State.PROCESSING
    assert cluster.committed == {(TOPIC, 0): 2}
    # The next owner (another process) carries on at once: no IN_PROGRESS on c, d, e.
    handler2 = Handler()
    loop2, _ = make(cluster, store, handler2)
    report = loop2.run_once()
    assert (report.new, report.retried) == (3, 0)
    assert handler2.keys() == list("cde")


def test_lost_partitions_release_but_do_not_commit(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in "abc":
        cluster.produce(TOPIC, 0, rec(k))

    def handler(d: Delivery) -> None:
        if d.key == "b":
            raise KeyboardInterrupt

    loop, consumer = make(cluster, store, handler)
    with pytest.raises(KeyboardInterrupt):
        loop.run_once()
    consumer.lose([(TOPIC, 0)])
    loop.run_once()
    assert cluster.committed == {}  # a lost partition may not be committed to
    r = store.get("a", namespace=NS)
    assert r is not None and r.state is State.PROCESSED
    r = store.get("c", namespace=NS)
    assert r is None or r.state is not State.PROCESSING


def test_close_settles_in_flight_claims(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in "ab":
        cluster.produce(TOPIC, 0, rec(k))

    def handler(d: Delivery) -> None:
        if d.key == "b":
            raise SystemExit

    loop, consumer = make(cluster, store, handler)
    with pytest.raises(SystemExit):
        loop.run_once()
    loop.close()
    assert consumer.closed
    assert cluster.committed == {(TOPIC, 0): 1}
    r = store.get("b", namespace=NS)
    assert r is None or r.state is not State.PROCESSING


def test_missing_key_raises_after_committing_what_came_before(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    cluster.produce(TOPIC, 0, rec("a"))
    cluster.produce(TOPIC, 0, Record(b"not json"))
    cluster.produce(TOPIC, 0, rec("c"))
    handler = Handler()
    loop, _ = make(cluster, store, handler)
    with pytest.raises(MissingKeyError, match="JSONDecodeError"):
        loop.run_once()
    assert cluster.committed == {(TOPIC, 0): 1}  # stopped at the keyless message
    with pytest.raises(MissingKeyError):  # and stays stopped there: a clear error each time
        loop.run_once()
    assert handler.keys() == ["a"]


def test_on_invalid_is_the_dead_letter_path(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    cluster.produce(TOPIC, 0, rec("a"))
    cluster.produce(TOPIC, 0, Record(b"not json"))
    cluster.produce(TOPIC, 0, rec("k" * 600))  # longer than the store's max_key_bytes
    cluster.produce(TOPIC, 0, rec("c"))
    dead: list[tuple[int, str]] = []
    handler = Handler()
    loop, _ = make(
        cluster,
        store,
        handler,
        on_invalid=lambda msg, err: dead.append((msg.offset(), type(err).__name__)),
    )
    drain(loop)
    assert dead == [(1, "MissingKeyError"), (2, "MissingKeyError")]
    assert handler.keys() == ["a", "c"]
    assert cluster.committed == {(TOPIC, 0): 4}


def test_key_falls_back_to_header_record_key_then_offset(store_factory: Any) -> None:
    store = store_factory("embedded")
    cluster = KafkaCluster()
    cluster.produce(TOPIC, 0, Record(b"{}", headers=[("x-id", b"hdr")]))
    cluster.produce(TOPIC, 0, Record(b"{}", key=b"rk"))
    cluster.produce(TOPIC, 0, Record(b"{}"))
    handler = Handler()
    loop, _ = make(cluster, store, handler, key_header="x-id", record_key=True)
    drain(loop)
    assert handler.keys() == ["b'hdr'", "b'rk'", f"{TOPIC}:0:2"]


def test_table_mode_on_sqlite(tmp_path: Path) -> None:
    """Each message is one transaction: dedup row and business row commit together."""
    conn = sqlite3.connect(tmp_path / "biz.db")
    conn.execute("CREATE TABLE ledger (k TEXT)")
    conn.commit()
    table = TransactionalTable(conn)
    cluster = KafkaCluster()
    for k in ["a", "boom", "a", "b"]:
        cluster.produce(TOPIC, 0, rec(k))
    calls: list[str] = []

    def handler(d: Delivery) -> None:
        calls.append(str(d.key))
        assert d.consumption is not None and d.consumption.outcome is Outcome.NEW
        d.conn.execute("INSERT INTO ledger VALUES (?)", (d.key,))
        if d.key == "boom" and calls.count("boom") == 1:
            raise RuntimeError("rolled back with its dedup row")

    class Killed(BaseException):
        pass

    commits = {"n": 0}

    def before_commit(offsets: Any) -> None:
        commits["n"] += 1
        if commits["n"] == 2:
            raise Killed  # the DB transactions committed, the offsets did not

    loop, _ = make(cluster, table, handler, before_commit=before_commit)
    loop.run_once()  # a, then boom fails: the partition stops there
    assert cluster.committed == {(TOPIC, 0): 1}
    with pytest.raises(Killed):
        loop.run_once()  # boom (second try), a (duplicate), b
    loop2, _ = make(cluster, table, handler)
    report = loop2.run_once()
    assert (report.new, report.duplicate) == (0, 3)
    assert sorted(r[0] for r in conn.execute("SELECT k FROM ledger")) == ["a", "b", "boom"]
    assert calls == ["a", "boom", "boom", "b"]
    assert cluster.committed == {(TOPIC, 0): 4}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        KafkaDedupLoop(object(), object(), print, namespace=NS, batch_size=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace"):
        KafkaDedupLoop(object(), object(), print, namespace=b"x")  # type: ignore[arg-type]


# -- graceful stop -------------------------------------------------------------------------

PATIENCE = 60.0


@pytest.mark.parametrize("kind", ["embedded", "daemon"])
def test_stop_finishes_the_message_in_flight_and_starts_nothing_after(
    kind: str, store_factory: Any
) -> None:
    """stop() from another thread while the handler is blocked: it finishes, is committed
    once, the rest of the batch is not run; after a restart that replays everything, the
    finished message is a DUPLICATE and only the others run."""
    store = store_factory(kind)
    cluster = KafkaCluster()
    for k in "abc":
        cluster.produce(TOPIC, 0, rec(k))
    cluster.produce(TOPIC, 1, rec("d"))
    blocking = FirstBlocks("a", PATIENCE)
    loop, consumer = make(cluster, store, blocking, batch_size=100)
    runner = threading.Thread(target=loop.run)
    runner.start()
    assert blocking.started.wait(PATIENCE)
    answer: list[bool] = []
    stopper = threading.Thread(target=lambda: answer.append(loop.stop()))
    stopper.start()
    assert loop._stop.asked.wait(PATIENCE)
    assert not loop._stop.finished.is_set()  # stop() waits for the handler
    blocking.release.set()
    stopper.join(PATIENCE)
    runner.join(PATIENCE)
    assert answer == [True] and not runner.is_alive()
    assert loop.stop() is True  # idempotent
    assert blocking.calls == ["a"]  # nothing after it started
    assert consumer.commits == [{(TOPIC, 0): 1}]  # committed once, up to the finished one
    rec_a = store.get("a", namespace=NS)
    assert rec_a is not None and rec_a.state is State.PROCESSED
    for k in "bcd":  # not started: their claims were given back
        r = store.get(k, namespace=NS)
        assert r is None or r.state is not State.PROCESSING
    assert loop.run_once().messages == 0  # a stopped loop consumes nothing
    loop.close()

    cluster.committed.clear()  # a restart that replays the partitions from the start
    loop2, _ = make(cluster, store, blocking, batch_size=100)
    drain(loop2)
    assert sorted(blocking.calls) == ["a", "b", "c", "d"]  # "a" was not applied again
    assert cluster.committed == {(TOPIC, 0): 3, (TOPIC, 1): 1}


def test_stop_from_the_loop_thread_does_not_wait(store_factory: Any) -> None:
    """The handler (or a signal handler on the loop's thread) asks for the stop: the
    message finishes and run() returns after it."""
    store = store_factory("embedded")
    cluster = KafkaCluster()
    for k in "abc":
        cluster.produce(TOPIC, 0, rec(k))
    seen: list[bool] = []

    def handler(d: Delivery) -> None:
        seen.append(loop.stop())  # on the loop's own thread: cannot wait, returns False

    loop, consumer = make(cluster, store, handler, batch_size=100)
    loop.run()
    assert seen == [False]
    assert consumer.commits == [{(TOPIC, 0): 1}]
    with pytest.raises(ValueError):
        loop.stop(timeout=-1)
    with pytest.raises(TypeError):
        loop.stop(timeout="soon")  # type: ignore[arg-type]
