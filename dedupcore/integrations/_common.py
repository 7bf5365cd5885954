"""What the broker wrappers share: the delivery, key derivation, the dedup contract.

:class:`Delivery` is one message as every wrapper sees it; :func:`derive_key`
finds its dedup key; :class:`TransactionalTable` is the transactional dedup
table mode; ``_Gate``/``_AsyncGate`` run the contract of
:mod:`dedupcore.integrations` (claim, handler, complete or commit, then the
broker's ack/nack) for one delivery, with the broker calls left to each wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import inspect
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, Union

import dedupcore.keys as _keys
from dedupcore.api import Claim, ClaimAPI, Outcome
from dedupcore.errors import MissingKeyError, SchemaError, StaleTokenError, UnavailableError
from dedupcore.patterns.table import DEFAULT_TABLE, consume, ensure_table
from dedupcore.patterns.table import MAX_KEY_BYTES as TABLE_MAX_KEY_BYTES
from dedupcore.patterns.unique import Conn, table_info
from dedupcore.retry import DEFAULT_RETRY, RetryPolicy, policy_from_args

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BeforeAck",
    "ConsumerOptions",
    "Delivery",
    "KeyFunc",
    "MissingKeyError",
    "Store",
    "TransactionalTable",
    "Verdict",
    "default_owner",
    "derive_key",
]

log = logging.getLogger("dedupcore.integrations")

#: ``key(body, headers)`` -> the business id, or None when the message has none.
KeyFunc = Callable[[bytes, Mapping[str, Any]], bytes | str | int | None]
#: Called after the dedup decision is durable (completed / committed) and before the ack.
BeforeAck = Callable[["Delivery", Outcome], None]


class Verdict(enum.Enum):
    """What a consumer did with one delivery."""

    ACKED = "acked"  #: processed now (NEW) or before (DUPLICATE), then acked
    RETRY = "retry"  #: IN_PROGRESS elsewhere or the store was unavailable: redelivered later
    FAILED = "failed"  #: the handler raised: claim released / transaction rolled back, requeued
    INVALID = "invalid"  #: no usable key: rejected without requeue (dead-letter path)


class _ConsumerNeeds(TypedDict):
    namespace: str


class ConsumerOptions(_ConsumerNeeds, total=False):
    """The keywords every per-message consumer takes (RabbitMQ's ``DedupConsumer`` and
    ``AsyncDedupConsumer``, NATS's ``JetStreamConsumer``, FastStream's ``DedupMiddleware``);
    each adds its own.

    - ``namespace`` (required): the consumer of record; its keys are claimed there.
    - ``key``: ``key(body, headers)``, the business id of a message (:func:`derive_key`).
    - ``key_header``: the header that holds the key when ``key`` gives none.
    - ``retry_delay`` (1.0): seconds before a message that could not be decided now
      (IN_PROGRESS, an unavailable store, a failed handler) comes back; >= 0.
    - ``lease``: seconds a claim is held (default: the store's).
    - ``owner``: the claims' owner (default: :func:`default_owner`).
    - ``before_ack``: ``before_ack(delivery, outcome)``, called once the decision is
      durable and before the ack.
    - ``retry``: the :class:`~dedupcore.retry.RetryPolicy` of completions.
    """

    key: KeyFunc | None
    key_header: str | None
    retry_delay: float
    lease: float | None
    owner: bytes | str | None
    before_ack: BeforeAck | None
    retry: RetryPolicy | None


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
# What a claim raises when it gives no answer: the store's errors, and a refused key
# (too long, of a bad type, a fingerprint conflict).
_CLAIM_ERRORS = (*_STORE_ERRORS, TypeError, ValueError)


_threads = threading.local()  # .conns: {(factory, table): (pid, connection)}


def _thread_connections() -> dict[Any, tuple[int, Any]]:
    conns: dict[Any, tuple[int, Any]] | None = getattr(_threads, "conns", None)
    if conns is None:
        conns = _threads.conns = {}
    return conns


def thread_connection(factory: Callable[[], Any], table: str) -> Any:
    """This thread's connection of ``factory`` for the transactional mode of a worker
    (Celery, Dramatiq), made on first use in this thread of this process, with the
    dedup table ``table`` made if it is missing."""
    conns, pid = _thread_connections(), os.getpid()
    found = conns.get((factory, table))
    if found is not None and found[0] == pid:
        return found[1]
    conn = factory()
    try:
        table_info(Conn(conn), table)  # reads the catalog: no lock on the table
    except SchemaError:
        # Missing: create it. Not otherwise: ensure_table's CREATE INDEX IF NOT EXISTS
        # waits for every open transaction that wrote to the table, and the inserts of
        # other workers queue up behind it.
        ensure_table(conn, table=table)
    else:
        conn.rollback()
    conns[(factory, table)] = (pid, conn)
    return conn


def drop_thread_connection(factory: Callable[[], Any], table: str) -> None:
    """Forgets (and closes) this thread's connection, so the next message opens a fresh one
    (after a rollback: it may be broken)."""
    found = _thread_connections().pop((factory, table), None)
    if found is not None and found[0] == os.getpid():
        with contextlib.suppress(Exception):
            found[1].close()


def close_thread_connections() -> None:
    """Closes every connection of this thread."""
    for factory, table in list(_thread_connections()):
        drop_thread_connection(factory, table)


def _claim_failed(key: bytes | str, exc: Exception) -> Verdict:
    """The verdict of a claim that raised: retried later, or refused if the key is at fault."""
    if isinstance(exc, _STORE_ERRORS):
        log.warning("claim of %r failed, retrying later: %s", key, exc)
        return Verdict.RETRY
    log.error("message with key %.80r refused: %s", key, exc)
    return Verdict.INVALID


def _claimed(delivery: Delivery, c: Claim) -> Verdict | None:
    """The verdict a claim's outcome gives by itself (RETRY for IN_PROGRESS, ACKED for a
    DUPLICATE: the caller runs ``before_ack`` for every ACKED), or None for a NEW claim:
    run the handler. Records the outcome (and a NEW claim) on ``delivery``."""
    delivery.outcome = c.outcome
    if c.outcome is Outcome.IN_PROGRESS:
        return Verdict.RETRY
    if c.outcome is Outcome.DUPLICATE:
        return Verdict.ACKED
    delivery.claim = c
    return None


def _handler_failed(key: bytes | str, exc: BaseException) -> Verdict:
    """The verdict of a handler that raised ``exc`` (its claim released): FAILED, or ``exc``
    raised again when it is no Exception (KeyboardInterrupt, SystemExit, Cancelled: stop)."""
    if not isinstance(exc, Exception):
        raise exc
    log.exception("handler failed on key %r; released it", key, exc_info=exc)
    return Verdict.FAILED


def _log_taken_over(key: bytes | str) -> None:
    log.error(
        "key %r: the lease ran out while the handler ran and was taken over; "
        "raise `lease` above the handler's longest run",
        key,
    )


def _log_not_completed(key: bytes | str, exc: BaseException) -> None:
    log.error(
        "key %r was processed but its completion failed (%s); acking it "
        "anyway, a redelivery after the lease ends would run it again",
        key,
        exc,
    )


class _ClaimingNeeds(TypedDict):
    namespace: str
    lease: float | None
    owner: bytes | str | None


class _Claiming(_ClaimingNeeds, total=False):
    """The keywords of :class:`_Claimer` (and of the gates, with ``before_ack``)."""

    retry: RetryPolicy


class _Claimer:
    """What claims keys for a handler: the store (or :class:`TransactionalTable`), the
    handler, the namespace, and the lease, owner and retry policy of its claims and
    completions. The gates below and Kafka's loop are made of it."""

    def __init__(
        self,
        store: Any,
        handler: Callable[[Delivery], Any],
        *,
        namespace: str,
        lease: float | None,
        owner: bytes | str | None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be str, not {type(namespace).__name__}")
        self.store = store
        self.handler = handler
        self.namespace = namespace
        self.lease = lease
        self.owner = default_owner() if owner is None else owner
        self.retry = retry
        self.table = isinstance(store, TransactionalTable)


class _Gate(_Claimer):
    """The contract over one store, for consumers that call it from one thread at a time."""

    def __init__(
        self,
        store: Any,
        handler: Callable[[Delivery], Any],
        *,
        before_ack: BeforeAck | None,
        **claiming: Unpack[_Claiming],
    ) -> None:
        super().__init__(store, handler, **claiming)
        self.before_ack = before_ack
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
        except _CLAIM_ERRORS as exc:
            return _claim_failed(key, exc)
        verdict = _claimed(delivery, c)
        if verdict is None:
            try:
                self.handler(delivery)
            except BaseException as exc:
                self._release(key, c.token)
                return _handler_failed(key, exc)
            self._complete(key, c.token)
            verdict = Verdict.ACKED
        if verdict is Verdict.ACKED:
            self._before_ack(delivery, c.outcome)
        return verdict

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
        try:
            self.retry.call(
                functools.partial(self.store.complete, key, token, namespace=self.namespace),
                retry_on=_STORE_ERRORS,
            )
        except StaleTokenError:
            _log_taken_over(key)
        except _STORE_ERRORS as exc:
            _log_not_completed(key, exc)


class _AsyncGate(_Gate):
    """The contract from an event loop: async or sync stores and handlers.

    An async store (``dedupcore.aio.Client``) is awaited; a sync store's calls
    run in worker threads (``asyncio.to_thread``), so they never block the
    loop. A :class:`TransactionalTable` runs in a worker thread, one transaction at
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
        except _CLAIM_ERRORS as exc:
            return _claim_failed(key, exc)
        verdict = _claimed(delivery, c)
        if verdict is None:
            try:
                if self.async_handler:
                    await self.handler(delivery)
                else:
                    self.handler(delivery)
            except BaseException as exc:
                # Cancelled, KeyboardInterrupt, SystemExit: released too, then re-raised.
                await asyncio.shield(self._arelease(key, c.token))
                return _handler_failed(key, exc)
            await self._acomplete(key, c.token)
            verdict = Verdict.ACKED
        if verdict is Verdict.ACKED:
            await self._abefore_ack(delivery, c.outcome)
        return verdict

    def _locked_table(self, delivery: Delivery) -> Verdict:
        with self._table_lock:
            return self._decide_table(delivery, hook=False)

    async def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        """The store's ``name`` call: awaited for an async store, in a worker thread otherwise.

        A sync store's call can wait on an fdatasync or a network round trip;
        run inline it would stall every other delivery, heartbeat and timer
        of the event loop for that long.
        """
        fn = getattr(self.store, name)
        if self.async_store:
            return await fn(*args, **kw)
        return await asyncio.to_thread(functools.partial(fn, *args, **kw))

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
        try:
            await self.retry.acall(
                functools.partial(self._call, "complete", key, token, namespace=self.namespace),
                retry_on=_STORE_ERRORS,
            )
        except StaleTokenError:
            _log_taken_over(key)
        except _STORE_ERRORS as exc:
            _log_not_completed(key, exc)


def _check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (a number) or None, not {type(timeout).__name__}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")


class _StopControl:
    """A consumer's graceful stop: asked from anywhere, finished by the consuming thread.

    ``ask()`` only sets an event, so it is safe from a signal handler and from
    any thread. The consuming side calls ``begin()`` when it starts consuming
    and ``end()`` once the in-flight message is finished and nothing more
    will be consumed; ``wait()`` blocks until then, except on the consuming
    thread itself (a signal handler or the handler calling ``stop()``), where
    waiting could never end: there it only reports whether the stop is done.
    A stop is final: a stopped consumer does not consume again.
    """

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.finished = threading.Event()
        self.finished.set()  # nothing is being consumed yet
        self.thread: int | None = None

    def ask(self) -> bool:
        """Asks for the stop; True the first time."""
        first = not self.asked.is_set()
        self.asked.set()
        return first

    def begin(self) -> None:
        self.thread = threading.get_ident()
        if not self.asked.is_set():
            self.finished.clear()

    def end(self) -> None:
        self.finished.set()

    def wait(self, timeout: float | None) -> bool:
        _check_timeout(timeout)
        if threading.get_ident() == self.thread:
            return self.finished.is_set()
        return self.finished.wait(timeout)


class _Stoppable:
    """What a consumer with a graceful stop reports; it keeps a :class:`_StopControl`."""

    _stop: _StopControl

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called (the consumer may still be finishing a message)."""
        return self._stop.asked.is_set()

    @property
    def stopped(self) -> bool:
        """Whether the consumer consumes nothing and has no message in flight."""
        return self._stop.finished.is_set()


G = TypeVar("G", bound=_Gate)


class _Consumer(_Stoppable, Generic[G]):
    """What every per-message broker consumer keeps: the gate that runs the contract,
    how the key is found, the retry delay and a tally of verdicts."""

    def __init__(
        self,
        gate: type[G],
        store: Any,
        handler: Callable[[Delivery], Any],
        *,
        namespace: str,
        key: KeyFunc | None = None,
        key_header: str | None = None,
        retry_delay: float = 1.0,
        lease: float | None = None,
        owner: bytes | str | None = None,
        before_ack: BeforeAck | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """The options of :class:`ConsumerOptions`, with their defaults."""
        if retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {retry_delay}")
        self._gate = gate(
            store,
            handler,
            namespace=namespace,
            lease=lease,
            owner=owner,
            before_ack=before_ack,
            retry=policy_from_args(retry),
        )
        self.namespace = namespace
        self.key = key
        self.key_header = key_header
        self.retry_delay = retry_delay
        self.counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)
        self._stop = _StopControl()

    def _delivery(
        self,
        body: bytes,
        headers: Mapping[str, Any],
        message_id: str | None,
        *,
        redelivered: bool,
        raw: Any,
        refusal: str,
    ) -> Delivery | None:
        """The delivery of one message, or None when it has no key (logged after ``refusal``,
        what becomes of the message)."""
        try:
            k = derive_key(body, headers, message_id, key=self.key, key_header=self.key_header)
        except MissingKeyError as exc:
            log.error("%s: %s", refusal, exc)
            return None
        return Delivery(
            body=body,
            headers=headers,
            key=k,
            namespace=self.namespace,
            message_id=message_id,
            redelivered=redelivered,
            raw=raw,
        )


class _AsyncStop:
    """The stop of an asyncio consumer: ``stop()`` from any thread, ``astop()`` on its loop.

    ``_graceful_stop()`` (the wrapper's own coroutine) cancels the
    consumption, lets the messages in flight finish and returns; it runs
    once, however many times the stop is asked for.
    """

    _stop: _StopControl
    _loop: asyncio.AbstractEventLoop | None = None
    _stop_task: asyncio.Task[None] | None = None

    async def _graceful_stop(self) -> None:
        raise NotImplementedError

    def _start_stop(self) -> asyncio.Task[None]:
        """The one stop task (made on the first call); call on the consumer's loop."""
        self._stop.ask()
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._run_stop())
        return self._stop_task

    async def _run_stop(self) -> None:
        try:
            await self._graceful_stop()
        finally:
            self._stop.end()

    async def astop(self) -> None:
        """Stops gracefully (see :meth:`stop`) and returns when the consumer has stopped."""
        loop = self._loop
        if loop is None:  # never consumed: nothing in flight
            self._stop.ask()
            return
        if loop is not asyncio.get_running_loop():
            fut = asyncio.run_coroutine_threadsafe(self.astop(), loop)
            await asyncio.wrap_future(fut)
            return
        await asyncio.shield(self._start_stop())

    def stop(self, timeout: float | None = None) -> bool:
        """Stops gracefully: the message in flight finishes, nothing after it starts.

        Safe from a signal handler and from any thread. Called from another
        thread than the consumer's event loop, it waits (up to ``timeout``
        seconds) until the consumer has stopped and returns True if it has;
        from the loop's own thread (a signal handler, a handler) it cannot
        wait, so it starts the stop and returns whether it is already done
        (``await astop()`` there waits).
        """
        _check_timeout(timeout)
        self._stop.ask()
        loop = self._loop
        if loop is None or loop.is_closed():
            return self._stop.wait(0)
        try:
            loop.call_soon_threadsafe(self._start_stop)
        except RuntimeError:  # the loop closed meanwhile
            return self._stop.finished.is_set()
        return self._stop.wait(timeout)
