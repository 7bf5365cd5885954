"""The claim contract: :class:`ClaimAPI` and its asyncio twin :class:`AsyncClaimAPI`.

Every public call is written here once (docs/architecture.md, "The
contract"): it builds the batch (:mod:`dedupcore.api.batches`, every argument
checked once) and hands it to the backend's primitives, ``_claim_batch``,
``_change_batch`` and ``_get_record``, with ``stats()``. The single-key forms,
``processing()``, the ``idempotent`` decorator, ``with`` and ``close`` come
with it; a backend also declares its :class:`~dedupcore.api.batches.Limits`
and its ``durability()``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from typing import Any, ParamSpec, TypeVar

import dedupcore.keys as _keys
from dedupcore.api.answers import Claim, KeyRecord, Outcome
from dedupcore.api.batches import (
    DEFAULT_LIMITS,
    ChangeBatch,
    ClaimBatch,
    ExtendBatch,
    Limits,
)
from dedupcore.api.conveniences import (
    HEARTBEAT_LEASE,
    AsyncHeartbeat,
    DuplicateCache,
    Heartbeat,
    Processing,
    Step,
    _bypassed,
    _fingerprints,
)
from dedupcore.api.decorator import Decorated, KeySpec
from dedupcore.api.serializers import Serializer
from dedupcore.api.waiting import Waiting, backoff, check_wait

__all__ = ["UNKNOWN_DURABILITY", "AsyncClaimAPI", "ClaimAPI"]

#: ``durability()`` of a front end that cannot tell what an acknowledged claim survives.
UNKNOWN_DURABILITY = "unknown: this store does not report what an acknowledged claim survives"

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="ClaimAPI")


class _Checks:
    """What both APIs do before a backend sees a call: check its arguments once."""

    #: What the store accepts (keys, results, batches); a backend sets its own.
    limits: Limits = DEFAULT_LIMITS
    #: Whether the batches are built with their keys' digests (False: made on first
    #: use, for a backend that only sends its keys on, as the daemon's clients do).
    hashes_keys: bool = True

    def _refused(self, operation: str, exc: Exception) -> None:
        """Called with the error of a call whose arguments the checks refused, before it
        is raised (``operation``: claim, complete, release or get); a wrapper that
        counts errors overrides it (:class:`~dedupcore.metrics.InstrumentedStore`)."""

    def _claims(
        self,
        keys: Iterable[bytes | str],
        namespace: str,
        lease: float | None,
        owner: bytes | str | None,
        fingerprints: Sequence[bytes | None] | None,
    ) -> ClaimBatch:
        try:
            return ClaimBatch(
                keys,
                namespace=namespace,
                lease=lease,
                owner=owner,
                fingerprints=fingerprints,
                limits=self.limits,
                hashed=self.hashes_keys,
            )
        except Exception as exc:
            self._refused("claim", exc)
            raise

    def _changes(self, items: Iterable[Any], namespace: str, *, completing: bool) -> ChangeBatch:
        try:
            return ChangeBatch(
                items,
                namespace=namespace,
                completing=completing,
                limits=self.limits,
                hashed=self.hashes_keys,
            )
        except Exception as exc:
            self._refused("complete" if completing else "release", exc)
            raise

    def _extensions(self, items: Iterable[Any], namespace: str, lease: float | None) -> ExtendBatch:
        try:
            return ExtendBatch(
                items, namespace=namespace, lease=lease, limits=self.limits, hashed=self.hashes_keys
            )
        except Exception as exc:
            self._refused("extend", exc)
            raise

    def _wait(self, wait: object) -> float:
        try:
            return check_wait(wait)
        except Exception as exc:
            self._refused("claim", exc)
            raise

    def _key(self, key: bytes | str, namespace: str) -> tuple[bytes, bytes]:
        try:
            return _keys.check_namespace(namespace), _keys.check_key(key, self.limits.max_key_bytes)
        except Exception as exc:
            self._refused("get", exc)
            raise


class ClaimAPI(_Checks, ABC):
    """The claim calls, written once over a backend's primitives.

    A backend implements ``_claim_batch``, ``_change_batch``, ``_get_record``
    and ``stats``, and declares ``limits`` and ``durability()``; the public
    calls check their arguments once into a :class:`ClaimBatch` or
    :class:`ChangeBatch` and hand it over (docs/architecture.md, "The
    contract"). Single-key calls, ``processing()`` and ``idempotent`` follow.
    """

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
        wait: float | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace.

        A key repeated in the batch is NEW once; its later copies are
        IN_PROGRESS (or NEW with the same token for an ``owner``). A bad
        argument or a fingerprint conflict raises before anything is claimed.
        ``wait``: seconds to wait on keys another owner holds, until each is
        answered otherwise (DUPLICATE with the result once the owner
        completed it, NEW once it was released or its lease ran out); still
        IN_PROGRESS when the time is up.
        """
        batch = self._claims(keys, namespace, lease, owner, fingerprints)
        wait_s = None if wait is None else self._wait(wait)
        claims = self._claim_batch(batch)
        if not wait_s:
            return claims
        w = Waiting(batch, claims, wait_s)
        while (sub := w.pending()) is not None:
            self._wait_change(sub, w.left(), w.attempt)
            w.answered(self._claim_batch(sub))
        return w.claims

    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims: ``(key, token)`` or ``(key, token, result)``.

        Every item is checked first; a stale token or bad input raises before
        anything is completed.
        """
        self._change_batch(self._changes(items, namespace, completing=True))

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims of one namespace."""
        self._change_batch(self._changes(items, namespace, completing=False))

    def extend_many(
        self,
        items: Iterable[tuple[bytes | str, int]],
        *,
        namespace: str,
        lease: float | None = None,
    ) -> None:
        """Renews held claims: each ``(key, token)`` is held ``lease`` seconds from now
        (default: the store's lease), counted on the clock its store counts leases on.

        All or nothing: a token that no longer holds its key (completed,
        released, taken over by another owner) raises :class:`StaleTokenError`
        before any lease is renewed. A claim whose lease ran out is renewed as
        long as nobody took it over (docs/reliability.md, "Heartbeats").
        """
        self._extend_batch(self._extensions(items, namespace, lease))

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it (None if the store holds nothing)."""
        return self._get_record(*self._key(key, namespace))

    # -- the backend's primitives ------------------------------------------------

    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        """Decides a checked claim batch: one Claim per key, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _claim_batch")

    def _change_batch(self, batch: ChangeBatch) -> None:
        """Completes (``batch.completing``) or releases a checked batch, all or nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _change_batch")

    def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        """The record of a checked namespace and key, or None."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _get_record")

    def _extend_batch(self, batch: ExtendBatch) -> None:
        """Renews the leases of a checked batch, all or nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _extend_batch")

    def _wait_change(self, batch: ClaimBatch, timeout: float, attempt: int) -> None:
        """Returns when a key of ``batch`` may have changed, or after ``timeout`` seconds
        (``attempt``: the rounds waited so far). This default polls: it sleeps a
        backoff; a store that can tell when a key changes wakes sooner."""
        time.sleep(backoff(attempt, timeout))

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and figures."""

    @property
    def failed(self) -> BaseException | None:
        """None while the store serves; the error that stopped it otherwise (the
        daemon exits for a restart when it sees one, docs/daemon.md)."""
        return None

    def close(self) -> None:
        """Releases the front end's resources (files, connections)."""

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def durability(self) -> str:
        """What an acknowledged claim or completion survives, in words.

        Remote authorities read it from their server's settings, the embedded
        store from its config, and stacks report their authority's (a sharded
        store its weakest shard's); a front end that cannot tell says so.
        """
        return UNKNOWN_DURABILITY

    def durability_report(self) -> tuple[int, str]:
        """How much :meth:`durability` promises, and its words.

        The level orders stores by what an acknowledged claim survives: 3 a
        crash and a power loss, 2 a process crash (a power loss can lose the
        last moments), 1 less than that, 0 a crash or restart can lose every
        record, -1 unknown (assume the worst; this default).
        """
        return -1, self.durability()

    def claim(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
        wait: float | None = None,
    ) -> Claim:
        """Claims a key before acting on it; see :class:`Outcome`.

        A NEW claim must be completed or released before its lease (default
        ``config.lease`` seconds) runs out. The same ``owner`` claiming again
        gets its own claim back. A different ``fingerprint`` than the one the
        key was first claimed with raises :class:`ConflictError`. ``wait``:
        while another owner holds the key, wait up to that many seconds for
        its result (see :meth:`claim_many`).
        """
        return self.claim_many(
            [key],
            namespace=namespace,
            lease=lease,
            owner=owner,
            fingerprints=_fingerprints(fingerprint),
            wait=wait,
        )[0]

    def complete(self, key: bytes | str, token: int, *, namespace: str, result: Any = None) -> None:
        """Marks a claimed key processed, storing ``result`` (msgpack-serializable)."""
        self.complete_many([(key, token, result)], namespace=namespace)

    def release(self, key: bytes | str, token: int, *, namespace: str) -> None:
        """Gives a claimed key back so that a redelivery can run the work again."""
        self.release_many([(key, token)], namespace=namespace)

    def extend(
        self, key: bytes | str, token: int, *, namespace: str, lease: float | None = None
    ) -> None:
        """Renews a held claim's lease (see :meth:`extend_many`)."""
        self.extend_many([(key, token)], namespace=namespace, lease=lease)

    # -- conveniences ----------------------------------------------------------

    @contextmanager
    def processing(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
        cache: DuplicateCache | None = None,
        heartbeat: bool = False,
    ) -> Iterator[Claim]:
        """Claims ``key`` for a ``with`` block: completes on success, releases on exception.

        Act only when ``claim.outcome is Outcome.NEW``; set ``claim.result`` to
        store a result with the completion. Exceptions are re-raised. A result
        that cannot be stored (too large, not msgpack-serializable) raises its
        TypeError/ValueError after the key was completed without it: the work
        is not done twice. With a :class:`DuplicateCache`, a key it holds is
        answered DUPLICATE from it without asking the store, and the store's
        DUPLICATE answers are added to it. With ``heartbeat=True`` the claim
        (of ``lease`` seconds, default :data:`HEARTBEAT_LEASE`) is renewed
        every third of its lease while the block runs, so a long block keeps
        its key and a stopped one loses it a lease after its last renewal.
        """
        if heartbeat and lease is None:
            lease = HEARTBEAT_LEASE
        steps = Processing(key, namespace, fingerprint, cache).steps()
        step = next(steps)
        while True:
            try:
                if step.give is not None:
                    try:
                        with self._heartbeat(step.give, lease if heartbeat else None):
                            yield step.give
                    except BaseException as exc:
                        step = steps.throw(exc)
                        continue
                    step = next(steps)
                    continue
                try:
                    done = self._do(step, key, namespace, lease, owner, fingerprint)
                except BaseException as exc:
                    step = steps.throw(exc)
                    continue
                step = steps.send(done)
            except StopIteration:
                return

    def _heartbeat(self, claim: Claim, lease: float | None) -> AbstractContextManager[Any]:
        """The heartbeat of a NEW claim given to a block (``lease``: None for none)."""
        if lease is None or claim.outcome is not Outcome.NEW:
            return nullcontext()

        def renew() -> None:
            self.extend(claim.key, claim.token, namespace=claim.namespace, lease=lease)

        return Heartbeat(claim, lease, renew)

    def _do(
        self,
        step: Step,
        key: bytes | str,
        namespace: str,
        lease: float | None,
        owner: bytes | str | None,
        fingerprint: bytes | None,
    ) -> Claim | None:
        """Runs a step of :meth:`processing`: a claim, a completion or a release."""
        if step.call == "claim":
            return self.claim(
                key, namespace=namespace, lease=lease, owner=owner, fingerprint=fingerprint
            )
        if step.call == "complete":
            self.complete(key, step.token, namespace=namespace, result=step.result)
        else:
            self.release(key, step.token, namespace=namespace)
        return None

    def idempotent(
        self,
        *,
        namespace: str,
        key: KeySpec,
        lease: float | None = None,
        payload: str | None = None,
        cache: DuplicateCache | None = None,
        serializer: Serializer | type[Any] | None = None,
        on_duplicate: Callable[[Any, Claim], Any] | None = None,
        validate: str | Sequence[str] | None = None,
        heartbeat: bool = False,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator: runs the function once per key; duplicates get the stored result.

        ``key`` maps the call's arguments to the dedup key, or is a path into
        the payload (see :func:`key_path`: ``"order.id"``,
        ``"Records[0].messageId"``), or a tuple of paths whose values together
        are the key; the payload is the function's first argument, or the
        argument named ``payload``. While another owner holds the key, calls
        raise :class:`InProgressError`. ``cache``: a :class:`DuplicateCache`
        answering recent duplicates without a round trip. ``serializer``: how
        a result msgpack cannot encode is stored and read back (a
        :class:`~dedupcore.api.serializers.Serializer`, or a dataclass or
        Pydantic model class): a duplicate gets the same type.
        ``on_duplicate(result, claim)``: what a duplicate call returns
        instead of the stored result. ``validate``: paths into the payload
        whose values must be those of the first call; other values raise
        :class:`ConflictError`. ``heartbeat``: renew the claim while the
        function runs (see :meth:`processing`). With the environment variable
        ``DEDUPCORE_DISABLED=1`` the function runs on every call and nothing
        is claimed (logged once). ``async def`` functions are refused
        (TypeError): decorate them with an :class:`AsyncClaimAPI` such as
        :class:`dedupcore.aio.Client`.
        """
        options: dict[str, Any] = {
            "serializer": serializer,
            "on_duplicate": on_duplicate,
            "validate": validate,
        }

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            d = Decorated(fn, key=key, payload=payload, want_async=False, **options)

            @functools.wraps(fn)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                if _bypassed():
                    return fn(*args, **kwargs)
                k = d.key_of(*args, **kwargs)
                fp = d.fingerprint(*args, **kwargs)
                value: Any = None
                refused = None
                with self.processing(
                    k,
                    namespace=namespace,
                    lease=lease,
                    fingerprint=fp,
                    cache=cache,
                    heartbeat=heartbeat,
                ) as c:
                    if c.outcome is Outcome.NEW:
                        value = fn(*args, **kwargs)
                        refused = d.keep(c, value)
                if refused is not None:
                    raise refused
                return d.answer(c, k, namespace, value)  # type: ignore[no-any-return]

            return wrapper

        return decorate


class AsyncClaimAPI(_Checks, ABC):
    """:class:`ClaimAPI` for asyncio front ends: the same methods as coroutines.

    A front end implements the primitives of :class:`ClaimAPI`
    (``_claim_batch``, ``_change_batch``, ``_get_record``) and ``stats`` as
    coroutines, and declares its ``limits``; the public calls check their
    arguments into the same batches, and the single-key forms,
    ``processing()`` (an ``async with`` block) and the ``idempotent``
    decorator (of ``async def`` functions, with the same key paths,
    :class:`DuplicateCache` and ``DEDUPCORE_DISABLED`` switch) come from
    here, sharing their checks and decisions with :class:`ClaimAPI`.
    """

    async def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
        wait: float | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace (see :meth:`ClaimAPI.claim_many`)."""
        batch = self._claims(keys, namespace, lease, owner, fingerprints)
        wait_s = None if wait is None else self._wait(wait)
        claims = await self._claim_batch(batch)
        if not wait_s:
            return claims
        w = Waiting(batch, claims, wait_s)
        while (sub := w.pending()) is not None:
            await self._wait_change(sub, w.left(), w.attempt)
            w.answered(await self._claim_batch(sub))
        return w.claims

    async def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims: ``(key, token)`` or ``(key, token, result)``."""
        await self._change_batch(self._changes(items, namespace, completing=True))

    async def release_many(
        self, items: Iterable[tuple[bytes | str, int]], *, namespace: str
    ) -> None:
        """Releases many claims."""
        await self._change_batch(self._changes(items, namespace, completing=False))

    async def extend_many(
        self,
        items: Iterable[tuple[bytes | str, int]],
        *,
        namespace: str,
        lease: float | None = None,
    ) -> None:
        """Renews held claims (see :meth:`ClaimAPI.extend_many`)."""
        await self._extend_batch(self._extensions(items, namespace, lease))

    async def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it."""
        return await self._get_record(*self._key(key, namespace))

    # -- the backend's primitives (see ClaimAPI) -----------------------------------

    async def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _claim_batch")

    async def _change_batch(self, batch: ChangeBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _change_batch")

    async def _get_record(self, ns: bytes, key: bytes) -> KeyRecord | None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _get_record")

    async def _extend_batch(self, batch: ExtendBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _extend_batch")

    async def _wait_change(self, batch: ClaimBatch, timeout: float, attempt: int) -> None:
        await asyncio.sleep(backoff(attempt, timeout))

    @abstractmethod
    async def stats(self) -> dict[str, Any]:
        """Counters and figures."""

    async def aclose(self) -> None:
        """Releases the front end's resources (connections)."""

    async def claim(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
        wait: float | None = None,
    ) -> Claim:
        """Claims a key before acting on it (see :meth:`ClaimAPI.claim`)."""
        claims = await self.claim_many(
            [key],
            namespace=namespace,
            lease=lease,
            owner=owner,
            fingerprints=_fingerprints(fingerprint),
            wait=wait,
        )
        return claims[0]

    async def complete(
        self, key: bytes | str, token: int, *, namespace: str, result: Any = None
    ) -> None:
        """Marks a claimed key processed, storing ``result`` (msgpack-serializable)."""
        await self.complete_many([(key, token, result)], namespace=namespace)

    async def release(self, key: bytes | str, token: int, *, namespace: str) -> None:
        """Gives a claimed key back so that a redelivery can run the work again."""
        await self.release_many([(key, token)], namespace=namespace)

    async def extend(
        self, key: bytes | str, token: int, *, namespace: str, lease: float | None = None
    ) -> None:
        """Renews a held claim's lease (see :meth:`ClaimAPI.extend_many`)."""
        await self.extend_many([(key, token)], namespace=namespace, lease=lease)

    # -- conveniences ----------------------------------------------------------

    @asynccontextmanager
    async def processing(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
        cache: DuplicateCache | None = None,
        heartbeat: bool = False,
    ) -> AsyncIterator[Claim]:
        """Claims ``key`` for an ``async with`` block (see :meth:`ClaimAPI.processing`)."""
        if heartbeat and lease is None:
            lease = HEARTBEAT_LEASE
        steps = Processing(key, namespace, fingerprint, cache).steps()
        step = next(steps)
        while True:
            try:
                if step.give is not None:
                    try:
                        async with self._heartbeat(step.give, lease if heartbeat else None):
                            yield step.give
                    except BaseException as exc:
                        step = steps.throw(exc)
                        continue
                    step = next(steps)
                    continue
                try:
                    done = await self._do(step, key, namespace, lease, owner, fingerprint)
                except BaseException as exc:
                    step = steps.throw(exc)
                    continue
                step = steps.send(done)
            except StopIteration:
                return

    def _heartbeat(self, claim: Claim, lease: float | None) -> AbstractAsyncContextManager[Any]:
        """The heartbeat of a NEW claim given to a block (``lease``: None for none)."""
        if lease is None or claim.outcome is not Outcome.NEW:
            return nullcontext()

        async def renew() -> None:
            await self.extend(claim.key, claim.token, namespace=claim.namespace, lease=lease)

        return AsyncHeartbeat(claim, lease, renew)

    async def _do(
        self,
        step: Step,
        key: bytes | str,
        namespace: str,
        lease: float | None,
        owner: bytes | str | None,
        fingerprint: bytes | None,
    ) -> Claim | None:
        """Runs a step of :meth:`processing`: a claim, a completion or a release."""
        if step.call == "claim":
            return await self.claim(
                key, namespace=namespace, lease=lease, owner=owner, fingerprint=fingerprint
            )
        if step.call == "complete":
            await self.complete(key, step.token, namespace=namespace, result=step.result)
        else:
            await self.release(key, step.token, namespace=namespace)
        return None

    def idempotent(
        self,
        *,
        namespace: str,
        key: KeySpec,
        lease: float | None = None,
        payload: str | None = None,
        cache: DuplicateCache | None = None,
        serializer: Serializer | type[Any] | None = None,
        on_duplicate: Callable[[Any, Claim], Any] | None = None,
        validate: str | Sequence[str] | None = None,
        heartbeat: bool = False,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
        """Decorator for ``async def``: runs it once per key (see :meth:`ClaimAPI.idempotent`).

        The same arguments, key paths, cache, serializers, validation and
        ``DEDUPCORE_DISABLED`` switch as the sync decorator; ``on_duplicate``
        may be a coroutine function. A plain function is refused (TypeError).
        """
        options: dict[str, Any] = {
            "serializer": serializer,
            "on_duplicate": on_duplicate,
            "validate": validate,
        }

        def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
            d = Decorated(fn, key=key, payload=payload, want_async=True, **options)

            @functools.wraps(fn)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                if _bypassed():
                    return await fn(*args, **kwargs)
                k = d.key_of(*args, **kwargs)
                fp = d.fingerprint(*args, **kwargs)
                value: Any = None
                refused = None
                async with self.processing(
                    k,
                    namespace=namespace,
                    lease=lease,
                    fingerprint=fp,
                    cache=cache,
                    heartbeat=heartbeat,
                ) as c:
                    if c.outcome is Outcome.NEW:
                        value = await fn(*args, **kwargs)
                        refused = d.keep(c, value)
                if refused is not None:
                    raise refused
                answer = d.answer(c, k, namespace, value)
                if c.outcome is not Outcome.NEW and inspect.isawaitable(answer):
                    answer = await answer
                return answer  # type: ignore[no-any-return]

            return wrapper

        return decorate
