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

**Stopping.** ``consumer.stop()`` (both consumers; ``await
consumer.astop()`` for aio-pika) lets the message being handled finish --
handler, complete, ack -- then cancels its ``basic_consume`` subscriptions;
deliveries not yet started go back to the queue unacked (pika's
``BlockingChannel`` nacks what it had buffered; a delivery that still
arrives is nacked with ``requeue=True`` unstarted) and messages held for a
delayed nack are nacked at once. It is idempotent and final, and safe from
a signal handler or another thread (pika: the cancel runs on the
connection's thread through ``add_callback_threadsafe``, and
``start_consuming()`` returns once its channel has no consumer left)::

    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    consumer.consume(channel, "transfers")
    channel.start_consuming()        # returns after the message in flight

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
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from dedupcore.integrations._common import (
    ConsumerOptions,
    Delivery,
    KeyFunc,
    MissingKeyError,
    Store,
    TransactionalTable,
    Verdict,
    _AsyncGate,
    _AsyncStop,
    _check_timeout,
    _Consumer,
    _Gate,
    derive_key,
    log,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

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

    The keywords are those of :class:`~dedupcore.integrations.ConsumerOptions`
    (``namespace``, ``key``, ``key_header``, ``retry_delay``, ``lease``, ``owner``,
    ``before_ack``, ``retry``) and ``failure_requeue`` (default True; False nacks a
    message whose handler raised without requeueing it, to the dead-letter exchange).

    Works with a ``BlockingConnection`` channel and a ``SelectConnection``
    channel alike; delayed nacks are scheduled on the connection's loop.
    """

    def __init__(
        self,
        store: Store,
        handler: Callable[[Delivery], Any],
        *,
        failure_requeue: bool = True,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(_Gate, store, handler, **options)
        self.failure_requeue = failure_requeue
        self._lock = threading.Lock()
        self._consumers: list[tuple[Any, str]] = []  # (channel, consumer tag)
        self._held: dict[tuple[int, int], tuple[Any, int, Callable[[], None]]] = {}

    def consume(self, channel: Any, queue: str, **kwargs: Any) -> str:
        """``channel.basic_consume(queue, self.on_message, **kwargs)`` (manual acks); the tag."""
        if kwargs.get("auto_ack"):
            raise ValueError("auto_ack=True would ack before the claim; the consumer acks itself")
        if self._stop.asked.is_set():
            raise RuntimeError("the consumer was stopped; make a new one to consume again")
        tag: str = channel.basic_consume(queue, self.on_message, **kwargs)
        with self._lock:
            self._consumers.append((channel, tag))
            self._stop.begin()
        return tag

    def stop(self, timeout: float | None = None) -> bool:
        """Stops gracefully: the message in flight finishes, nothing after it starts.

        The message being handled is finished (handler, complete, ack); then
        every ``basic_consume`` of this consumer is cancelled (pika's
        ``BlockingChannel`` nacks the deliveries it had buffered, so they go
        back to the queue; a delivery that still reaches ``on_message`` is
        nacked with ``requeue=True`` without being started), messages held
        for a delayed nack are nacked at once, and
        ``channel.start_consuming()`` returns once no consumer is left on
        its channel. Idempotent; safe from a signal handler and from any
        thread (the cancel runs on the connection's thread, through
        ``add_callback_threadsafe``). From another thread it waits up to
        ``timeout`` seconds for the stop and returns True once it is done;
        on the connection's own thread (a signal handler, the handler) it
        cannot wait: it returns False and the stop happens when the
        connection next processes events.
        """
        _check_timeout(timeout)
        if self._stop.ask():
            with self._lock:
                connections = {id(ch.connection): ch.connection for ch, _ in self._consumers}
            for conn in connections.values():
                cancel = functools.partial(self._cancel, conn)
                try:
                    ioloop = getattr(conn, "ioloop", None)
                    if ioloop is not None:  # SelectConnection and friends
                        ioloop.add_callback_threadsafe(cancel)
                    else:
                        conn.add_callback_threadsafe(cancel)
                except Exception as exc:  # the connection is closed: nothing consumes
                    log.info("stop: connection already closed (%s)", exc)
                    self._cancel(conn, closed=True)
            if not connections:
                self._stop.end()
        return self._stop.wait(timeout)

    def _cancel(self, conn: Any, closed: bool = False) -> None:
        """Cancels this consumer's consumption on ``conn`` (on the connection's thread)."""
        with self._lock:
            mine = [(ch, tag) for ch, tag in self._consumers if ch.connection is conn]
            self._consumers = [c for c in self._consumers if c not in mine]
            held = [h for k, h in self._held.items() if h[0].connection is conn]
            for ch, delivery_tag, _ in held:
                self._held.pop((id(ch), delivery_tag), None)
        if not closed:
            for ch, tag in mine:
                try:
                    if ch.is_open:
                        ch.basic_cancel(tag)
                except Exception as exc:
                    log.warning("stop: could not cancel consumer %s (%s)", tag, exc)
            for ch, delivery_tag, unschedule in held:
                unschedule()
                try:
                    if ch.is_open:
                        ch.basic_nack(delivery_tag, requeue=True)
                except Exception as exc:  # the broker requeues it when the channel closes
                    log.info("stop: nack of a held message not sent (%s)", exc)
        with self._lock:
            if not self._consumers:
                self._stop.end()

    def on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        """The pika callback: decide, then ack, nack later or reject."""
        if self._stop.asked.is_set():
            # Delivered before the cancel took effect: not started, back to the queue.
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
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
        delivery = self._delivery(
            body,
            _pika_headers(properties),
            getattr(properties, "message_id", None),
            redelivered=bool(getattr(method, "redelivered", False)),
            raw=(channel, method, properties),
            refusal=f"rejecting message (delivery tag {method.delivery_tag})",
        )
        if delivery is None:
            return Verdict.INVALID
        return self._gate.decide(delivery)

    def _nack_later(self, channel: Any, tag: int) -> None:
        held = (id(channel), tag)

        def nack() -> None:
            with self._lock:
                if self._held.pop(held, None) is None:
                    return  # nacked by stop() meanwhile
            if channel.is_open:
                channel.basic_nack(tag, requeue=True)

        if self.retry_delay <= 0:
            if channel.is_open:
                channel.basic_nack(tag, requeue=True)
            return
        conn = channel.connection
        ioloop = getattr(conn, "ioloop", None)
        unschedule: Callable[[], None]
        if ioloop is not None:  # SelectConnection and friends
            handle = ioloop.call_later(self.retry_delay, nack)
            unschedule = functools.partial(ioloop.remove_timeout, handle)
        else:  # BlockingConnection: runs inside process_data_events / start_consuming
            timer = conn.call_later(self.retry_delay, nack)
            unschedule = functools.partial(conn.remove_timeout, timer)
        with self._lock:
            self._held[held] = (channel, tag, unschedule)


# -- aio-pika --------------------------------------------------------------------------


class AsyncDedupConsumer(_AsyncStop, _Consumer[_AsyncGate]):
    """An aio-pika consumer callback that runs the dedup contract (see the module doc).

    ``store`` may also be a :class:`dedupcore.aio.Client`; ``handler`` may be
    ``async def`` (except in table mode). Deliveries of one channel are
    handled concurrently up to its prefetch count, as aio-pika runs them;
    two deliveries of one key at once are told apart (the second is
    retried later, never run twice). It takes the keywords of
    :class:`DedupConsumer`.
    """

    def __init__(
        self,
        store: Store | Any,
        handler: Callable[[Delivery], Any] | Callable[[Delivery], Awaitable[Any]],
        *,
        failure_requeue: bool = True,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(_AsyncGate, store, handler, **options)
        self.failure_requeue = failure_requeue
        self._later: set[asyncio.Task[None]] = set()
        self._queues: list[tuple[Any, str]] = []  # (queue, consumer tag)
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None

    async def consume(self, queue: Any, **kwargs: Any) -> str:
        """``await queue.consume(self.on_message, **kwargs)`` (manual acks); the tag."""
        if kwargs.get("no_ack"):
            raise ValueError("no_ack=True would ack before the claim; the consumer acks itself")
        if self._stop.asked.is_set():
            raise RuntimeError("the consumer was stopped; make a new one to consume again")
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError("the consumer already consumes on another event loop")
        if self._loop is None:
            self._loop, self._idle, self._wake = loop, asyncio.Event(), asyncio.Event()
            self._idle.set()
        tag: str = await queue.consume(self.on_message, **kwargs)
        self._queues.append((queue, tag))
        self._stop.begin()
        return tag

    async def _graceful_stop(self) -> None:
        """Cancels the consumption, nacks held messages now, waits for those in flight."""
        assert self._idle is not None and self._wake is not None
        queues, self._queues = self._queues, []
        for queue, tag in queues:
            try:
                await queue.cancel(tag)
            except Exception as exc:  # the channel closed: nothing is delivered any more
                log.info("stop: could not cancel consumer %s (%s)", tag, exc)
        self._wake.set()  # delayed nacks go out now
        # Deliveries that arrived before the cancel's answer have their callbacks
        # scheduled by now; let them start (and count themselves in flight).
        await asyncio.sleep(0)
        await self._idle.wait()
        if self._later:
            await asyncio.gather(*self._later, return_exceptions=True)

    async def on_message(self, message: Any) -> None:
        """The aio-pika callback: decide, then ack, nack later or reject."""
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()
        try:
            if self._stop.asked.is_set():
                # Delivered before the cancel took effect: not started, back to the queue.
                await message.nack(requeue=True)
            else:
                await self._on_message(message)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def _on_message(self, message: Any) -> None:
        verdict = await self.handle(message)
        self.counts[verdict] += 1
        if verdict is Verdict.ACKED:
            await message.ack()
        elif verdict is Verdict.INVALID:
            await message.reject(requeue=False)
        elif verdict is Verdict.FAILED and not self.failure_requeue:
            await message.nack(requeue=False)
        elif self.retry_delay <= 0 or self._stop.asked.is_set():
            await message.nack(requeue=True)
        else:
            task = asyncio.create_task(self._nack_later(message))
            self._later.add(task)
            task.add_done_callback(self._later.discard)

    async def handle(self, message: Any) -> Verdict:
        """The decision for one delivery, without acking it."""
        delivery = self._delivery(
            bytes(message.body),
            message.headers if isinstance(message.headers, Mapping) else {},
            message.message_id,
            redelivered=bool(message.redelivered),
            raw=message,
            refusal=f"rejecting message (delivery tag {message.delivery_tag})",
        )
        if delivery is None:
            return Verdict.INVALID
        return await self._gate.adecide(delivery)

    async def _nack_later(self, message: Any) -> None:
        if self._wake is None:
            await asyncio.sleep(self.retry_delay)
        else:  # cut short by stop()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.retry_delay)
        try:
            await message.nack(requeue=True)
        except Exception as exc:  # the channel closed meanwhile: the broker requeues it
            log.info("delayed nack not sent (%s); the broker redelivers the message", exc)
