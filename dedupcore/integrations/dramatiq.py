"""A Dramatiq middleware that runs an actor's effect once per message key.

``broker.add_middleware(DedupMiddleware(store_factory))`` claims each
message's key before its actor runs and completes it after, with Dramatiq's
own hooks (``before_process_message``, ``after_process_message``,
``after_skip_message``). docs/dramatiq.md is the user's guide; in short:

==================  ====================================================================
claim outcome       what the middleware does
==================  ====================================================================
NEW                 the actor runs; the key is completed (or the dedup transaction
                    commits) after it returns, then Dramatiq acks the message
DUPLICATE           ``SkipMessage``: the actor does not run, the message is acked
IN_PROGRESS         the message is enqueued again ``dedup_retry_delay`` seconds later
                    (same message id and arguments, its retry count untouched) and
                    this delivery is skipped (acked)
actor raised        releases the key (rolls the transaction back); Dramatiq's
                    ``Retries`` then runs the actor again, or dead-letters the message
no usable key       the message is failed (dead-lettered) without running the actor
store unavailable   as IN_PROGRESS: the actor never runs on an undecided claim
==================  ====================================================================

**The key** is the message id (kept by Dramatiq's retries and by the
re-enqueue above; a producer that sends again makes a new one), or
``dedup_key(args, kwargs, options)``: a business id from the message. A key
function that gives nothing (None, raises, or a value that is not a str,
bytes or int) makes the message invalid; it never falls back to the id.

**Per actor**, as keywords of ``@dramatiq.actor``: ``dedup`` (False leaves
the actor alone), ``dedup_key``, ``dedup_namespace`` (default: the actor's
name), ``dedup_lease`` and ``dedup_retry_delay``; the middleware's own
arguments are the defaults.

**The store** is named by a factory or a URL for
:func:`~dedupcore.open_store`, never passed as an object: each worker process
makes its own on its first message. Worker processes share it, so use
:class:`~dedupcore.Client` of ``dedupcore serve``, Redis or SQL. Every
worker thread claims as an owner of its own.

**Transactional mode** (``connection=`` a factory of DB-API connections,
autocommit off): each worker thread opens one; the dedup row in ``table``
is inserted before the actor runs, the actor writes its effect on
``current().conn`` without committing, and both commit after it returns
(:func:`dedupcore.patterns.table.consume`). A worker killed before the
commit loses both, and the redelivery runs the actor again; killed after
it, the redelivery is a DUPLICATE. A failed commit rolls both back and the
message is enqueued again, as for IN_PROGRESS.

Inside the actor, :func:`current` tells the key, the namespace, and the NEW
claim or the connection holding the transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dedupcore.keys as _keys
from dedupcore._checks import extra_imports
from dedupcore.api import AsyncClaimAPI, Claim, ClaimAPI, Outcome
from dedupcore.errors import MissingKeyError
from dedupcore.factory import open_store
from dedupcore.integrations._common import (
    _CLAIM_ERRORS,
    Verdict,
    _as_key,
    _claim_failed,
    _Gate,
    close_thread_connections,
    default_owner,
    drop_thread_connection,
    thread_connection,
)
from dedupcore.patterns.table import DEFAULT_TABLE, Consumption, consume
from dedupcore.patterns.unique import check_identifier

with extra_imports("dramatiq", "dramatiq", "dedupcore.integrations.dramatiq"):
    import dramatiq
    from dramatiq.middleware import MiddlewareError, SkipMessage

__all__ = ["ActorDedup", "DedupMiddleware", "current"]

log = logging.getLogger("dedupcore.integrations.dramatiq")

#: ``dedup_key(args, kwargs, options)`` -> the business id of a message.
ArgsKey = Callable[[tuple[Any, ...], Mapping[str, Any], Mapping[str, Any]], Any]
#: A factory of the store, or a URL (or directory) for ``open_store``.
StoreSource = Callable[[], ClaimAPI] | str


@dataclass
class ActorDedup:
    """What the running actor can see of its claim (:func:`current`).

    Store mode: the NEW ``claim``. Transactional mode: ``conn``, whose open
    transaction holds the dedup row (write the effect on it; do not commit),
    and ``consumption``.
    """

    key: bytes | str
    namespace: str
    message_id: str
    claim: Claim | None = None
    conn: Any = None
    consumption: Consumption | None = None
    _gate: Any = field(default=None, repr=False)
    _transaction: contextlib.ExitStack | None = field(default=None, repr=False)


_local = threading.local()  # .held: ActorDedup of this thread's message; .owner


def current() -> ActorDedup:
    """The claim (store mode) or transaction (transactional mode) of the running actor."""
    held: ActorDedup | None = getattr(_local, "held", None)
    if held is None:
        raise RuntimeError("current() is only there while a deduplicated actor runs")
    return held


class _Unused:
    """The handler of the gates here: the worker, not the gate, calls the actor."""

    def __call__(self, delivery: Any) -> None:
        raise AssertionError("the worker calls the actor")


def _number(name: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (a number), not {value!r}")
    if not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be {'>' if positive else '>='} 0, got {value}")


class DedupMiddleware(dramatiq.Middleware):
    """Dramatiq middleware: an actor's effect runs once per key (see the module doc).

    ``store``: a factory of a claim store or a URL for ``open_store``;
    or ``connection``: a factory of DB-API connections, for the
    transactional mode (dedup rows in ``table``). ``key``: the default
    ``dedup_key``; ``lease``: seconds a claim is held (default: the
    store's), which must outlast the actor's longest run; ``retry_delay``:
    seconds before an IN_PROGRESS message comes back.
    """

    @property
    def actor_options(self) -> set[str]:
        """The options each actor may set (``@dramatiq.actor(dedup_key=...)``)."""
        return {"dedup", "dedup_key", "dedup_namespace", "dedup_lease", "dedup_retry_delay"}

    def __init__(
        self,
        store: StoreSource | None = None,
        *,
        connection: Callable[[], Any] | None = None,
        table: str = DEFAULT_TABLE,
        key: ArgsKey | None = None,
        lease: float | None = None,
        retry_delay: float = 1.0,
    ) -> None:
        if isinstance(store, (ClaimAPI, AsyncClaimAPI)):
            raise TypeError(
                "store is a store object; give a factory (a function returning the store) "
                "or a URL: each worker process makes its own store"
            )
        if (store is None) == (connection is None):
            raise TypeError("give store (a factory or a URL) or connection, one of them")
        if store is not None and not isinstance(store, str) and not callable(store):
            raise TypeError(f"store must be a factory or a URL, not {store!r}")
        if connection is not None and not callable(connection):
            raise TypeError("connection must be a factory of DB-API connections")
        if key is not None and not callable(key):
            raise TypeError(f"key must be a function of (args, kwargs, options), not {key!r}")
        if lease is not None:
            _number("lease", lease, positive=True)
        _number("retry_delay", retry_delay, positive=False)
        self.source = store
        self.connection = connection
        self.table = check_identifier(table, "table")
        self.key = key
        self.lease = lease
        self.retry_delay = retry_delay
        self._lock = threading.Lock()
        self._store: tuple[int, ClaimAPI] | None = None  # (pid that made it, store)
        self._gates: dict[str, _Gate] = {}

    # -- the hooks -------------------------------------------------------------------------

    def before_declare_actor(self, broker: Any, actor: Any) -> None:
        """Refuses an actor's dedup options that cannot work, when the actor is made.

        Raised as Dramatiq's ``MiddlewareError`` (the one exception Dramatiq lets
        out of this hook), from the ``TypeError``/``ValueError`` that says why.
        """
        try:
            self._check_actor(actor)
        except (TypeError, ValueError) as exc:
            raise MiddlewareError(f"actor {actor.actor_name}: {exc}") from exc

    @staticmethod
    def _check_actor(actor: Any) -> None:
        options = actor.options
        if not isinstance(options.get("dedup", True), bool):
            raise TypeError("dedup must be True or False")
        namespace = options.get("dedup_namespace") or actor.actor_name
        if not isinstance(namespace, str):
            raise TypeError(f"dedup_namespace must be str, not {type(namespace).__name__}")
        _keys.check_namespace(namespace)
        key = options.get("dedup_key")
        if key is not None and not callable(key):
            raise TypeError("dedup_key must be a function of (args, kwargs, options)")
        if options.get("dedup_lease") is not None:
            _number("dedup_lease", options["dedup_lease"], positive=True)
        if "dedup_retry_delay" in options:
            _number("dedup_retry_delay", options["dedup_retry_delay"], positive=False)

    def before_process_message(self, broker: Any, message: Any) -> None:
        _local.held = None
        if message.failed:  # another middleware failed it: the actor will not run
            return
        options = broker.get_actor(message.actor_name).options
        if options.get("dedup") is False:
            return
        try:
            self._decide(broker, message, options)
        except SkipMessage:
            raise
        except Exception as exc:
            # Dramatiq logs any other exception of this hook and runs the actor anyway:
            # never on an undecided claim.
            log.exception("message %s: no dedup decision, retrying later", message.message_id)
            self._later(broker, message, options)
            raise SkipMessage(str(exc)) from exc

    def after_process_message(
        self,
        broker: Any,
        message: Any,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        held = self._take(message)
        if held is None:
            return
        if exception is None and not message.failed:
            if not self._finish(held, None):
                self._later(broker, message, broker.get_actor(message.actor_name).options)
        else:
            self._finish(held, exception or RuntimeError("the message was failed"))

    def after_skip_message(self, broker: Any, message: Any) -> None:
        held = self._take(message)  # claimed here, then skipped by a later middleware
        if held is not None:
            self._finish(held, RuntimeError("the message was skipped"))

    def before_worker_thread_shutdown(self, broker: Any, thread: Any) -> None:
        close_thread_connections()

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        with self._lock:
            made, self._store = self._store, None
        if made is not None and made[0] == os.getpid():
            with contextlib.suppress(Exception):
                made[1].close()

    def _decide(self, broker: Any, message: Any, options: Mapping[str, Any]) -> None:
        """Claims the message's key (or opens its dedup transaction); SkipMessage unless NEW."""
        namespace = options.get("dedup_namespace") or message.actor_name
        try:
            key = self._key(message, options.get("dedup_key", self.key))
        except MissingKeyError as exc:
            self._refuse(message, exc)
        if self.connection is not None:
            self._begin_transaction(broker, message, key, namespace, options)
        else:
            lease = options.get("dedup_lease", self.lease)
            self._claim(broker, message, key, namespace, lease, options)

    # -- store mode ------------------------------------------------------------------------

    def _claim(
        self,
        broker: Any,
        message: Any,
        key: bytes | str,
        namespace: str,
        lease: float | None,
        options: Mapping[str, Any],
    ) -> None:
        try:
            gate = self._gate(namespace)
            c = gate.store.claim(key, namespace=namespace, lease=lease, owner=self._owner())
        except _CLAIM_ERRORS as exc:
            if _claim_failed(key, exc) is Verdict.INVALID:
                self._refuse(message, exc)
            self._later(broker, message, options)
            raise SkipMessage from exc
        if c.outcome is Outcome.DUPLICATE:
            self._skip_duplicate(key, message)
        if c.outcome is Outcome.IN_PROGRESS:
            log.info("key %r is held by another owner; message %s is sent again", key, message)
            self._later(broker, message, options)
            raise SkipMessage(f"key {key!r} is held by another owner")
        _local.held = ActorDedup(key, namespace, message.message_id, claim=c, _gate=gate)

    def _gate(self, namespace: str) -> _Gate:
        """The gate of ``namespace`` over this process's store (made on first use)."""
        pid = os.getpid()
        with self._lock:
            if self._store is None or self._store[0] != pid:
                # A store inherited from a parent process is left alone: its sockets
                # and files are the parent's.
                self._store = (pid, self._open_store())
                self._gates = {}
            gate = self._gates.get(namespace)
            if gate is None:
                gate = self._gates[namespace] = _Gate(
                    self._store[1],
                    _Unused(),
                    namespace=namespace,
                    lease=None,
                    owner=None,
                    before_ack=None,
                )
            return gate

    def _open_store(self) -> ClaimAPI:
        source = self.source
        assert source is not None
        store = open_store(source) if isinstance(source, str) else source()
        if not isinstance(store, ClaimAPI):
            raise TypeError(f"the store factory returned {type(store).__name__}, not a store")
        return store

    @staticmethod
    def _owner() -> str:
        """This thread's owner id: each worker thread claims as an owner of its own."""
        found: tuple[int, str] | None = getattr(_local, "owner", None)
        if found is None or found[0] != os.getpid():
            found = _local.owner = (os.getpid(), default_owner())
        return found[1]

    # -- transactional mode ----------------------------------------------------------------

    def _begin_transaction(
        self,
        broker: Any,
        message: Any,
        key: bytes | str,
        namespace: str,
        options: Mapping[str, Any],
    ) -> None:
        transaction = contextlib.ExitStack()
        try:
            conn = self._connection()
            c = transaction.enter_context(consume(conn, namespace, key, table=self.table))
        except (TypeError, ValueError) as exc:  # a key the table cannot hold
            self._refuse(message, exc)
        except Exception as exc:
            log.warning("the dedup transaction of %r failed, retrying later: %s", key, exc)
            self._drop_connection()
            self._later(broker, message, options)
            raise SkipMessage from exc
        if not c.new:
            transaction.close()
            self._skip_duplicate(key, message)
        _local.held = ActorDedup(
            key,
            namespace,
            message.message_id,
            conn=conn,
            consumption=c,
            _transaction=transaction,
        )

    def _connection(self) -> Any:
        """This thread's connection (the dedup table made on first use, if missing)."""
        assert self.connection is not None
        return thread_connection(self.connection, self.table)

    def _drop_connection(self) -> None:
        assert self.connection is not None
        drop_thread_connection(self.connection, self.table)

    # -- both modes ------------------------------------------------------------------------

    def _key(self, message: Any, key: ArgsKey | None) -> bytes | str:
        if key is None:
            found = _as_key(message.message_id, "message id")
        else:
            try:
                value = key(message.args, message.kwargs, message.options)
            except Exception as exc:
                raise MissingKeyError(
                    f"dedup_key(args, kwargs, options) raised {type(exc).__name__}: {exc}"
                ) from exc
            found = _as_key(value, "dedup_key(args, kwargs, options)")
        if found is None:
            raise MissingKeyError(f"message {message.message_id} has no dedup key")
        return found

    @staticmethod
    def _take(message: Any) -> ActorDedup | None:
        held: ActorDedup | None = getattr(_local, "held", None)
        if held is None or held.message_id != message.message_id:
            return None
        _local.held = None
        return held

    def _finish(self, held: ActorDedup, exception: BaseException | None) -> bool:
        """Completes or commits (``exception`` None), else releases or rolls back.

        False when the dedup transaction failed to commit (both rolled back).
        """
        if held._transaction is not None:
            if exception is not None:
                held._transaction.__exit__(type(exception), exception, exception.__traceback__)
                return True
            try:
                held._transaction.close()
            except Exception as exc:
                log.warning("the dedup transaction of %r failed to commit: %s", held.key, exc)
                self._drop_connection()
                return False
            return True
        assert held.claim is not None
        if exception is None:
            held._gate._complete(held.key, held.claim.token)
        else:
            held._gate._release(held.key, held.claim.token)
        return True

    @staticmethod
    def _skip_duplicate(key: bytes | str, message: Any) -> None:
        log.info("key %r was processed before; message %s skipped", key, message)
        raise SkipMessage(f"key {key!r} was processed before")

    @staticmethod
    def _refuse(message: Any, exc: Exception) -> None:
        """Fails the message (Dramatiq dead-letters it) without running the actor."""
        log.error("message %s refused: %s", message.message_id, exc)
        message.fail()
        raise SkipMessage(str(exc)) from exc

    def _later(self, broker: Any, message: Any, options: Mapping[str, Any]) -> None:
        """Enqueues the message again ``dedup_retry_delay`` seconds from now, its retry
        count untouched (waiting for another worker's claim is not a failed attempt)."""
        delay = options.get("dedup_retry_delay", self.retry_delay)
        try:
            broker.enqueue(message, delay=int(delay * 1000))
        except Exception as exc:  # not sent again: dead-letter rather than lose it
            log.error("could not enqueue %s again (%s); failing it", message.message_id, exc)
            message.fail()
