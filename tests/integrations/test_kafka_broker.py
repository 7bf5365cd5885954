"""KafkaDedupLoop on a real Kafka-protocol broker.

``./dev test`` starts one (Tansu, in memory, on 127.0.0.1:9092: scripts/services.sh)
and points these tests at it through ``DEDUPCORE_KAFKA_BOOTSTRAP=host:port``; any
other Kafka-protocol broker can be given the same way (or ``--kafka-bootstrap``,
tests/support/servers.py). Like every server of the
suite, an unreachable broker skips them outside CI and fails them in CI.
Each test uses its own topic and consumer groups (uuid names).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore import DedupStore
from dedupcore.integrations.kafka import BatchReport, KafkaDedupLoop
from dedupcore.record import State
from tests.support.fakes import FirstBlocks
from tests.support.servers import SERVERS, require_server

NS = "payments/ledger"
PATIENCE = 60.0


@pytest.fixture(autouse=True)
def _broker() -> None:
    require_server("kafka")


@pytest.fixture
def topic() -> Iterator[str]:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": SERVERS.kafka})
    name = f"dc_{uuid.uuid4().hex[:16]}"
    admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])[name].result(
        PATIENCE
    )
    yield name
    admin.delete_topics([name])[name].result(PATIENCE)


def produce(topic: str, keys: list[str]) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": SERVERS.kafka})
    for i, k in enumerate(keys):
        p.produce(topic, json.dumps({"id": k}).encode(), partition=i % 2)
    assert p.flush(PATIENCE) == 0


def make(topic: str, group: str, store: Any, handler: Any) -> KafkaDedupLoop:
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": SERVERS.kafka,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            # A short session: a group's first join waits a part of it on some brokers.
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
        }
    )
    loop = KafkaDedupLoop(
        consumer,
        store,
        handler,
        namespace=NS,
        key=lambda body, headers: json.loads(body)["id"],
        batch_size=100,
        poll_timeout=0.5,
        retry_delay=0.0,
    )
    loop.subscribe([topic])
    return loop


def run_until(loop: KafkaDedupLoop, messages: int) -> BatchReport:
    """Batches until ``messages`` were consumed; their reports summed."""
    total = BatchReport()
    deadline = time.monotonic() + PATIENCE
    while total.messages < messages:
        assert time.monotonic() < deadline, f"only {total.messages} of {messages} consumed"
        r = loop.run_once()
        total.messages += r.messages
        total.new += r.new
        total.duplicate += r.duplicate
        total.committed.update(r.committed)
    return total


def test_claims_commits_and_a_replay_is_all_duplicates(topic: str, tmp_path: Path) -> None:
    from confluent_kafka import TopicPartition

    store = DedupStore.open(tmp_path / "store")
    try:
        produce(topic, ["a", "b", "a", "c", "b", "d"])
        calls: list[Any] = []
        loop = make(topic, f"g_{uuid.uuid4().hex}", store, lambda d: calls.append(d.key))
        report = run_until(loop, 6)
        assert (report.new, report.duplicate) == (4, 2)
        assert report.committed == {(topic, 0): 3, (topic, 1): 3}
        parts = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        committed = loop.consumer.committed(parts, timeout=PATIENCE)
        assert sorted(p.offset for p in committed) == [3, 3]
        loop.close()
        assert sorted(calls) == ["a", "b", "c", "d"]

        replay = make(topic, f"g_{uuid.uuid4().hex}", store, lambda d: calls.append(d.key))
        assert run_until(replay, 6).duplicate == 6
        replay.close()
        assert len(calls) == 4
    finally:
        store.close()


def test_stop_finishes_the_message_in_flight(topic: str, tmp_path: Path) -> None:
    store = DedupStore.open(tmp_path / "store")
    try:
        produce(topic, ["a", "x", "b", "y"])  # partition 0: a, b; partition 1: x, y
        blocking = FirstBlocks("a", PATIENCE)
        group = f"g_{uuid.uuid4().hex}"
        loop = make(topic, group, store, blocking)
        runner = threading.Thread(target=loop.run)
        runner.start()
        assert blocking.started.wait(PATIENCE)
        answer: list[bool] = []
        stopper = threading.Thread(target=lambda: answer.append(loop.stop(timeout=PATIENCE)))
        stopper.start()
        assert loop._stop.asked.wait(PATIENCE)
        blocking.release.set()
        stopper.join(PATIENCE)
        runner.join(PATIENCE)
        assert answer == [True] and not runner.is_alive()
        assert "b" not in blocking.calls  # nothing after "a" in its partition ran
        rec = store.get("a", namespace=NS)
        assert rec is not None and rec.state is State.PROCESSED
        loop.close()

        again = make(topic, group, store, blocking)  # the same group: from its commits
        run_until(again, 1)
        deadline = time.monotonic() + PATIENCE
        while sorted(set(blocking.calls)) != ["a", "b", "x", "y"]:
            assert time.monotonic() < deadline, blocking.calls
            again.run_once()
        again.close()
        assert blocking.calls.count("a") == 1  # not applied again
    finally:
        store.close()
