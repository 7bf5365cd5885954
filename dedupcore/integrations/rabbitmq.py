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

The pieces shared by the other integrations (:class:`Delivery`,
:class:`TransactionalTable`, key derivation and the gates that run the
contract) live here too; :mod:`dedupcore.integrations.nats` and
:mod:`dedupcore.integrations.kafka` use them.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from dedupcore import keys as _keys
from dedupcore.api import Claim, ClaimAPI, Outcome
from dedupcore.errors import StaleTokenError, UnavailableError
from dedupcore.patterns.table import DEFAULT_TABLE, consume, ensure_table
from dedupcore.patterns.table import MAX_KEY_BYTES as TABLE_MAX_KEY_BYTES

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

log = logging.getLogger("dedupcore.integrations")

#: ``key(body, headers)`` -> the business id, or None when the message has none.
KeyFunc = Callable[[bytes, Mapping[str, Any]], bytes | str | int | None]
#: Called after the dedup decision is durable (completed / committed) and before the ack.
BeforeAck = Callable[["Delivery", Outcome], None]


class MissingKeyError(ValueError):
    """A message carries no dedup key (no business id, key header or message id)."""


class Verdict(enum.Enum):
    """What a consumer did with one delivery."""

    ACKED = "acked"  #: processed now (NEW) or before (DUPLICATE), then acked
    RETRY = "retry"  #: IN_PROGRESS elsewhere or the store was unavailable: redelivered later
    FAILED = "failed"  #: the handler raised: claim released / transaction rolled back, requeued
    INVALID = "invalid"  #: no usable key: rejected without requeue (dead-letter path)


@dataclass
class Delivery:
    """One message as the handler sees it.

    ``raw`` is the broker's own message object (pika: ``(channel, method,
    properties)``; aio-pika: the ``IncomingMessage``; nats-py: the ``Msg``;
    confluent-kafka: the ``Message``). In store mode ``claim`` is the NEW
    claim; in table mode ``conn`` is the connection holding the open
    transaction and ``consumption`` what :func:`~dedupcore.patterns.table.consume`
    yielded.
    """

    body: bytes
    headers: Mapping[str, Any]
    key: bytes | str
    namespace: str
    message_id: str | None = None
    redelivered: bool = False
    raw: Any = None
    claim: Claim | None = None
    conn: Any = None
    consumption: Any = None
    outcome: Outcome | None = field(default=None)


def derive_key(
    body: bytes,
    headers: Mapping[str, Any] | None,
    message_id: str | bytes | None,
    *,
    key: KeyFunc | None = None,
    key_header: str | None = None,
) -> bytes | str:
    """The dedup key of a message: ``key(body, headers)``, the ``key_header``, the message id.

    Raises :class:`MissingKeyError` (a ``ValueError``) naming what was tried
    when none gives a key, or when ``key`` itself raises.
    """
    hdrs: Mapping[str, Any] = headers or {}
    tried = []
    if key is not None:
        tried.append("key(body, headers)")
        try:
            value = key(body, hdrs)
        except Exception as exc:
            raise MissingKeyError(f"key(body, headers) raised {type(exc).__name__}: {exc}") from exc
        found = _as_key(value, "key(body, headers)")
        if found is not None:
            return found
    if key_header is not None:
        tried.append(f"header {key_header!r}")
        found = _as_key(hdrs.get(key_header), f"header {key_header!r}")
        if found is not None:
            return found
    tried.append("message id")
    found = _as_key(message_id, "message id")
    if found is not None:
        return found
    raise MissingKeyError("message has no dedup key (tried " + ", ".join(tried) + ")")


def _as_key(value: object, source: str) -> bytes | str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise MissingKeyError(f"{source} gave a bool, not a key")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (bytes, str)):
        return value if value else None
    raise MissingKeyError(f"{source} gave {type(value).__name__}; a key is str, bytes or int")


def default_owner() -> str:
    """An owner id unique to this consumer object: host, pid and a random part."""
    return f"{socket.gethostname()[:100]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class TransactionalTable:
    """Dedup mode: a dedup row in the business database, committed with the handler's writes.

    ``conn`` is a DB-API connection (psycopg 3, PyMySQL, sqlite3; autocommit
    off) used for nothing else while the consumer runs. With ``create=True``
    the table is created if absent (:func:`~dedupcore.patterns.table.ensure_table`,
    which commits). ``front`` is passed on to
    :func:`~dedupcore.patterns.table.consume` (a Bloom filter that spares the
    lookup of keys never seen).
    """

    def __init__(
        self,
        conn: Any,
        *,
        table: str = DEFAULT_TABLE,
        create: bool = True,
        front: Any = None,
    ) -> None:
        self.conn = conn
        self.table = table
        self.front = front
        if create:
            ensure_table(conn, table=table)

    def check(self, namespace: str, key: bytes | str) -> None:
        """Raises ValueError/TypeError for a key or namespace the table cannot hold."""
        _keys.check_namespace(namespace)
        _keys.check_key(key, TABLE_MAX_KEY_BYTES)

    def run(self, delivery: Delivery, handler: Callable[[Delivery], Any]) -> Outcome:
        """Runs ``handler`` inside the dedup transaction when the key is new; the outcome.

        The transaction commits when this returns; an exception from the
        handler or the database rolls it back and is re-raised.
        """
        with consume(
            self.conn, delivery.namespace, delivery.key, table=self.table, front=self.front
        ) as c:
            outcome: Outcome = c.outcome
            delivery.outcome = outcome
            if c.new:
                delivery.conn = self.conn
                delivery.consumption = c
                handler(delivery)
        return outcome


Store = Union[ClaimAPI, TransactionalTable]  # noqa: UP007 (a runtime alias on 3.10)

_STORE_ERRORS = (UnavailableError, ConnectionError, TimeoutError, OSError)


class _Gate:
    """The contract over one store, for consumers that call it from one thread at a time."""

    def __init__(
        self,
        store: Any,
        handler: Callable[[Delivery], Any],
        *,
        namespace: str,
        lease: float | None,
        owner: bytes | str | None,
        before_ack: BeforeAck | None,
        complete_retries: int = 5,
    ) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be str, not {type(namespace).__name__}")
        self.store = store
        self.handler = handler
        self.namespace = namespace
        self.lease = lease
        self.owner = default_owner() if owner is None else owner
        self.before_ack = before_ack
        self.complete_retries = complete_retries
        self.table = isinstance(store, TransactionalTable)
        # Keys claimed by this consumer and not yet completed or released: a second
        # delivery of one of them (a producer duplicate) must not get the owner's own
        # claim back as NEW while the first is still running.
        self.active: set[bytes | str] = set()

    def decide(self, delivery: Delivery) -> Verdict:
        """Claims, runs the handler, completes or releases; what to do with the message."""
        if self.table:
            return self._decide_table(delivery)
        key = delivery.key
        if key in self.active:
            return Verdict.RETRY
        self.active.add(key)
        try:
            return self._decide_store(delivery)
        finally:
            self.active.discard(key)

    def _decide_store(self, delivery: Delivery) -> Verdict:
        key = delivery.key
        try:
            c = self.store.claim(key, namespace=self.namespace, lease=self.lease, owner=self.owner)
        except _STORE_ERRORS as exc:
            log.warning("claim of %r failed, retrying later: %s", key, exc)
            return Verdict.RETRY
        except (TypeError, ValueError) as exc:  # key too long, bad type, fingerprint conflict
            log.error("message with key %.80r refused: %s", key, exc)
            return Verdict.INVALID
        delivery.outcome = c.outcome
        if c.outcome is Outcome.IN_PROGRESS:
            return Verdict.RETRY
        if c.outcome is Outcome.DUPLICATE:
            self._before_ack(delivery, c.outcome)
            return Verdict.ACKED
        delivery.claim = c
        try:
            self.handler(delivery)
        except BaseException as exc:
            self._release(key, c.token)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: stop
                raise
            log.exception("handler failed on key %r; released it", key)
            return Verdict.FAILED
        self._complete(key, c.token)
        self._before_ack(delivery, c.outcome)
        return Verdict.ACKED

    def _decide_table(self, delivery: Delivery, *, hook: bool = True) -> Verdict:
        assert isinstance(self.store, TransactionalTable)
        try:
            self.store.check(delivery.namespace, delivery.key)
        except (TypeError, ValueError) as exc:
            log.error("message with key %.80r refused: %s", delivery.key, exc)
            return Verdict.INVALID
        try:
            outcome = self.store.run(delivery, self.handler)
        except Exception:
            log.exception("handler or dedup transaction failed on %r; rolled back", delivery.key)
            return Verdict.FAILED
        if hook:
            self._before_ack(delivery, outcome)
        return Verdict.ACKED

    def _before_ack(self, delivery: Delivery, outcome: Outcome) -> None:
        if self.before_ack is not None:
            self.before_ack(delivery, outcome)

    def _release(self, key: bytes | str, token: int) -> None:
        try:
            self.store.release(key, token, namespace=self.namespace)
        except StaleTokenError:
            log.warning("could not release %r: its lease was taken over", key)
        except _STORE_ERRORS as exc:
            log.warning("could not release %r (%s); it is retried after its lease", key, exc)

    def _complete(self, key: bytes | str, token: int) -> None:
        delay = 0.05
        for attempt in range(self.complete_retries + 1):
            try:
                self.store.complete(key, token, namespace=self.namespace)
                return
            except StaleTokenError:
                log.error(
                    "key %r: the lease ran out while the handler ran and was taken over; "
                    "raise `lease` above the handler's longest run",
                    key,
                )
                return
            except _STORE_ERRORS as exc:
                if attempt == self.complete_retries:
                    log.error(
                        "key %r was processed but its completion failed (%s); acking it "
                        "anyway, a redelivery after the lease ends would run it again",
                        key,
                        exc,
                    )
                    return
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


class _AsyncGate(_Gate):
    """The contract from an event loop: async or sync stores and handlers.

    A :class:`TransactionalTable` runs in a worker thread, one transaction at
    a time (its connection is not shared between transactions), so the
    handler must be a plain function there.
    """

    def __init__(self, store: Any, handler: Callable[[Delivery], Any], **kw: Any) -> None:
        super().__init__(store, handler, **kw)
        self.async_store = not self.table and inspect.iscoroutinefunction(
            getattr(store, "claim", None)
        )
        self.async_handler = inspect.iscoroutinefunction(handler)
        if self.table and self.async_handler:
            raise TypeError(
                "in table mode the handler runs inside a database transaction in a worker "
                "thread and must be a plain function, not async"
            )
        self._table_lock = threading.Lock()

    async def adecide(self, delivery: Delivery) -> Verdict:
        if self.table:
            verdict = await asyncio.to_thread(self._locked_table, delivery)
            if verdict is Verdict.ACKED:
                assert delivery.outcome is not None
                await self._abefore_ack(delivery, delivery.outcome)
            return verdict
        key = delivery.key
        if key in self.active:
            return Verdict.RETRY
        # Reserved before the claim is sent: a copy of the key arriving while the claim is
        # in flight must not send one of its own (the same owner would get NEW back).
        self.active.add(key)
        try:
            return await self._adecide_store(delivery)
        finally:
            self.active.discard(key)

    async def _adecide_store(self, delivery: Delivery) -> Verdict:
        key = delivery.key
        try:
            c = await self._call(
                "claim", key, namespace=self.namespace, lease=self.lease, owner=self.owner
            )
        except _STORE_ERRORS as exc:
            log.warning("claim of %r failed, retrying later: %s", key, exc)
            return Verdict.RETRY
        except (TypeError, ValueError) as exc:  # key too long, bad type, fingerprint conflict
            log.error("message with key %.80r refused: %s", key, exc)
            return Verdict.INVALID
        delivery.outcome = c.outcome
        if c.outcome is Outcome.IN_PROGRESS:
            return Verdict.RETRY
        if c.outcome is Outcome.DUPLICATE:
            await self._abefore_ack(delivery, c.outcome)
            return Verdict.ACKED
        delivery.claim = c
        try:
            if self.async_handler:
                await self.handler(delivery)
            else:
                self.handler(delivery)
        except BaseException as exc:
            # Cancelled, KeyboardInterrupt, SystemExit: released too, then re-raised.
            await asyncio.shield(self._arelease(key, c.token))
            if not isinstance(exc, Exception):
                raise
            log.exception("handler failed on key %r; released it", key)
            return Verdict.FAILED
        await self._acomplete(key, c.token)
        await self._abefore_ack(delivery, c.outcome)
        return Verdict.ACKED

    def _locked_table(self, delivery: Delivery) -> Verdict:
        with self._table_lock:
            return self._decide_table(delivery, hook=False)

    async def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        fn = getattr(self.store, name)
        if self.async_store:
            return await fn(*args, **kw)
        return fn(*args, **kw)

    async def _abefore_ack(self, delivery: Delivery, outcome: Outcome) -> None:
        if self.before_ack is not None:
            result = self.before_ack(delivery, outcome)
            if inspect.isawaitable(result):
                await result

    async def _arelease(self, key: bytes | str, token: int) -> None:
        try:
            await self._call("release", key, token, namespace=self.namespace)
        except StaleTokenError:
            log.warning("could not release %r: its lease was taken over", key)
        except _STORE_ERRORS as exc:
            log.warning("could not release %r (%s); it is retried after its lease", key, exc)

    async def _acomplete(self, key: bytes | str, token: int) -> None:
        delay = 0.05
        for attempt in range(self.complete_retries + 1):
            try:
                await self._call("complete", key, token, namespace=self.namespace)
                return
            except StaleTokenError:
                log.error(
                    "key %r: the lease ran out while the handler ran and was taken over; "
                    "raise `lease` above the handler's longest run",
                    key,
                )
                return
            except _STORE_ERRORS as exc:
                if attempt == self.complete_retries:
                    log.error(
                        "key %r was processed but its completion failed (%s); acking it "
                        "anyway, a redelivery after the lease ends would run it again",
                        key,
                        exc,
                    )
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


# -- pika ------------------------------------------------------------------------------


def _pika_headers(properties: Any) -> Mapping[str, Any]:
    headers = getattr(properties, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


class DedupConsumer:
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
        if retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {retry_delay}")
        self._gate = _Gate(
            store, handler, namespace=namespace, lease=lease, owner=owner, before_ack=before_ack
        )
        self.namespace = namespace
        self.key = key
        self.key_header = key_header
        self.retry_delay = retry_delay
        self.failure_requeue = failure_requeue
        self.counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)

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


class AsyncDedupConsumer:
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
        if retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {retry_delay}")
        self._gate = _AsyncGate(
            store, handler, namespace=namespace, lease=lease, owner=owner, before_ack=before_ack
        )
        self.namespace = namespace
        self.key = key
        self.key_header = key_header
        self.retry_delay = retry_delay
        self.failure_requeue = failure_requeue
        self.counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)
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
