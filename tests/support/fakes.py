"""Fakes of the tests: a clock that moves when told, handlers that record or block, and a
stand-in for ``confluent_kafka.Consumer``.

The Kafka stand-in keeps per-partition logs, committed offsets, positions, paused
partitions and pending rebalances in memory (no broker runs); rebalance callbacks run
inside ``consume`` (and ``close``), as librdkafka runs them inside ``poll``/``consume``.
Messages have the methods of ``confluent_kafka.Message``; partitions are real
``confluent_kafka.TopicPartition`` (imported when first used, so the other fakes need
no Kafka client).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from confluent_kafka import TopicPartition

# -- time ---------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when the test moves it.

    Calling it (or :meth:`monotonic`) reads ``now``, or the next of ``readings`` when
    those are given; :meth:`sleep` moves it forward; a test may also set ``now``.
    """

    def __init__(self, now: float = 100.0, readings: Iterator[Any] | None = None) -> None:
        self.now = now
        self.readings = readings

    def __call__(self) -> Any:
        if self.readings is not None:
            return next(self.readings)
        return self.now

    def monotonic(self) -> Any:
        return self()

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


# -- handlers -------------------------------------------------------------------------------


class Recorder:
    """A handler that records its calls and can fail its first ``fail`` calls."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[Any] = []
        self.fail = fail

    def __call__(self, d: Any) -> None:
        self.calls.append(d)
        if len(self.calls) <= self.fail:
            raise RuntimeError("handler failure")

    @property
    def keys(self) -> list[Any]:
        return [d.key for d in self.calls]


class FirstBlocks:
    """A handler that records the keys it gets and blocks in the first call of ``key``.

    ``started`` is set when that call begins; it returns once ``release`` is
    set. ``__call__`` is the plain handler, ``handle_async`` the ``async
    def`` one (it waits in a worker thread, so the event loop goes on).
    """

    def __init__(self, key: str = "a", patience: float = 60.0) -> None:
        self.key = key
        self.patience = patience
        self.calls: list[Any] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def _first(self, d: Any) -> bool:
        self.calls.append(d.key)
        first = d.key == self.key and self.calls.count(self.key) == 1
        if first:
            self.started.set()
        return first

    def __call__(self, d: Any) -> None:
        if self._first(d):
            assert self.release.wait(self.patience)

    async def handle_async(self, d: Any) -> None:
        if self._first(d):
            assert await asyncio.to_thread(self.release.wait, self.patience)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, self.patience)


# -- a Kafka consumer -----------------------------------------------------------------------

TP = tuple[str, int]


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


@dataclass
class Record:
    value: bytes | None
    key: bytes | None = None
    headers: list[tuple[str, bytes]] | None = None


class Message:
    """The accessor methods of ``confluent_kafka.Message``."""

    def __init__(self, topic: str, partition: int, offset: int, rec: Record) -> None:
        self._t, self._p, self._o, self._r = topic, partition, offset, rec

    def topic(self) -> str:
        return self._t

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def key(self) -> bytes | None:
        return self._r.key

    def value(self) -> bytes | None:
        return self._r.value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._r.headers

    def error(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<Message {self._t}[{self._p}]@{self._o}>"


@dataclass
class KafkaCluster:
    """The broker side: topic partitions' logs and the group's committed offsets."""

    logs: dict[TP, list[Record]] = field(default_factory=dict)
    committed: dict[TP, int] = field(default_factory=dict)

    def produce(self, topic: str, partition: int, rec: Record) -> int:
        log = self.logs.setdefault((topic, partition), [])
        log.append(rec)
        return len(log) - 1


class StandInConsumer:
    """``subscribe``/``consume``/``commit``/``seek``/``pause``/``resume``/``close``.

    ``subscribe`` assigns every partition of the topics at the next
    ``consume``; :meth:`revoke`/:meth:`lose`/:meth:`assign` schedule
    rebalances that the next ``consume`` (or ``close``) delivers.
    """

    def __init__(self, cluster: KafkaCluster) -> None:
        self.cluster = cluster
        self.assigned: set[TP] = set()
        self.position: dict[TP, int] = {}
        self.paused: set[TP] = set()
        self.callbacks: dict[str, Callable[..., None] | None] = {}
        self.events: list[tuple[str, list[TP]]] = []
        self.calls: list[str] = []
        self.commits: list[dict[TP, int]] = []
        self.closed = False

    # -- the confluent_kafka.Consumer surface -----------------------------------------

    def subscribe(
        self,
        topics: list[str],
        on_assign: Callable[..., None] | None = None,
        on_revoke: Callable[..., None] | None = None,
        on_lost: Callable[..., None] | None = None,
    ) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        tps = sorted(tp for tp in self.cluster.logs if tp[0] in topics)
        self.events.append(("assign", tps))

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        assert not self.closed
        self.calls.append("consume")
        self._rebalance()
        out: list[Message] = []
        for tp in sorted(self.assigned - self.paused):
            log = self.cluster.logs.get(tp, [])
            while self.position[tp] < len(log) and len(out) < num_messages:
                off = self.position[tp]
                out.append(Message(tp[0], tp[1], off, log[off]))
                self.position[tp] = off + 1
        return out

    def commit(
        self,
        message: Any = None,
        offsets: list[TopicPartition] | None = None,
        asynchronous: bool = True,
    ) -> None:
        assert offsets is not None and asynchronous is False, "the loop commits explicit offsets"
        done: dict[TP, int] = {}
        for p in offsets:
            tp = (p.topic, p.partition)
            if tp not in self.assigned:
                raise _kafka().KafkaException(f"partition {tp} is not assigned")
            done[tp] = p.offset
        self.calls.append("commit")
        self.commits.append(done)
        self.cluster.committed.update(done)

    def seek(self, partition: TopicPartition) -> None:
        tp = (partition.topic, partition.partition)
        if tp not in self.assigned:
            raise _kafka().KafkaException(f"partition {tp} is not assigned")
        self.position[tp] = partition.offset

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)

    def close(self) -> None:
        if self.assigned:
            self.events.append(("revoke", sorted(self.assigned)))
        self._rebalance()
        self.closed = True

    # -- rebalances --------------------------------------------------------------------

    def revoke(self, tps: list[TP]) -> None:
        self.events.append(("revoke", tps))

    def lose(self, tps: list[TP]) -> None:
        self.events.append(("lost", tps))

    def assign(self, tps: list[TP]) -> None:
        self.events.append(("assign", tps))

    def _rebalance(self) -> None:
        while self.events:
            kind, tps = self.events.pop(0)
            parts = [_kafka().TopicPartition(t, p) for t, p in tps]
            cb = self.callbacks.get(kind)
            if kind == "assign":
                for tp in tps:
                    self.assigned.add(tp)
                    self.position[tp] = self.cluster.committed.get(tp, 0)
                if cb:
                    cb(self, parts)
            else:
                if cb:
                    cb(self, parts)
                for tp in tps:
                    self.assigned.discard(tp)
                    self.paused.discard(tp)
