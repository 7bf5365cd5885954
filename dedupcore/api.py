"""The claim API every front end shares: DedupStore, Client, and the daemon's answers.

:class:`ClaimAPI` holds what is the same whatever carries the batch calls:
single-key forms, ``processing()`` and the ``idempotent`` decorator. A front
end implements ``claim_many``, ``complete_many``, ``release_many``, ``get``
and ``stats``.
"""

from __future__ import annotations

import enum
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import msgpack

from dedupcore.errors import ConflictError, DedupError, StaleTokenError
from dedupcore.record import State

__all__ = [
    "MAX_TOKEN",
    "Claim",
    "ClaimAPI",
    "InProgressError",
    "KeyRecord",
    "Outcome",
    "change_items",
    "check_fingerprints",
    "check_owner",
    "check_token",
    "fingerprint_conflict",
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


class InProgressError(DedupError):
    """Raised by :meth:`DedupStore.idempotent` while another owner holds the key."""


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
            fingerprints=None if fingerprint is None else [fingerprint],
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
    ) -> Iterator[Claim]:
        """Claims ``key`` for a ``with`` block: completes on success, releases on exception.

        Act only when ``claim.outcome is Outcome.NEW``; set ``claim.result`` to
        store a result with the completion. Exceptions are re-raised. A result
        that cannot be stored (too large, not msgpack-serializable) raises its
        TypeError/ValueError after the key was completed without it: the work
        is not done twice.
        """
        c = self.claim(key, namespace=namespace, lease=lease, owner=owner, fingerprint=fingerprint)
        if c.outcome is not Outcome.NEW:
            yield c
            return
        try:
            yield c
        except BaseException:
            try:
                self.release(key, c.token, namespace=namespace)
            except StaleTokenError:
                log.warning("could not release %r: its lease was taken over", key)
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
        self, *, namespace: str, key: Callable[..., bytes | str], lease: float | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator: runs the function once per key; duplicates get the stored result.

        ``key`` maps the call's arguments to the dedup key. While another
        owner holds the key, calls raise :class:`InProgressError`.
        """

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            @functools.wraps(fn)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                k = key(*args, **kwargs)
                with self.processing(k, namespace=namespace, lease=lease) as c:
                    if c.outcome is Outcome.NEW:
                        c.result = fn(*args, **kwargs)
                        return c.result  # type: ignore[no-any-return]
                    if c.outcome is Outcome.DUPLICATE:
                        return c.result  # type: ignore[no-any-return]
                    raise InProgressError(
                        f"key {k!r} in namespace {namespace!r} is being processed by another "
                        "owner; retry later"
                    )

            return wrapper

        return decorate
