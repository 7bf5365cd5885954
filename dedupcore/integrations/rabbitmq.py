"""RabbitMQ consumers that claim before the handler and ack after it (pika and aio-pika).

Both consumers take either a claim store (anything implementing
:class:`~dedupcore.api.ClaimAPI`: :class:`~dedupcore.DedupStore`,
:class:`~dedupcore.Client`, the Redis and SQL tiers, or, for aio-pika,
:class:`dedupcore.aio.Client`) or a :class:`TransactionalTable` (the dedup
row commits in the business database's transaction), and apply the same
contract to every delivery:

1. **Key.** ``key(body, headers)`` (a business id from the body), else the
   header named ``key_header``, else the AMQP ``message_id`` property. A
   business id is preferred: a producer that retries publishes a new message
   with the same business id (aio-pika also gives every published message a
   random ``message_id`` of its own, so that fallback then dedups
   redeliveries only, never re-sends). A returned ``int`` is used as its
   decimal string. A message without a key (or whose key the store refuses as too
   long or of the wrong type) is ``basic_reject(requeue=False)``-ed: the
   queue's dead-letter exchange receives it if one is configured, otherwise
   RabbitMQ drops it; it is logged either way.
2. **Claim** before the handler.

   - ``NEW``: the handler runs; on success the claim is completed and then
     the message is acked. If the handler raises, the claim is released
     (so a redelivery runs it again, it was not processed) and the message
     is nacked with ``requeue=True`` after ``retry_delay`` seconds.
   - ``DUPLICATE``: acked without calling the handler.
   - ``IN_PROGRESS`` (another consumer holds the key, e.g. a producer
     duplicate delivered to two consumers at once, or the redelivery of a
     message whose first consumer died and whose lease has not run out):
     nacked with ``requeue=True`` after ``retry_delay`` seconds.
   - The store is unavailable: as ``IN_PROGRESS`` (fail closed: the handler
     never runs on an undecided claim).

3. **Delays.** AMQP 0-9-1 has no "nack with delay". The consumer holds the
   message unacked for ``retry_delay`` seconds and then nacks it with
   ``requeue=True`` (pika: ``connection.call_later`` on the connection's own
   loop, so the consumer goes on with other messages and heartbeats while
   it waits; aio-pika: a task on the event loop). The held message takes
   one slot of the channel's prefetch window meanwhile. Where a longer or
   durable delay is wanted, use a delayed-retry topology instead: pass
   ``failure_requeue=False`` so that failures are rejected to a dead-letter
   exchange whose queue has an ``x-message-ttl`` and dead-letters back into
   the work queue.
4. **Dead-lettering after N failures is the broker's job.** A requeued
   message comes back forever on a classic queue. Declare the queue as a
   quorum queue with ``x-delivery-limit`` (and ``x-dead-letter-exchange``):
   RabbitMQ counts the redeliveries and dead-letters the message after the
   limit. Nothing is counted here.

**Store mode and crashes.** The effect and the completion are two steps:
a consumer killed after its handler's effect and before ``complete`` leaves
a PROCESSING record; the redelivery waits for the lease to end (nacked as
IN_PROGRESS until then) and then runs the handler again. A consumer killed
after ``complete`` and before the ack is safe: the redelivery is a
DUPLICATE and is acked. When the effect is a database write, use
:class:`TransactionalTable` instead: the dedup row and the business writes
commit in one transaction, so a kill at any point leaves either both or
neither, and the redelivery of a committed message is a DUPLICATE.

**Table mode.** ``TransactionalTable(conn)`` uses
:func:`dedupcore.patterns.table.consume` on the DB-API connection ``conn``;
the handler receives ``delivery.conn`` (the same connection, inside the open
transaction) and ``delivery.consumption`` and must make its business writes
on that connection without committing: they commit together with the dedup
row when the handler returns, and roll back with it when it raises. There
is no ``IN_PROGRESS`` in table mode: a second transaction inserting the same
key waits for the first one's commit (then DUPLICATE) or rollback (then
NEW). One connection runs one transaction at a time; run more consumer
processes (or channels with a connection each) for parallelism.

Example (pika)::

    store = dedupcore.Client("/run/dedupcore/dedupcore.sock")
    consumer = DedupConsumer(store, handle, namespace="transfers/ledger",
                             key=lambda body, headers: json.loads(body)["transfer_id"])
    channel.basic_qos(prefetch_count=50)
    consumer.consume(channel, "transfers")
    channel.start_consuming()

The pieces every integration shares (:class:`Delivery`,
:class:`TransactionalTable`, key derivation and the gates that run the
contract) live in :mod:`dedupcore.integrations._common` and are re-exported
here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from dedupcore.integrations._common import (
    BeforeAck,
    Delivery,
    KeyFunc,
    MissingKeyError,
    Store,
    TransactionalTable,
    Verdict,
    _AsyncGate,
    _Consumer,
    _Gate,
    derive_key,
    log,
)

__all__ = [
    "AsyncDedupConsumer",
    "DedupConsumer",
    "Delivery",
    "KeyFunc",
    "MissingKeyError",
    "TransactionalTable",
    "Verdict",
    "derive_key",
]

# -- pika ------------------------------------------------------------------------------


def _pika_headers(properties: Any) -> Mapping[str, Any]:
    headers = getattr(properties, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


class DedupConsumer(_Consumer[_Gate]):
    """A pika ``on_message_callback`` that runs the dedup contract (see the module doc).

    ``store`` is a :class:`~dedupcore.api.ClaimAPI` store or a
    :class:`TransactionalTable`. ``handler(delivery)`` does the work; its
    return value is ignored. ``before_ack(delivery, outcome)`` is called
    after the decision is durable and before the ack (metrics, tests).
    ``counts`` tallies the :class:`Verdict` of every delivery.

    Works with a ``BlockingConnection`` channel and a ``SelectConnection``
    channel alike; delayed nacks are scheduled on the connection's loop.
    """

    def __init__(
        self,
        store: Store,
        handler: Callable[[Delivery], Any],
        *,
        namespace: str,
        key: KeyFunc | None = None,
        key_header: str | None = None,
        retry_delay: float = 1.0,
        failure_requeue: bool = True,
        lease: float | None = None,
        owner: bytes | str | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None:
        super().__init__(
            _Gate,
            store,
            handler,
            namespace=namespace,
            key=key,
            key_header=key_header,
            retry_delay=retry_delay,
            lease=lease,
            owner=owner,
            before_ack=before_ack,
        )
        self.failure_requeue = failure_requeue

    def consume(self, channel: Any, queue: str, **kwargs: Any) -> str:
        """``channel.basic_consume(queue, self.on_message, **kwargs)`` (manual acks); the tag."""
        if kwargs.get("auto_ack"):
            raise ValueError("auto_ack=True would ack before the claim; the consumer acks itself")
        tag: str = channel.basic_consume(queue, self.on_message, **kwargs)
        return tag

    def on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        """The pika callback: decide, then ack, nack later or reject."""
        verdict = self.handle(channel, method, properties, body)
        self.counts[verdict] += 1
        tag = method.delivery_tag
        if verdict is Verdict.ACKED:
            channel.basic_ack(tag)
        elif verdict is Verdict.INVALID:
            channel.basic_reject(tag, requeue=False)
        elif verdict is Verdict.FAILED and not self.failure_requeue:
            channel.basic_nack(tag, requeue=False)
        else:
            self._nack_later(channel, tag)

    def handle(self, channel: Any, method: Any, properties: Any, body: bytes) -> Verdict:
        """The decision for one delivery, without acking it."""
        headers = _pika_headers(properties)
        message_id = getattr(properties, "message_id", None)
        try:
            k = derive_key(body, headers, message_id, key=self.key, key_header=self.key_header)
        except MissingKeyError as exc:
            log.error("rejecting message (delivery tag %s): %s", method.delivery_tag, exc)
            return Verdict.INVALID
        delivery = Delivery(
            body=body,
            headers=headers,
            key=k,
            namespace=self.namespace,
            message_id=message_id,
            redelivered=bool(getattr(method, "redelivered", False)),
            raw=(channel, method, properties),
        )
        return self._gate.decide(delivery)

    def _nack_later(self, channel: Any, tag: int) -> None:
        def nack() -> None:
            if channel.is_open:
                channel.basic_nack(tag, requeue=True)

        if self.retry_delay <= 0:
            nack()
            return
        conn = channel.connection
        ioloop = getattr(conn, "ioloop", None)
        if ioloop is not None:  # SelectConnection and friends
            ioloop.call_later(self.retry_delay, nack)
        else:  # BlockingConnection: runs inside process_data_events / start_consuming
            conn.call_later(self.retry_delay, nack)


# -- aio-pika --------------------------------------------------------------------------


class AsyncDedupConsumer(_Consumer[_AsyncGate]):
    """An aio-pika consumer callback that runs the dedup contract (see the module doc).

    ``store`` may also be a :class:`dedupcore.aio.Client`; ``handler`` may be
    ``async def`` (except in table mode). Deliveries of one channel are
    handled concurrently up to its prefetch count, as aio-pika runs them;
    two deliveries of one key at once are told apart (the second is
    retried later, never run twice).
    """

    def __init__(
        self,
        store: Store | Any,
        handler: Callable[[Delivery], Any] | Callable[[Delivery], Awaitable[Any]],
        *,
        namespace: str,
        key: KeyFunc | None = None,
        key_header: str | None = None,
        retry_delay: float = 1.0,
        failure_requeue: bool = True,
        lease: float | None = None,
        owner: bytes | str | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None:
        super().__init__(
            _AsyncGate,
            store,
            handler,
            namespace=namespace,
            key=key,
            key_header=key_header,
            retry_delay=retry_delay,
            lease=lease,
            owner=owner,
            before_ack=before_ack,
        )
        self.failure_requeue = failure_requeue
        self._later: set[asyncio.Task[None]] = set()

    async def consume(self, queue: Any, **kwargs: Any) -> str:
        """``await queue.consume(self.on_message, **kwargs)`` (manual acks); the tag."""
        if kwargs.get("no_ack"):
            raise ValueError("no_ack=True would ack before the claim; the consumer acks itself")
        tag: str = await queue.consume(self.on_message, **kwargs)
        return tag

    async def on_message(self, message: Any) -> None:
        """The aio-pika callback: decide, then ack, nack later or reject."""
        verdict = await self.handle(message)
        self.counts[verdict] += 1
        if verdict is Verdict.ACKED:
            await message.ack()
        elif verdict is Verdict.INVALID:
            await message.reject(requeue=False)
        elif verdict is Verdict.FAILED and not self.failure_requeue:
            await message.nack(requeue=False)
        elif self.retry_delay <= 0:
            await message.nack(requeue=True)
        else:
            task = asyncio.create_task(self._nack_later(message))
            self._later.add(task)
            task.add_done_callback(self._later.discard)

    async def handle(self, message: Any) -> Verdict:
        """The decision for one delivery, without acking it."""
        headers = message.headers if isinstance(message.headers, Mapping) else {}
        body = bytes(message.body)
        try:
            k = derive_key(
                body, headers, message.message_id, key=self.key, key_header=self.key_header
            )
        except MissingKeyError as exc:
            log.error("rejecting message (delivery tag %s): %s", message.delivery_tag, exc)
            return Verdict.INVALID
        delivery = Delivery(
            body=body,
            headers=headers,
            key=k,
            namespace=self.namespace,
            message_id=message.message_id,
            redelivered=bool(message.redelivered),
            raw=message,
        )
        return await self._gate.adecide(delivery)

    async def _nack_later(self, message: Any) -> None:
        await asyncio.sleep(self.retry_delay)
        try:
            await message.nack(requeue=True)
        except Exception as exc:  # the channel closed meanwhile: the broker requeues it
            log.info("delayed nack not sent (%s); the broker redelivers the message", exc)
