"""A stand-in for ``confluent_kafka.Consumer``: the method shapes KafkaDedupLoop uses, in memory.

No Kafka broker runs here. The stand-in keeps per-partition logs, committed
offsets, positions, paused partitions and pending rebalances; rebalance
callbacks run inside ``consume`` (and ``close``), as librdkafka runs them
inside ``poll``/``consume``. Messages have the methods of
``confluent_kafka.Message``; partitions are real ``confluent_kafka.TopicPartition``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

TP = tuple[str, int]


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
class Cluster:
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

    def __init__(self, cluster: Cluster) -> None:
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
                raise KafkaException(f"partition {tp} is not assigned")
            done[tp] = p.offset
        self.calls.append("commit")
        self.commits.append(done)
        self.cluster.committed.update(done)

    def seek(self, partition: TopicPartition) -> None:
        tp = (partition.topic, partition.partition)
        if tp not in self.assigned:
            raise KafkaException(f"partition {tp} is not assigned")
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
            parts = [TopicPartition(t, p) for t, p in tps]
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
