"""NATS JetStream pull consumers that claim before the handler and ack after it (nats-py).

:class:`JetStreamConsumer` takes a claim store (any
:class:`~dedupcore.api.ClaimAPI` store, or :class:`dedupcore.aio.Client`)
or a :class:`~dedupcore.integrations.rabbitmq.TransactionalTable`, and
applies the contract of :mod:`dedupcore.integrations.rabbitmq` with
JetStream's own replies:

- **Key**: ``key(body, headers)`` (a business id), else the header
  ``key_header``, else the ``Nats-Msg-Id`` header the producer set. JetStream
  itself drops a re-publish with the same ``Nats-Msg-Id`` inside the
  stream's ``duplicate_window``; dedupcore covers what that does not: retries
  after the window, re-sends with a new id (an outbox replayed after a
  restart) and redeliveries to consumers. A message without a key is
  ``term()``-ed (never redelivered) and logged.
- ``NEW``: the handler runs, the claim is completed, then ``ack()``. If the
  handler raises, the claim is released and the message is
  ``nak(delay=retry_delay)``-ed.
- ``DUPLICATE``: ``ack()`` without calling the handler.
- ``IN_PROGRESS`` or a store that cannot answer: ``nak(delay=retry_delay)``.

**Dead-lettering is the server's job.** Set ``max_deliver`` on the consumer:
after that many deliveries JetStream stops redelivering the message and
publishes the advisory ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``
(its ``stream_seq`` names the message; a dead-letter process subscribes to
it and copies the message out of the stream with ``get_msg``). Nothing is
counted here. A termed message publishes ``...CONSUMER.MSG_TERMINATED...``.

**ack_wait and lease.** A consumer that dies leaves its messages unacked;
JetStream redelivers them after the consumer's ``ack_wait``. A redelivery
while the first delivery still runs (a handler slower than ``ack_wait``)
meets an IN_PROGRESS claim and is nak'ed with a delay, so keep ``lease``
above the handler's longest run and ``ack_wait`` near it.

**Stopping.** ``consumer.stop()`` (from a signal handler or any thread) or
``await consumer.astop()`` makes :meth:`JetStreamConsumer.run` finish the
message being handled (handler, complete, ack), ``nak()`` the rest of its
batch unstarted (JetStream redelivers them at once) and return; a fetch
under way ends within ``fetch_timeout`` first. Idempotent and final.

**Table mode** (``TransactionalTable(conn)``): the handler (a plain
function) runs in a worker thread inside the dedup transaction and writes on
``delivery.conn``; the dedup row and the business writes commit together, so
a consumer killed between that commit and the ack is safe: the redelivery
finds the row, is a DUPLICATE and is acked.

Example::

    js = nc.jetstream()
    sub = await js.pull_subscribe("transfers.>", durable="ledger", stream="TRANSFERS")
    consumer = JetStreamConsumer(store, handle, namespace="transfers/ledger",
                                 key=lambda body, headers: json.loads(body)["transfer_id"])
    await consumer.run(sub, batch=50)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from dedupcore.integrations._common import (
    ConsumerOptions,
    Delivery,
    MissingKeyError,
    Store,
    TransactionalTable,
    Verdict,
    _AsyncGate,
    _AsyncStop,
    _Consumer,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "MSG_ID_HEADER",
    "Delivery",
    "JetStreamConsumer",
    "MissingKeyError",
    "TransactionalTable",
    "Verdict",
]

log = logging.getLogger("dedupcore.integrations")

#: The header JetStream deduplicates publishes on; the key of last resort here.
MSG_ID_HEADER = "Nats-Msg-Id"


class JetStreamConsumer(_AsyncStop, _Consumer[_AsyncGate]):
    """Runs the dedup contract over messages of a JetStream pull subscription.

    ``handler(delivery)`` may be ``async def`` (except in table mode).
    ``before_ack(delivery, outcome)`` is called after the decision is durable
    and before the ack. With ``ack_sync=True`` each ack waits for the
    server's confirmation (``ack_sync``). ``counts`` tallies the
    :class:`~dedupcore.integrations.rabbitmq.Verdict` of every message. The other
    keywords are those of :class:`~dedupcore.integrations.ConsumerOptions`
    (``namespace``, ``key``, ``key_header``, ``retry_delay``, ``lease``, ``owner``,
    ``before_ack``, ``retry``).
    """

    def __init__(
        self,
        store: Store | Any,
        handler: Callable[[Delivery], Any] | Callable[[Delivery], Awaitable[Any]],
        *,
        ack_sync: bool = False,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(_AsyncGate, store, handler, **options)
        self.ack_sync = ack_sync
        self._running: asyncio.Future[None] | None = None

    async def handle(self, msg: Any) -> Verdict:
        """The decision for one message, without replying to it."""
        headers: Mapping[str, Any] = msg.headers or {}
        redelivered = False
        with contextlib.suppress(Exception):  # a plain NATS message has no JetStream metadata
            redelivered = msg.metadata.num_delivered > 1
        delivery = self._delivery(
            bytes(msg.data),
            headers,
            headers.get(MSG_ID_HEADER),
            redelivered=redelivered,
            raw=msg,
            refusal=f"terminating message on {msg.subject}",
        )
        if delivery is None:
            return Verdict.INVALID
        return await self._gate.adecide(delivery)

    async def process(self, msg: Any) -> Verdict:
        """Decides one message, then ``ack``, ``nak(delay)`` or ``term`` it."""
        verdict = await self.handle(msg)
        self.counts[verdict] += 1
        if verdict is Verdict.ACKED:
            if self.ack_sync:
                await msg.ack_sync()
            else:
                await msg.ack()
        elif verdict is Verdict.INVALID:
            await msg.term()
        else:
            await msg.nak(delay=self.retry_delay if self.retry_delay > 0 else None)
        return verdict

    async def run(
        self,
        sub: Any,
        *,
        batch: int = 10,
        fetch_timeout: float = 1.0,
        stop: asyncio.Event | None = None,
        max_idle: float | None = None,
    ) -> None:
        """Fetches and processes batches from the pull subscription ``sub``.

        Runs until ``stop`` is set, :meth:`stop`/:meth:`astop` is called, or
        ``max_idle`` seconds pass without a message when given. Messages of a
        batch are processed in order, one at a time. On a stop, the message
        in flight is finished (handler, complete, ack) and the rest of its
        batch is ``nak()``-ed without being started, so JetStream
        redelivers them at once; a fetch under way when the stop is asked
        ends within ``fetch_timeout``, and what it brings is nak-ed too.
        """
        from nats.errors import TimeoutError as NatsTimeout

        if self._stop.asked.is_set():
            return  # stopped (a stop is final): nothing is fetched
        loop = asyncio.get_running_loop()
        if self._running is not None:
            raise RuntimeError("run() is already running for this consumer")
        self._loop = loop
        self._running = loop.create_future()
        self._stop.begin()
        try:
            last = loop.time()
            while not self._stop.asked.is_set() and (stop is None or not stop.is_set()):
                try:
                    msgs = await sub.fetch(batch, timeout=fetch_timeout)
                except (NatsTimeout, asyncio.TimeoutError):
                    if max_idle is not None and loop.time() - last >= max_idle:
                        return
                    continue
                last = loop.time()
                for i, msg in enumerate(msgs):
                    if self._stop.asked.is_set():
                        await self._put_back(msgs[i:])
                        break
                    await self.process(msg)
        finally:
            running, self._running = self._running, None
            running.set_result(None)
            self._stop.end()

    async def _put_back(self, msgs: list[Any]) -> None:
        """Messages of a batch not started when the consumer stops: redelivered at once."""
        for msg in msgs:
            try:
                await msg.nak()
            except Exception as exc:  # not acked either way: redelivered after ack_wait
                log.info("stop: nak not sent (%s); redelivered after ack_wait", exc)

    async def _graceful_stop(self) -> None:
        """Waits until :meth:`run` has finished its message in flight and returned."""
        running = self._running
        if running is not None:
            await asyncio.shield(running)
