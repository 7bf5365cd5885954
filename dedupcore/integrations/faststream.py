"""A FastStream middleware that runs a subscriber's handler once per message key.

:class:`DedupMiddleware` goes where FastStream takes middlewares (a router's
or a broker's ``middlewares=[...]``; FastStream 0.6 and later have none per
subscriber) and applies the contract of :mod:`dedupcore.integrations` around
each handler call, on the RabbitMQ, NATS JetStream and Kafka brokers of
FastStream. docs/faststream.md is the user's guide; in short:

==================  ====================================================================
claim outcome       what the middleware does
==================  ====================================================================
NEW                 runs the handler, completes the key (or commits the dedup
                    transaction), returns the handler's result: the subscriber's ack
                    policy acks the message
DUPLICATE           acks the message; the handler does not run and nothing is published
IN_PROGRESS         redelivers the message ``retry_delay`` seconds later: NATS
                    ``nak(delay=retry_delay)``; RabbitMQ ``nack(requeue=True)`` and
                    Kafka ``nack()`` (a seek back to the message) after ``retry_delay``
handler raised      releases the key (rolls the transaction back) and re-raises: the
                    ack policy decides (``NACK_ON_ERROR`` redelivers, ``REJECT_ON_ERROR``
                    dead-letters)
no usable key       rejects the message (RabbitMQ ``reject(requeue=False)``, NATS
                    ``term()``, Kafka: committed past) and logs why
store unavailable   as IN_PROGRESS: the handler never runs on an undecided claim
==================  ====================================================================

**The key** is ``key(body, headers)`` (a business id), else the header
``key_header``, else the message id the producer set: RabbitMQ's
``message_id`` property, NATS's ``Nats-Msg-Id`` header (else FastStream's
``message_id`` header). Kafka records have no producer's id (FastStream's
is made of the offset and the timestamp, the same in two partitions), so a
Kafka subscriber needs ``key`` or ``key_header``.

**The store** is a claim store, awaited when it is an
:class:`~dedupcore.api.AsyncClaimAPI` (:class:`dedupcore.aio.Client`) and
run in a worker thread otherwise, or a
:class:`~dedupcore.integrations.TransactionalTable`: then the handler runs
while a worker thread holds the dedup transaction open, writes on
``delivery.conn`` and does not commit; the dedup row commits with those
writes after the handler returns, before the ack.

**The handler sees the delivery** as FastStream context ``"dedup"``
(``dedup: Delivery = Context("dedup")``): the key, the NEW claim or the
transaction's connection.

**Ack policies.** ``AckPolicy.ACK_FIRST`` (and a Kafka subscriber's default,
auto-commit) settles the message before the handler runs, so nothing could
redeliver it; the middleware refuses such messages (a ``RuntimeError`` for
each) rather than lose them quietly. Use ``ACK``, ``NACK_ON_ERROR`` or
``REJECT_ON_ERROR``. With ``MANUAL`` the middleware still settles what it
decides (duplicates, redeliveries, refusals) and the handler the rest.

**Single messages only.** A batch subscriber's message is refused with a
``TypeError``: claim each message of a batch yourself (``claim_many``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dedupcore._checks import extra_imports
from dedupcore.api import Outcome
from dedupcore.integrations._common import (
    ConsumerOptions,
    Delivery,
    Store,
    TransactionalTable,
    Verdict,
    _AsyncGate,
    _Consumer,
)

with extra_imports("faststream", "faststream", "dedupcore.integrations.faststream"):
    from faststream import BaseMiddleware
    from faststream.exceptions import AckMessage, NackMessage, RejectMessage
    from faststream.middlewares import AckPolicy

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["CONTEXT_KEY", "DedupMiddleware", "Delivery"]

log = logging.getLogger("dedupcore.integrations.faststream")

#: The name of the FastStream context entry that holds the handler's :class:`Delivery`.
CONTEXT_KEY = "dedup"


@dataclass
class _Call:
    """The FastStream side of one delivery: what runs the handler, and what it gave."""

    call_next: Callable[[Any], Awaitable[Any]]
    message: Any
    loop: asyncio.AbstractEventLoop
    result: Any = None
    error: BaseException | None = None

    async def run(self) -> None:
        try:
            self.result = await self.call_next(self.message)
        except BaseException as exc:
            self.error = exc
            raise


#: The call of the delivery being decided: the gate hands the handler only the delivery,
#: and a worker thread (table mode) sees the context it was started from.
_current: contextvars.ContextVar[_Call] = contextvars.ContextVar("dedupcore_faststream_call")


async def _handler_on_loop(delivery: Delivery) -> None:
    await _current.get().run()


def _handler_in_thread(delivery: Delivery) -> None:
    """Runs the handler on the event loop while this worker thread holds the transaction."""
    call = _current.get()
    asyncio.run_coroutine_threadsafe(call.run(), call.loop).result()


def _message_id(message: Any) -> str | None:
    """The id the producer gave the message, or None where FastStream makes one up."""
    rabbit = sys.modules.get("faststream.rabbit.message")
    if rabbit is not None and isinstance(message, rabbit.RabbitMessage):
        found: str | None = message.raw_message.message_id
        return found
    nats = sys.modules.get("faststream.nats.message")
    if nats is not None and isinstance(message, nats.NatsMessage):
        headers = message.headers
        found = headers.get("Nats-Msg-Id") or headers.get("message_id")
        return found
    return None


def _delays_natively(message: Any) -> bool:
    """Whether the broker redelivers a nack'ed message after a delay it is given (NATS)."""
    nats = sys.modules.get("faststream.nats.message")
    return nats is not None and isinstance(message, nats.NatsMessage)


class DedupMiddleware(_Consumer[_AsyncGate]):
    """FastStream middleware: a subscriber's handler runs once per key (see the module doc).

    ``store``: a claim store, :class:`dedupcore.aio.Client`, or a
    :class:`~dedupcore.integrations.TransactionalTable`. ``namespace`` names
    the consumer of record: give each consumer its own middleware, on a
    router of its subscribers. ``key``/``key_header``: where the key is
    (default: the producer's message id). ``lease``: seconds a claim is
    held (default: the store's); a handler running longer can be taken
    over. ``retry_delay``: seconds before an IN_PROGRESS message comes back.
    ``before_ack(delivery, outcome)`` (plain or async) runs once the
    decision is durable, before the ack. ``owner``: the claims' owner; ``retry``:
    the retry policy of completions. These are the keywords of
    :class:`~dedupcore.integrations.ConsumerOptions`. ``counts`` tallies the
    :class:`~dedupcore.integrations.Verdict` of every message.
    """

    def __init__(
        self,
        store: Store | Any,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        table = isinstance(store, TransactionalTable)
        handler = _handler_in_thread if table else _handler_on_loop
        super().__init__(_AsyncGate, store, handler, **options)

    def __call__(self, msg: Any, /, *, context: Any) -> _Scope:
        """The middleware of one message (FastStream calls this for each)."""
        return _Scope(msg, context=context, dedup=self)

    async def decide(
        self, call_next: Callable[[Any], Awaitable[Any]], message: Any, context: Any
    ) -> Any:
        """Runs the contract for one message; the handler's result, or raises what settles it.

        ``context`` is FastStream's context repository: the delivery is its
        ``"dedup"`` entry while the handler runs.
        """
        subscriber = context.get_local("handler_")  # FastStream's name for the subscriber
        acked_first = subscriber is not None and subscriber.ack_policy is AckPolicy.ACK_FIRST
        if acked_first or message.committed is not None:
            raise RuntimeError(
                "the message was acked before its handler ran (AckPolicy.ACK_FIRST, or a "
                "Kafka subscriber's default auto-commit): nothing could redeliver it; give "
                "the subscriber ack_policy=AckPolicy.ACK, NACK_ON_ERROR or REJECT_ON_ERROR"
            )
        body = message.body
        if not isinstance(body, (bytes, bytearray)):
            raise TypeError(
                f"DedupMiddleware handles one message at a time, not a batch "
                f"({type(body).__name__} body)"
            )
        delivery = self._delivery(
            bytes(body),
            message.headers or {},
            _message_id(message),
            redelivered=False,
            raw=message,
            refusal="message rejected",
        )
        if delivery is None:
            self.counts[Verdict.INVALID] += 1
            await message.reject()
            raise RejectMessage
        call = _Call(call_next, message, asyncio.get_running_loop())
        token = _current.set(call)
        try:
            with context.scope(CONTEXT_KEY, delivery):
                verdict = await self._gate.adecide(delivery)
        finally:
            _current.reset(token)
        self.counts[verdict] += 1
        if verdict is Verdict.ACKED:
            if delivery.outcome is Outcome.NEW:
                return call.result
            await message.ack()
            raise AckMessage
        if verdict is Verdict.INVALID:
            await message.reject()
            raise RejectMessage
        if verdict is Verdict.FAILED and call.error is not None:
            raise call.error  # the ack policy decides, as without the middleware
        # IN_PROGRESS, an unavailable store, or a dedup transaction that failed.
        if _delays_natively(message):
            await message.nack(delay=self.retry_delay)
        else:
            await asyncio.sleep(self.retry_delay)
            await message.nack()
        raise NackMessage


class _Scope(BaseMiddleware):
    """The middleware FastStream makes for one message."""

    def __init__(self, msg: Any, /, *, context: Any, dedup: DedupMiddleware) -> None:
        super().__init__(msg, context=context)
        self.dedup = dedup

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
        return await self.dedup.decide(call_next, msg, self.context)
