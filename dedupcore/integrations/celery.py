"""Celery tasks whose effect runs once: the task base class :class:`IdempotentTask`.

A task made with ``@app.task(base=IdempotentTask, ...)`` claims its key before
the body runs and completes it with the body's return value after; a second
delivery of the same key (a broker redelivery, a re-send, a retry) returns the
stored result without running the body. docs/integrations.md, "Celery", is the
user's guide; in short:

==================  ===================================================================
claim outcome       what the task does
==================  ===================================================================
NEW                 runs the body, completes the key with its return value, returns it
DUPLICATE           returns the stored result; the body does not run
IN_PROGRESS         re-sends itself ``dedup_retry_delay`` seconds later (same task id,
                    same arguments, its retry count untouched); the message is acked
body raised         releases the key, then the exception goes on to Celery (so
                    ``self.retry``/``autoretry_for`` run the body again)
store unavailable   as IN_PROGRESS: the body never runs on an undecided claim
==================  ===================================================================

The key is the task id by default (a Celery retry keeps it), or
``dedup_key``: a function of the task's arguments, or a path into its payload
as in the store's ``idempotent`` (``"order.id"``; the payload is the first
argument, or the one named ``dedup_payload``). The namespace is
``dedup_namespace``, else the task's name.

The store is named by a factory (or a URL for :func:`~dedupcore.open_store`),
never passed as an object: a worker forks its pool processes, and each makes
its own store the first time it runs a task. Prefork pools therefore need a
store that many processes share: :class:`~dedupcore.Client` of ``dedupcore
serve``, Redis or SQL (an embedded data directory has one owner process).

With ``dedup_connection`` (a factory of DB-API connections) the task is
transactional instead: the dedup row is written in the same transaction as
what the body writes on ``self.dedup.conn``
(:func:`dedupcore.patterns.table.consume`), and both commit after the body
returns. A worker killed between the body's writes and the commit loses both,
and the redelivery runs the body again; killed after the commit, the
redelivery is a DUPLICATE. That closes the window the store mode leaves open
between the effect and ``complete``.

``acks_late`` and ``reject_on_worker_lost`` are on (and cannot be turned off):
the message stays unacked until the task has finished, so a worker killed
mid-task, or a pool process that dies, puts it back on the queue.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import dedupcore.keys as _keys
from dedupcore._checks import extra_imports
from dedupcore.api import AsyncClaimAPI, Claim, ClaimAPI, Outcome, key_path, result_refused
from dedupcore.api.decorator import _decorated_key
from dedupcore.errors import InProgressError, StaleTokenError
from dedupcore.factory import open_store
from dedupcore.integrations._common import (
    _STORE_ERRORS,
    _log_not_completed,
    _log_taken_over,
    close_thread_connections,
    default_owner,
    drop_thread_connection,
    thread_connection,
)
from dedupcore.patterns.table import DEFAULT_TABLE, Consumption, consume
from dedupcore.patterns.table import MAX_KEY_BYTES as TABLE_MAX_KEY_BYTES
from dedupcore.patterns.unique import check_identifier
from dedupcore.retry import DEFAULT_RETRY

with extra_imports("celery", "celery", "dedupcore.integrations.celery"):
    import celery
    from celery.exceptions import Reject, Retry
    from celery.signals import worker_process_shutdown

__all__ = ["IdempotentTask", "TaskDedup", "close_stores"]

log = logging.getLogger("dedupcore.integrations.celery")

#: ``dedup_store``: a factory of a store, or a URL (or directory) for ``open_store``.
StoreSource = Callable[[], ClaimAPI] | str
#: The options whose callables are kept as plain functions on the task class.
_FACTORIES = ("dedup_store", "dedup_connection", "dedup_key")


@dataclass
class TaskDedup:
    """What the body of an :class:`IdempotentTask` can see of its claim (``self.dedup``).

    Store mode: ``store`` and the NEW ``claim`` (its fencing token).
    Transactional mode: ``conn``, the connection whose open transaction
    holds the dedup row (write the effect on it; do not commit), and
    ``consumption`` (:class:`~dedupcore.patterns.table.Consumption`).
    """

    key: bytes | str
    namespace: str
    store: ClaimAPI | None = None
    claim: Claim | None = None
    conn: Any = None
    consumption: Consumption | None = None


# -- what each worker process makes for itself ------------------------------------------

_lock = threading.Lock()
_stores: dict[Any, tuple[int, ClaimAPI]] = {}  # source -> (pid that made it, store)
_local = threading.local()  # .running: [TaskDedup]


def _store_for(source: StoreSource) -> ClaimAPI:
    """The store of ``source`` in this process: made on first use, again after a fork."""
    pid = os.getpid()
    with _lock:
        found = _stores.get(source)
        if found is not None and found[0] == pid:
            return found[1]
        # A store inherited from the parent process is left alone (its sockets and
        # files are the parent's), never closed or used here.
        store = open_store(source) if isinstance(source, str) else source()
        if not isinstance(store, ClaimAPI):
            hint = (
                "; an asyncio store cannot serve a task: use dedupcore.Client"
                if isinstance(store, AsyncClaimAPI)
                else ""
            )
            raise TypeError(
                f"dedup_store's factory returned {type(store).__name__}, not a store{hint}"
            )
        _stores[source] = (pid, store)
        return store


def close_stores() -> None:
    """Closes the stores this process made for its tasks, and this thread's connections.

    A worker's pool process does it when it exits; a process that ran tasks
    through ``apply()`` (a test, a script) calls it when it is done.
    """
    pid = os.getpid()
    with _lock:
        mine = [store for made_by, store in _stores.values() if made_by == pid]
        _stores.clear()
    for store in mine:
        with contextlib.suppress(Exception):
            store.close()
    close_thread_connections()


def _on_process_shutdown(**_: Any) -> None:
    close_stores()


worker_process_shutdown.connect(_on_process_shutdown, weak=False)


@contextlib.contextmanager
def _running(state: TaskDedup) -> Iterator[TaskDedup]:
    stack: list[TaskDedup] | None = getattr(_local, "running", None)
    if stack is None:
        stack = _local.running = []
    stack.append(state)
    try:
        yield state
    finally:
        stack.pop()


# -- the base class ------------------------------------------------------------------------


def _check_number(cls: type, name: str, *, positive: bool, optional: bool) -> None:
    value = getattr(cls, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{cls.__name__}.{name} must be seconds (a number), not {value!r}")
    if not (value > 0 if positive else value >= 0):
        raise ValueError(
            f"{cls.__name__}.{name} must be {'>' if positive else '>='} 0, got {value}"
        )


def _check_options(cls: type[IdempotentTask]) -> None:
    """Refuses options that cannot work, when the task class is made."""
    name = cls.__name__
    for flag in ("acks_late", "reject_on_worker_lost"):
        if getattr(cls, flag) is False:
            raise ValueError(
                f"{name}: {flag}=False would ack a task's message before its effect is "
                "done or when its worker dies; an IdempotentTask needs the message back "
                "(docs/integrations.md, 'Celery')"
            )
    store, conn = cls.dedup_store, cls.dedup_connection
    if isinstance(store, (ClaimAPI, AsyncClaimAPI)):
        raise TypeError(
            f"{name}.dedup_store is a store object; give a factory (a function returning "
            "the store) or a URL: each worker process makes its own store"
        )
    if store is not None and not isinstance(store, str) and not callable(store):
        raise TypeError(f"{name}.dedup_store must be a factory or a URL, not {store!r}")
    if conn is not None and not callable(conn):
        raise TypeError(f"{name}.dedup_connection must be a factory of connections")
    if store is not None and conn is not None:
        raise TypeError(f"{name}: give dedup_store or dedup_connection, not both")
    check_identifier(cls.dedup_table, f"{name}.dedup_table")
    key = cls.dedup_key
    if isinstance(key, str):
        key_path(key)  # a malformed path is a ValueError now, not at the first task
    elif key is not None and not callable(key):
        raise TypeError(f"{name}.dedup_key must be a key path, a function or None, not {key!r}")
    if cls.dedup_payload is not None and not isinstance(key, str):
        raise TypeError(f"{name}.dedup_payload names the payload of a key path (dedup_key)")
    namespace = cls.dedup_namespace
    if namespace is not None:
        if not isinstance(namespace, str):
            raise TypeError(f"{name}.dedup_namespace must be str, not {type(namespace).__name__}")
        _keys.check_namespace(namespace)
    _check_number(cls, "dedup_lease", positive=True, optional=True)
    _check_number(cls, "dedup_retry_delay", positive=False, optional=False)


class IdempotentTask(celery.Task):  # type: ignore[misc]
    """A Celery task base whose body runs once per key (see the module doc).

    Options (task attributes, or keywords of ``@app.task``):

    - ``dedup_store``: a function returning the store (called once in each
      worker process, on its first task), or a URL/directory for
      :func:`~dedupcore.open_store`;
    - ``dedup_connection``: instead, a function returning a DB-API connection
      (one per worker process and thread; autocommit off): transactional
      mode, the dedup row in ``dedup_table`` (default
      ``dedupcore_consumed``, created if missing);
    - ``dedup_key``: None (the task id), a function of the task's arguments,
      or a key path into the payload (``dedup_payload`` names the argument);
    - ``dedup_namespace``: default the task's name;
    - ``dedup_lease``: seconds a claim is held (default: the store's); a body
      that runs longer can be taken over by a redelivery;
    - ``dedup_retry_delay``: seconds before an IN_PROGRESS task runs again.

    A task called as a plain function (``task(...)``, no message) runs its
    body without a claim, as Celery runs it; ``apply()`` and eager mode
    claim, and raise :class:`~dedupcore.errors.InProgressError` (or the
    store's error) where a worker would retry later.
    """

    acks_late = True
    reject_on_worker_lost = True

    dedup_store: ClassVar[StoreSource | None] = None
    dedup_connection: ClassVar[Any] = None  # a function returning a DB-API connection
    dedup_table: ClassVar[str] = DEFAULT_TABLE
    dedup_key: ClassVar[Callable[..., bytes | str] | str | None] = None
    dedup_payload: ClassVar[str | None] = None
    dedup_namespace: ClassVar[str | None] = None
    dedup_lease: ClassVar[float | None] = None
    dedup_retry_delay: ClassVar[float] = 1.0

    _dedup_key_of: Callable[..., bytes | str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``@app.task(dedup_store=make_store)`` puts the function in the class: keep it
        # a plain function, not a method of the task.
        for option in _FACTORIES:
            value = cls.__dict__.get(option)
            if callable(value) and not isinstance(value, (staticmethod, type)):
                setattr(cls, option, staticmethod(value))
        _check_options(cls)

    @property
    def dedup(self) -> TaskDedup:
        """The running body's claim (store mode) or transaction (transactional mode)."""
        stack: list[TaskDedup] | None = getattr(_local, "running", None)
        if not stack:
            raise RuntimeError("self.dedup is only there while an IdempotentTask's body runs")
        return stack[-1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:  # a function call: no message, nothing to deduplicate
            return super().__call__(*args, **kwargs)
        key = self._dedup_key(request, args, kwargs)
        namespace = self.dedup_namespace or self.name
        if self.dedup_connection is not None:
            return self._run_in_transaction(key, namespace, args, kwargs)
        if self.dedup_store is None:
            raise TypeError(f"task {self.name}: give dedup_store (or dedup_connection)")
        return self._run_claimed(key, namespace, args, kwargs)

    # -- store mode ----------------------------------------------------------------------

    def _run_claimed(
        self, key: bytes | str, namespace: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        assert self.dedup_store is not None
        try:
            store = _store_for(self.dedup_store)
            c = store.claim(key, namespace=namespace, lease=self.dedup_lease, owner=default_owner())
        except _STORE_ERRORS as exc:
            log.warning("claim of %r failed, the task runs again later: %s", key, exc)
            raise self._later(key, exc) from exc
        if c.outcome is Outcome.DUPLICATE:
            return c.result
        if c.outcome is Outcome.IN_PROGRESS:
            raise self._later(key)
        with _running(TaskDedup(key, namespace, store=store, claim=c)):
            try:
                result = self.run(*args, **kwargs)
            except BaseException:
                _release(store, key, c.token, namespace)
                raise
        _complete(store, key, c.token, namespace, result)
        return result

    def _later(self, key: bytes | str, cause: BaseException | None = None) -> BaseException:
        """What to raise so that the task runs again after ``dedup_retry_delay``.

        Like ``self.retry(countdown=...)``, but the retry count stays as it
        is: waiting for another worker's claim is not a failed attempt, and
        ``max_retries`` must not drop the message while that claim lasts.
        """
        request = self.request
        if request.is_eager:
            return cause or InProgressError(
                f"key {key!r} of task {self.name} is being processed by another worker"
            )
        delay = self.dedup_retry_delay
        again = self.signature_from_request(request, countdown=delay, retries=request.retries)
        try:
            again.apply_async()
        except Exception as exc:  # not re-sent: the broker must give the message back
            log.warning(
                "could not re-send task %s (%s); rejecting it to the queue", request.id, exc
            )
            rejected: BaseException = Reject(exc, requeue=True)
            return rejected
        why = f"key {key!r} is held by another worker" if cause is None else str(cause)
        retry: BaseException = Retry(why, exc=cause, when=delay, sig=again)
        return retry

    # -- transactional mode ----------------------------------------------------------------

    def _run_in_transaction(
        self, key: bytes | str, namespace: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        factory, table = self.dedup_connection, self.dedup_table
        assert factory is not None
        _keys.check_key(key, TABLE_MAX_KEY_BYTES)  # a key the table cannot hold fails the task
        body_failed = False
        try:
            conn = thread_connection(factory, table)
            with consume(conn, namespace, key, table=table) as c:
                if c.new:
                    with _running(TaskDedup(key, namespace, conn=conn, consumption=c)):
                        try:
                            c.result = self.run(*args, **kwargs)
                        except BaseException:
                            body_failed = True
                            raise
        except Exception as exc:
            drop_thread_connection(factory, table)  # rolled back; it may be broken too
            if body_failed or isinstance(exc, (TypeError, ValueError, LookupError)):
                raise  # the body's own exception, bad input or a table that is not a dedup table
            log.warning(
                "the dedup transaction of %r failed, the task runs again later: %s", key, exc
            )
            raise self._later(key, exc) from exc
        return c.result

    # -- the key ---------------------------------------------------------------------------

    def _dedup_key(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.dedup_key is None:
            if not request.id:
                raise ValueError(f"task {self.name} has no task id to use as its dedup key")
            return request.id
        key_of = self._dedup_key_of
        if key_of is None:  # self.run is bound here: a bound task's self is not an argument
            key_of = self._dedup_key_of = _decorated_key(
                self.run, self.dedup_key, self.dedup_payload, want_async=False
            )
        return key_of(*args, **kwargs)


def _release(store: ClaimAPI, key: bytes | str, token: int, namespace: str) -> None:
    try:
        store.release(key, token, namespace=namespace)
    except StaleTokenError:
        log.warning("could not release %r: its lease was taken over", key)
    except _STORE_ERRORS as exc:
        log.warning("could not release %r (%s); it runs again after its lease", key, exc)


def _complete(store: ClaimAPI, key: bytes | str, token: int, namespace: str, result: Any) -> None:
    """Completes with the result (retried while the store is unavailable).

    A result the store cannot keep (not msgpack-serializable, too large):
    the key is completed without it, then the TypeError/ValueError is
    raised, as :meth:`~dedupcore.api.ClaimAPI.processing` does.
    """
    done = functools.partial(store.complete, key, token, namespace=namespace)
    try:
        try:
            DEFAULT_RETRY.call(functools.partial(done, result=result), retry_on=_STORE_ERRORS)
        except (TypeError, ValueError) as exc:
            if not result_refused(exc):
                raise
            DEFAULT_RETRY.call(done, retry_on=_STORE_ERRORS)
            raise
    except StaleTokenError:
        _log_taken_over(key)
    except _STORE_ERRORS as exc:
        _log_not_completed(key, exc)
