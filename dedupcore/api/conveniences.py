"""The conveniences over the claim calls, written once for the sync and the async API.

Key paths (:func:`key_path`), the ``DEDUPCORE_DISABLED`` switch, the
:class:`DuplicateCache`, and the decisions of ``processing()`` and the
``idempotent`` decorator: :class:`~dedupcore.api.contract.ClaimAPI` and
:class:`~dedupcore.api.contract.AsyncClaimAPI` drive the same steps, one with
calls and one with awaits (docs/conveniences.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dedupcore.api.answers import Claim, Outcome
from dedupcore.api.batches import pack_result, result_refused, unpack_result
from dedupcore.errors import KeyPathError, StaleTokenError

__all__ = [
    "DISABLE_ENV",
    "HEARTBEAT_LEASE",
    "AsyncHeartbeat",
    "DuplicateCache",
    "Heartbeat",
    "idempotency_disabled",
    "key_path",
]

log = logging.getLogger("dedupcore")

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
    found = value_at(path)

    def extract(payload: Any) -> bytes | str:
        return _key_value(found(payload), path)

    return extract


def value_at(path: str) -> Callable[[Any], Any]:
    """A function taking a payload to the value at ``path`` as it is (see
    :func:`key_path` for paths); a missing field raises :class:`KeyPathError`."""
    steps = _parse_path(path)

    def extract(payload: Any) -> Any:
        value = payload
        for i, step in enumerate(steps):
            try:
                value = _step(value, step)
            except (LookupError, AttributeError, TypeError) as exc:
                where = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[: i + 1])
                raise KeyPathError(
                    f"key path {path!r}: nothing at {where.lstrip('.')!r} ({exc})"
                ) from None
        return value

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


#: The lease of a claim under a heartbeat when none is given: renewed every third
#: of it, a stopped owner's key is taken over this long after its last renewal.
HEARTBEAT_LEASE = 30.0


class _Beat:
    """What both heartbeats share: the interval, and what a failed renewal means."""

    def __init__(self, claim: Claim, lease: float) -> None:
        self.claim = claim
        self.interval = lease / 3
        self.renewals = 0
        #: Set when the claim was lost (completed, released or taken over): no more renewals.
        self.lost: StaleTokenError | None = None

    def _failed(self, exc: Exception) -> bool:
        """Logs a failed renewal; True when the claim is lost and the beat stops."""
        key, ns = self.claim.key, self.claim.namespace
        if isinstance(exc, StaleTokenError):
            self.lost = exc
            log.warning("heartbeat of %r in %r stopped: the claim is lost (%s)", key, ns, exc)
            return True
        log.warning(
            "heartbeat of %r in %r could not renew the lease (%s: %s); retrying in %.3g s",
            key,
            ns,
            type(exc).__name__,
            exc,
            self.interval,
        )
        return False


class Heartbeat(_Beat):
    """Renews a NEW claim's lease every third of it, in a thread, while a block runs.

    ``renew()`` extends the claim by ``lease``; a renewal that fails for a
    while (the store unavailable) is retried at the next beat; a stale token
    (the claim was taken over) stops the beat. Leaving the ``with`` block stops
    it before the claim is completed or released (docs/conveniences.md,
    "Heartbeats").
    """

    def __init__(self, claim: Claim, lease: float, renew: Callable[[], None]) -> None:
        super().__init__(claim, lease)
        self._renew = renew
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dedupcore-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._renew()
            except Exception as exc:
                if self._stop.is_set():
                    return  # the block ended while the renewal was under way
                if self._failed(exc):
                    return
            else:
                self.renewals += 1


class AsyncHeartbeat(_Beat):
    """:class:`Heartbeat` as an asyncio task, for ``async with`` blocks."""

    def __init__(self, claim: Claim, lease: float, renew: Callable[[], Awaitable[None]]) -> None:
        super().__init__(claim, lease)
        self._renew = renew
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncHeartbeat:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        # The beat's own cancellation is returned, not raised; the caller's is raised.
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._renew()
            except Exception as exc:
                if self._failed(exc):
                    return
            else:
                self.renewals += 1


@dataclass(frozen=True, slots=True)
class Step:
    """What :class:`Processing` asks its driver for: ``give`` a claim to the block, or
    ``call`` the store ("claim", "complete" with ``token`` and ``result``, "release")."""

    give: Claim | None = None
    call: str = ""
    token: int = 0
    result: Any = None


class Processing:
    """The decisions of ``processing()``, written once for the sync and the async API.

    :meth:`steps` yields :class:`Step` s; a driver (``ClaimAPI.processing``,
    ``AsyncClaimAPI.processing``) runs each with calls or awaits, sends back
    the claim a "claim" step gave, and throws into it what the block or a
    call raised. A cached DUPLICATE is given without asking the store; a
    claim other than NEW is given as it is (and cached when DUPLICATE); a
    NEW claim is completed after the block, with its ``result``, or released
    if the block raised; a result the store refuses is completed without it
    and its error raised (the work is not done twice).
    """

    def __init__(
        self,
        key: bytes | str,
        namespace: str,
        fingerprint: bytes | None,
        cache: DuplicateCache | None,
    ) -> None:
        self.key = key
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.cache = cache

    def steps(self) -> Generator[Step, Claim | None, None]:
        cache = self.cache
        if cache is not None:
            hit = cache.get(self.key, namespace=self.namespace, fingerprint=self.fingerprint)
            if hit is not None:
                yield Step(give=hit)
                return
        c = yield Step(call="claim")
        assert c is not None
        if c.outcome is not Outcome.NEW:
            if cache is not None:
                cache.put(c, fingerprint=self.fingerprint)
            yield Step(give=c)
            return
        try:
            yield Step(give=c)
        except BaseException:
            try:
                yield Step(call="release", token=c.token)
            except StaleTokenError:
                _release_lost(self.key)
            raise
        try:
            yield Step(call="complete", token=c.token, result=c.result)
        except (TypeError, ValueError) as exc:
            if not result_refused(exc):
                raise  # the store's own answer (e.g. the lease was taken over)
            # Record the key as processed without its result, so that a
            # redelivery does not do the work a second time; tell the caller.
            yield Step(call="complete", token=c.token)
            raise
