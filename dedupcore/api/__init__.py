"""The claim API every front end shares: DedupStore, Client, and the daemon's answers.

:class:`ClaimAPI` holds what is the same whatever carries the batch calls:
single-key forms, ``processing()`` and the ``idempotent`` decorator. A front
end implements ``claim_many``, ``complete_many``, ``release_many``, ``get``
and ``stats``. :class:`AsyncClaimAPI` is its asyncio twin (for
:class:`dedupcore.aio.Client`): the same conveniences as coroutines, built on
the same helpers (argument checks, key paths, the disable switch, the
duplicate cache), so the two cannot drift apart.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, fields
from typing import Any, ParamSpec, TypeVar

import msgpack

import dedupcore._engine as _engine
from dedupcore.errors import (
    ConflictError,
    DedupError,
    InProgressError,
    KeyPathError,
    StaleTokenError,
)
from dedupcore.record import State

__all__ = [
    "DISABLE_ENV",
    "MAX_TOKEN",
    "AsyncClaimAPI",
    "Claim",
    "ClaimAPI",
    "DuplicateCache",
    "InProgressError",
    "KeyPathError",
    "KeyRecord",
    "Outcome",
    "change_items",
    "check_fingerprints",
    "check_owner",
    "check_token",
    "fingerprint_conflict",
    "idempotency_disabled",
    "key_path",
    "namespace_counts",
    "pack_result",
    "result_refused",
    "unpack_result",
]

#: Fencing tokens are positive and fit a signed 64-bit integer everywhere they are stored.
MAX_TOKEN = (1 << 63) - 1

log = logging.getLogger("dedupcore")

P = ParamSpec("P")
R = TypeVar("R")


class Outcome(enum.Enum):
    """What a claim found."""

    NEW = "new"  #: the caller now owns the key and must complete or release it
    DUPLICATE = "duplicate"  #: already processed; ``result`` holds the stored result
    IN_PROGRESS = "in_progress"  #: another owner holds an unexpired lease; retry later


@dataclass(slots=True)
class Claim:
    """The answer to a claim.

    For a NEW claim, ``token`` is the fencing token to pass to ``complete``
    or ``release``; inside ``store.processing(...)`` set ``result`` to what
    should be stored with the completion. ``exact`` is False only when the
    answer came from the cold Bloom archive.
    """

    key: bytes | str
    namespace: str
    outcome: Outcome
    token: int = 0
    result: Any = None
    exact: bool = True
    takeover: bool = False


# Batch answers build their Claims natively, slots filled in as __init__ would
# (docs/engine.md, "Answers"): a fraction of the cost of calling the class.
_engine.bind_record_class(Claim, tuple(f.name for f in fields(Claim)))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key's record as :meth:`DedupStore.get` reports it."""

    state: State
    token: int
    owner: bytes | None
    fingerprint: bytes | None
    result: Any
    created: float
    updated: float
    exact: bool = True


def check_token(token: object) -> int:
    """A fencing token: an int in 1..MAX_TOKEN (TypeError/ValueError otherwise)."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int, not {type(token).__name__}")
    if not 1 <= token <= MAX_TOKEN:
        raise ValueError(f"token must be in 1..2**63-1, got {token}")
    return token


MAX_OWNER_BYTES = 255
MAX_FINGERPRINT_BYTES = 255


def check_owner(owner: object) -> bytes | None:
    """An owner id as bytes (str as UTF-8), 1..255 bytes, or None."""
    if owner is None:
        return None
    if isinstance(owner, str):
        owner = owner.encode()
    if not isinstance(owner, bytes):
        raise TypeError(f"owner must be str or bytes, not {type(owner).__name__}")
    if not 1 <= len(owner) <= MAX_OWNER_BYTES:
        raise ValueError(f"owner must be 1..{MAX_OWNER_BYTES} bytes, got {len(owner)}")
    return owner


def check_fingerprints(fps: Sequence[bytes | None] | None, n: int) -> list[bytes | None]:
    """One fingerprint (bytes of 1..255, or None) per key of a batch of ``n``."""
    if fps is None:
        return [None] * n
    out = list(fps)
    if len(out) != n:
        raise ValueError(f"{len(out)} fingerprints for {n} keys")
    for fp in out:
        if fp is None:
            continue
        if not isinstance(fp, bytes):
            raise TypeError(f"fingerprint must be bytes, not {type(fp).__name__}")
        if not 1 <= len(fp) <= MAX_FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes, got {len(fp)}")
    return out


def fingerprint_conflict(key: object, namespace: str) -> ConflictError:
    """The error for a key claimed again with another fingerprint than its first claim's."""
    return ConflictError(
        f"key {key!r} in namespace {namespace!r} was claimed with a different fingerprint "
        "(same idempotency key, another request)"
    )


def result_refused(exc: BaseException) -> bool:
    """Whether ``complete`` failed because the store cannot keep the result.

    That is a TypeError/ValueError about the result (not msgpack-serializable,
    over the store's limit), not one of the store's own answers such as
    :class:`StaleTokenError`: the work is done, so the key should be completed
    without the result rather than left to run again.
    """
    return isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, DedupError)


def change_items(items: Iterable[Any], *, with_results: bool) -> list[tuple[Any, int, Any]]:
    """``(key, token[, result])`` items of complete_many/release_many, checked.

    Tuples or lists are accepted; a result is only allowed when completing.
    """
    sizes = (2, 3) if with_results else (2,)
    out = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in sizes:
            shape = "(key, token) or (key, token, result)" if with_results else "(key, token)"
            raise TypeError(f"each item must be {shape}, got {item!r:.80}")
        out.append((item[0], check_token(item[1]), item[2] if len(item) == 3 else None))
    return out


def namespace_counts(outcomes: Mapping[tuple[str, str], int]) -> dict[str, dict[str, Any]]:
    """``stats()["namespaces"]``: per namespace, claims per outcome and the duplicate rate.

    ``outcomes`` counts ``(namespace, outcome value)`` pairs; several stores'
    counters can be summed before they are passed in.
    """
    per_ns: dict[str, dict[str, Any]] = {}
    for (ns, outcome), n in outcomes.items():
        per_ns.setdefault(ns, {o.value: 0 for o in Outcome})[outcome] += n
    for counts in per_ns.values():
        total = sum(counts[o.value] for o in Outcome)
        counts["duplicate_rate"] = counts["duplicate"] / total if total else 0.0
    return per_ns


def pack_result(result: Any, max_bytes: int) -> bytes | None:
    """A result as stored (msgpack); TypeError if it cannot be, ValueError if too large."""
    if result is None:
        return None
    try:
        packed: bytes = msgpack.packb(result, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            "result must be msgpack-serializable (None, bool, int of 64 bits, float, str, "
            f"bytes, list, dict): {exc}"
        ) from None
    if len(packed) > max_bytes:
        raise ValueError(
            f"result is {len(packed)} bytes encoded; the limit is max_result_bytes={max_bytes}"
        )
    return packed


def unpack_result(raw: bytes | None) -> Any:
    """A stored result (maps may have non-str keys, as the caller stored them)."""
    if not raw:
        return None
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


# -- conveniences of the decorator: key paths, the disable switch, the cache ----------


_PATH_TOKEN = re.compile(r'\.?(?:"((?:[^"\\]|\\.)*)"|([^.\[\]"]+))|\[(-?\d+)\]')


def _parse_path(path: str) -> list[str | int]:
    if not isinstance(path, str) or not path:
        raise ValueError("a key path must be a non-empty str such as 'order.id'")
    steps: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _PATH_TOKEN.match(path, pos)
        quoted, name, index = m.groups() if m is not None else (None, None, None)
        dotted = m is not None and m.group(0).startswith(".")
        if m is None or (dotted and pos == 0) or (index is None and pos > 0 and not dotted):
            raise ValueError(f"cannot parse key path {path!r} at offset {pos}")
        if index is not None:
            steps.append(int(index))
        elif quoted is not None:
            steps.append(re.sub(r"\\(.)", r"\1", quoted))
        else:
            steps.append(str(name))
        pos = m.end()
    return steps


def _step(value: Any, step: str | int) -> Any:
    if isinstance(value, (str, bytes, bytearray)):
        # A JSON document inside the payload (an HTTP or queue message body).
        try:
            value = json.loads(value)
        except ValueError:
            raise LookupError("a string that is not a JSON document") from None
    if isinstance(step, int):
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes, bytearray)):
            raise LookupError(f"not a list: {type(value).__name__}")
        return value[step]
    if isinstance(value, Mapping):
        return value[step]
    if value is None or isinstance(value, (int, float, bool, list, tuple)):
        raise LookupError(f"no field {step!r} in a {type(value).__name__}")
    return getattr(value, step)


def _key_value(found: Any, path: str) -> bytes | str:
    if isinstance(found, (str, bytes)) and found:
        return found
    if isinstance(found, int) and not isinstance(found, bool):
        return str(found)
    if found is None or found == "" or found == b"":
        raise KeyPathError(f"key path {path!r} found an empty value: no key to dedup on")
    # A sub-document (or a float, a bool): its canonical JSON, hashed, so that
    # equal documents give the same key however their maps are ordered.
    try:
        canonical = json.dumps(found, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise KeyPathError(f"key path {path!r} found a value that is not JSON: {exc}") from None
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def key_path(path: str) -> Callable[[Any], bytes | str]:
    """A function taking a payload to the dedup key found at ``path``.

    ``path`` is dotted names and list indexes: ``"order.id"``,
    ``"Records[0].messageId"``, ``"items[-1].sku"``, ``'headers."Idempotency-Key"'``
    (a quoted name may hold any character; ``\\"`` and ``\\\\`` inside it are
    a quote and a backslash). Names look up mappings, then attributes
    (dataclasses, objects); a string met before the end of the path is parsed
    as JSON (a message body). The value found is the key if it is a non-empty
    str or bytes, its decimal text if an int, and otherwise (a map, a list, a
    float, a bool) ``"sha256:"`` and the hex SHA-256 of its canonical JSON
    (sorted keys). A missing field or an empty value raises
    :class:`KeyPathError`; a malformed path raises ValueError here.
    """
    steps = _parse_path(path)

    def extract(payload: Any) -> bytes | str:
        value = payload
        for i, step in enumerate(steps):
            try:
                value = _step(value, step)
            except (LookupError, AttributeError, TypeError) as exc:
                where = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[: i + 1])
                raise KeyPathError(
                    f"key path {path!r}: nothing at {where.lstrip('.')!r} ({exc})"
                ) from None
        return _key_value(value, path)

    return extract


#: The environment variable that turns the ``idempotent`` decorator off (for tests).
DISABLE_ENV = "DEDUPCORE_DISABLED"
_TRUE = frozenset({"1", "true", "yes", "on"})
_disabled_logged = threading.Event()


def idempotency_disabled() -> bool:
    """Whether ``DEDUPCORE_DISABLED`` is set to 1/true/yes/on (read at every call)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def _log_disabled_once() -> None:
    if not _disabled_logged.is_set():
        _disabled_logged.set()
        log.warning(
            "idempotency is disabled (%s is set): functions decorated with idempotent() run "
            "on every call, duplicates included",
            DISABLE_ENV,
        )


@dataclass(frozen=True, slots=True)
class _Cached:
    packed: bytes | None
    token: int
    exact: bool
    expires: float


class DuplicateCache:
    """Recent DUPLICATE answers, kept in this process: a hot duplicate costs no round trip.

    Bounded (``maxsize`` entries, least recently used dropped first) and
    each entry expires ``ttl`` seconds after the answer it copies (on
    ``clock``, monotonic by default). Only DUPLICATE answers are kept: a
    processed key's record does not change, whereas NEW and IN_PROGRESS are
    the authority's to decide each time. An entry is keyed by namespace, key
    and fingerprint, so another request under the same key still reaches the
    store (and its fingerprint check). What it can get wrong: for up to
    ``ttl`` seconds after the store forgets a key (its retention ran out),
    a cached DUPLICATE is still answered. Results are stored encoded, so each
    hit returns a fresh copy. Thread-safe.
    """

    def __init__(
        self,
        maxsize: int = 10_000,
        ttl: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        self.maxsize = maxsize
        self.ttl = float(ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, bytes, bytes | None], _Cached] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @staticmethod
    def _index(namespace: str, key: bytes | str, fingerprint: bytes | None) -> Any:
        return (namespace, key.encode() if isinstance(key, str) else bytes(key), fingerprint)

    def get(
        self, key: bytes | str, *, namespace: str, fingerprint: bytes | None = None
    ) -> Claim | None:
        """The cached DUPLICATE claim of the key, or None."""
        idx = self._index(namespace, key, fingerprint)
        now = self._clock()
        with self._lock:
            hit = self._entries.get(idx)
            if hit is not None and hit.expires <= now:
                del self._entries[idx]
                hit = None
            if hit is None:
                self.misses += 1
                return None
            self._entries.move_to_end(idx)
            self.hits += 1
        return Claim(
            key,
            namespace,
            Outcome.DUPLICATE,
            hit.token,
            unpack_result(hit.packed),
            exact=hit.exact,
        )

    def put(self, claim: Claim, *, fingerprint: bytes | None = None) -> bool:
        """Keeps a DUPLICATE answer (anything else is ignored); True if it was kept."""
        if claim.outcome is not Outcome.DUPLICATE:
            return False
        try:
            packed = None if claim.result is None else pack_result(claim.result, 1 << 62)
        except TypeError:
            return False  # a result this process cannot copy: not cached
        idx = self._index(claim.namespace, claim.key, fingerprint)
        entry = _Cached(packed, claim.token, claim.exact, self._clock() + self.ttl)
        with self._lock:
            self._entries[idx] = entry
            self._entries.move_to_end(idx)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
                self.evictions += 1
        return True

    def clear(self) -> None:
        """Forgets every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Entries, hits, misses and evictions."""
        with self._lock:
            return {
                "size": len(self._entries),
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }


# -- what the sync and the async claim API share ------------------------------------


def _fingerprints(fingerprint: bytes | None) -> list[bytes | None] | None:
    """The ``fingerprints`` of a one-key batch."""
    return None if fingerprint is None else [fingerprint]


def _release_lost(key: bytes | str) -> None:
    log.warning("could not release %r: its lease was taken over", key)


def _bypassed() -> bool:
    """Whether the decorator runs the function without claiming (``DEDUPCORE_DISABLED``)."""
    if idempotency_disabled():
        _log_disabled_once()
        return True
    return False


def _decorated_key(
    fn: Callable[..., Any],
    key: Callable[..., bytes | str] | str,
    payload: str | None,
    *,
    want_async: bool,
) -> Callable[..., bytes | str]:
    """The key function of ``fn`` decorated by ``idempotent``, its arguments checked.

    ``want_async``: the decorator of an async front end takes ``async def``
    functions only, a sync one plain functions only (a coroutine object is
    not a result that can be stored).
    """
    if not callable(fn):
        raise TypeError(f"idempotent decorates a function, not {type(fn).__name__}")
    name = getattr(fn, "__qualname__", repr(fn))
    if want_async and not inspect.iscoroutinefunction(fn):
        raise TypeError(f"an async front end's idempotent decorates async def; {name} is not")
    if not want_async and inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{name} is async def: decorate it with the idempotent of dedupcore.aio.Client "
            "(or another AsyncClaimAPI)"
        )
    if callable(key):
        if payload is not None:
            raise TypeError("payload= is for a key path; here key is a function")
        return key
    return _payload_key(fn, key_path(key), payload)


def _answer(c: Claim, key: bytes | str, namespace: str) -> Any:
    """What a decorated call returns: the claim's result (the function's own for a NEW
    claim, the stored one for a DUPLICATE); InProgressError while another owner holds it."""
    if c.outcome is Outcome.IN_PROGRESS:
        raise InProgressError(
            f"key {key!r} in namespace {namespace!r} is being processed by another "
            "owner; retry later"
        )
    return c.result


class ClaimAPI(ABC):
    """Single-key calls, ``processing()`` and ``idempotent`` over the batch calls."""

    @abstractmethod
    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace."""

    @abstractmethod
    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims: ``(key, token)`` or ``(key, token, result)``."""

    @abstractmethod
    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims."""

    @abstractmethod
    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and figures."""

    def close(self) -> None:  # noqa: B027 - a front end without resources has nothing to close
        """Releases the front end's resources (files, connections)."""

    def durability(self) -> str:
        """What an acknowledged claim or completion survives, in words.

        Remote authorities read it from their server's settings, and stacks
        report their authority's (a sharded store its weakest shard's). This
        default answers for the embedded store from ``config.durability``,
        and "unknown" for a front end that cannot tell.
        """
        mode = getattr(getattr(self, "config", None), "durability", None)
        if mode == "durable":
            return (
                "durable: the write-ahead log is fdatasynced before each answer: survives a "
                "process crash and a power loss"
            )
        if mode == "power-loss-unsafe":
            return (
                "power-loss-unsafe: survives a process crash; a power loss or an OS crash can "
                "lose the last acknowledged claims"
            )
        return "unknown: this store does not report what an acknowledged claim survives"

    def claim(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
    ) -> Claim:
        """Claims a key before acting on it; see :class:`Outcome`.

        A NEW claim must be completed or released before its lease (default
        ``config.lease`` seconds) runs out. The same ``owner`` claiming again
        gets its own claim back. A different ``fingerprint`` than the one the
        key was first claimed with raises :class:`ConflictError`.
        """
        return self.claim_many(
            [key],
            namespace=namespace,
            lease=lease,
            owner=owner,
            fingerprints=_fingerprints(fingerprint),
        )[0]

    def complete(self, key: bytes | str, token: int, *, namespace: str, result: Any = None) -> None:
        """Marks a claimed key processed, storing ``result`` (msgpack-serializable)."""
        self.complete_many([(key, token, result)], namespace=namespace)

    def release(self, key: bytes | str, token: int, *, namespace: str) -> None:
        """Gives a claimed key back so that a redelivery can run the work again."""
        self.release_many([(key, token)], namespace=namespace)

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
    ) -> Iterator[Claim]:
        """Claims ``key`` for a ``with`` block: completes on success, releases on exception.

        Act only when ``claim.outcome is Outcome.NEW``; set ``claim.result`` to
        store a result with the completion. Exceptions are re-raised. A result
        that cannot be stored (too large, not msgpack-serializable) raises its
        TypeError/ValueError after the key was completed without it: the work
        is not done twice. With a :class:`DuplicateCache`, a key it holds is
        answered DUPLICATE from it without asking the store, and the store's
        DUPLICATE answers are added to it.
        """
        if cache is not None:
            hit = cache.get(key, namespace=namespace, fingerprint=fingerprint)
            if hit is not None:
                yield hit
                return
        c = self.claim(key, namespace=namespace, lease=lease, owner=owner, fingerprint=fingerprint)
        if c.outcome is not Outcome.NEW:
            if cache is not None:
                cache.put(c, fingerprint=fingerprint)
            yield c
            return
        try:
            yield c
        except BaseException:
            try:
                self.release(key, c.token, namespace=namespace)
            except StaleTokenError:
                _release_lost(key)
            raise
        try:
            self.complete(key, c.token, namespace=namespace, result=c.result)
        except (TypeError, ValueError) as exc:
            if not result_refused(exc):
                raise  # the store's own answer (e.g. the lease was taken over)
            # Record the key as processed without its result, so that a
            # redelivery does not do the work a second time; tell the caller.
            self.complete(key, c.token, namespace=namespace)
            raise

    def idempotent(
        self,
        *,
        namespace: str,
        key: Callable[..., bytes | str] | str,
        lease: float | None = None,
        payload: str | None = None,
        cache: DuplicateCache | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator: runs the function once per key; duplicates get the stored result.

        ``key`` maps the call's arguments to the dedup key, or is a path into
        the payload (see :func:`key_path`: ``"order.id"``,
        ``"Records[0].messageId"``); the payload is the function's first
        argument, or the argument named ``payload``. While another owner holds
        the key, calls raise :class:`InProgressError`. ``cache``: a
        :class:`DuplicateCache` answering recent duplicates without a round
        trip. With the environment variable ``DEDUPCORE_DISABLED=1`` the
        function runs on every call and nothing is claimed (logged once).
        ``async def`` functions are refused (TypeError): decorate them with
        an :class:`AsyncClaimAPI` such as :class:`dedupcore.aio.Client`.
        """

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            key_of = _decorated_key(fn, key, payload, want_async=False)

            @functools.wraps(fn)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                if _bypassed():
                    return fn(*args, **kwargs)
                k = key_of(*args, **kwargs)
                with self.processing(k, namespace=namespace, lease=lease, cache=cache) as c:
                    if c.outcome is Outcome.NEW:
                        c.result = fn(*args, **kwargs)
                    return _answer(c, k, namespace)  # type: ignore[no-any-return]

            return wrapper

        return decorate


class AsyncClaimAPI(ABC):
    """:class:`ClaimAPI` for asyncio front ends: the same methods as coroutines.

    A front end implements ``claim_many``, ``complete_many``,
    ``release_many``, ``get`` and ``stats`` as coroutines; the single-key
    forms, ``processing()`` (an ``async with`` block) and the ``idempotent``
    decorator (of ``async def`` functions, with the same key paths,
    :class:`DuplicateCache` and ``DEDUPCORE_DISABLED`` switch) come from
    here, sharing their checks and decisions with :class:`ClaimAPI`.
    """

    @abstractmethod
    async def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace."""

    @abstractmethod
    async def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims: ``(key, token)`` or ``(key, token, result)``."""

    @abstractmethod
    async def release_many(
        self, items: Iterable[tuple[bytes | str, int]], *, namespace: str
    ) -> None:
        """Releases many claims."""

    @abstractmethod
    async def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it."""

    @abstractmethod
    async def stats(self) -> dict[str, Any]:
        """Counters and figures."""

    async def aclose(self) -> None:  # noqa: B027 - a front end without resources has nothing to close
        """Releases the front end's resources (connections)."""

    async def claim(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
    ) -> Claim:
        """Claims a key before acting on it (see :meth:`ClaimAPI.claim`)."""
        claims = await self.claim_many(
            [key],
            namespace=namespace,
            lease=lease,
            owner=owner,
            fingerprints=_fingerprints(fingerprint),
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
    ) -> AsyncIterator[Claim]:
        """Claims ``key`` for an ``async with`` block (see :meth:`ClaimAPI.processing`)."""
        if cache is not None:
            hit = cache.get(key, namespace=namespace, fingerprint=fingerprint)
            if hit is not None:
                yield hit
                return
        c = await self.claim(
            key, namespace=namespace, lease=lease, owner=owner, fingerprint=fingerprint
        )
        if c.outcome is not Outcome.NEW:
            if cache is not None:
                cache.put(c, fingerprint=fingerprint)
            yield c
            return
        try:
            yield c
        except BaseException:
            try:
                await self.release(key, c.token, namespace=namespace)
            except StaleTokenError:
                _release_lost(key)
            raise
        try:
            await self.complete(key, c.token, namespace=namespace, result=c.result)
        except (TypeError, ValueError) as exc:
            if not result_refused(exc):
                raise  # the store's own answer (e.g. the lease was taken over)
            await self.complete(key, c.token, namespace=namespace)
            raise

    def idempotent(
        self,
        *,
        namespace: str,
        key: Callable[..., bytes | str] | str,
        lease: float | None = None,
        payload: str | None = None,
        cache: DuplicateCache | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
        """Decorator for ``async def``: runs it once per key (see :meth:`ClaimAPI.idempotent`).

        The same arguments, key paths, cache and ``DEDUPCORE_DISABLED``
        switch as the sync decorator; a plain function is refused (TypeError).
        """

        def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
            key_of = _decorated_key(fn, key, payload, want_async=True)

            @functools.wraps(fn)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                if _bypassed():
                    return await fn(*args, **kwargs)
                k = key_of(*args, **kwargs)
                async with self.processing(k, namespace=namespace, lease=lease, cache=cache) as c:
                    if c.outcome is Outcome.NEW:
                        c.result = await fn(*args, **kwargs)
                    return _answer(c, k, namespace)  # type: ignore[no-any-return]

            return wrapper

        return decorate


def _payload_key(
    fn: Callable[..., Any], extract: Callable[[Any], bytes | str], payload: str | None
) -> Callable[..., bytes | str]:
    """The key function of a decorated ``fn``: ``extract`` applied to its payload argument."""
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature (some builtins)
        sig = None
    params = list(sig.parameters.values()) if sig is not None else []
    if payload is not None and sig is not None and payload not in sig.parameters:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"{name} has no argument named {payload!r} (payload=)")
    name = payload if payload is not None else (params[0].name if params else None)

    def key_of(*args: Any, **kwargs: Any) -> bytes | str:
        if sig is None or name is None:
            if not args:
                raise TypeError("the payload is the first positional argument; none was given")
            return extract(args[0])
        bound = sig.bind(*args, **kwargs)
        if name not in bound.arguments:
            raise TypeError(f"the payload argument {name!r} was not given")
        value = bound.arguments[name]
        if sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            if not value:
                raise TypeError("the payload is the first positional argument; none was given")
            value = value[0]
        return extract(value)

    return key_of
