"""The interfaces a stacked store is built from.

A stack (:class:`dedupcore.stack.TieredStore`) is, from the top:

- the **front filter**, an in-process Bloom ring: "definitely never seen
  here" skips every read below;
- an optional **cache** (:class:`CacheTier`, e.g. Redis), which holds only
  PROCESSED records and is written through after the authority has them;
- the **authority** (:class:`Authority`), the one exact tier where a NEW
  claim is created atomically and races are decided: the embedded
  :class:`~dedupcore.DedupStore` (LMDB), :class:`~dedupcore.sql.SqlStore`
  or :class:`~dedupcore.redis.RedisStore`;
- an optional **cold archive** (:class:`~dedupcore.tiers.archive.ColdArchive`)
  of keys demoted from the authority.

An authority is any claim API with ``close()``; a cache implements the two
template methods below. A cache or front that fails is skipped (slower, never
wrong); an authority that fails raises :class:`~dedupcore.errors.UnavailableError`,
and one that refuses a request (a bad argument the checks here did not catch)
raises :class:`RequestRefusedError`, a ``ValueError`` that retrying cannot fix.

The checks below are shared by the remote authorities, which validate every
argument before it is sent: a server's "out of range" reply must never be the
first to notice a bad input.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dedupcore.keys as _keys
from dedupcore._checks import checked_int
from dedupcore.api import ClaimAPI
from dedupcore.config import Retention
from dedupcore.errors import RequestRefusedError

__all__ = [
    "MAX_TIMEOUT_SECONDS",
    "MAX_WINDOW_SECONDS",
    "Authority",
    "CacheTier",
    "Cached",
    "RequestRefusedError",
    "check_limit",
    "check_retention",
    "check_timeout",
    "durability_report",
    "failure_of",
]

#: Longest retention window (any of exact, cold, hot) a remote authority takes:
#: expiry times stay far inside every engine's range (Redis' 64-bit
#: milliseconds, SQL intervals, DATETIME back to year 1000).
MAX_WINDOW_SECONDS = 100 * 365 * 86400.0
#: Longest connect/reply timeout accepted for a remote authority.
MAX_TIMEOUT_SECONDS = 3600.0


def durability_report(store: Any) -> tuple[int, str]:
    """How much a store's ``durability()`` promises, and its words.

    The level orders stores by what an acknowledged claim survives: 3 a
    crash and a power loss, 2 a process crash (a power loss can lose the
    last moments), 1 less than that, 0 a crash or restart can lose every
    record, -1 unknown (assume the worst). A claim store declares it
    (:meth:`~dedupcore.api.ClaimAPI.durability_report`).
    """
    if isinstance(store, ClaimAPI):
        level, said = store.durability_report()
        return int(level), str(said)
    said = store.durability() if callable(getattr(store, "durability", None)) else "unknown"
    mode = getattr(getattr(store, "config", None), "durability", None)
    return {"durable": 3, "power-loss-unsafe": 2}.get(str(mode), -1), said


def failure_of(store: object) -> BaseException | None:
    """The failure a store declares through its ``failed`` property, else None.

    A store that can stop for good after a failed write (the embedded store
    once its log's tail is unknown) declares a ``failed`` property: None
    while it serves, the error that stopped it afterwards; the stores that
    wrap others (stacks, shards, write-behind, the instrumented store) give
    the first failure of the stores inside them. Only a ``failed`` property
    of the store's class counts (not an attribute or a method of that name).
    A store without one never stops so: its errors belong to one request each.
    The daemon exits for a restart when its store reports one (docs/daemon.md).
    """
    declared = getattr(type(store), "failed", None)
    if not isinstance(declared, property):
        return None
    failed = declared.__get__(store)
    return failed if isinstance(failed, BaseException) else None


def check_retention(
    retention: object, namespaces: Mapping[str, Retention] | None
) -> tuple[Retention, dict[str, Retention]]:
    """The default and per-namespace policies, each window at most MAX_WINDOW_SECONDS."""
    policy = Retention() if retention is None else retention
    if not isinstance(policy, Retention):
        raise TypeError(f"retention must be a Retention, not {type(policy).__name__}")
    per_ns: dict[str, Retention] = {}
    for ns, p in dict(namespaces or {}).items():
        _keys.check_namespace(ns)
        if not isinstance(p, Retention):
            raise TypeError(f"namespaces[{ns!r}] must be a Retention, not {type(p).__name__}")
        per_ns[ns] = p
    for p in (policy, *per_ns.values()):
        for name in ("exact_window", "cold_window", "hot_window"):
            value = getattr(p, name)
            if value > MAX_WINDOW_SECONDS:
                raise ValueError(
                    f"{name} must be at most {MAX_WINDOW_SECONDS:.0f} seconds (100 years), "
                    f"got {value!r}"
                )
    return policy, per_ns


def check_limit(name: str, value: object, limit: int) -> int:
    """A size setting: an int in 1..limit (TypeError/ValueError otherwise)."""
    return checked_int(name, value, 1, limit)


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """Seconds to wait for a server: a number in (0, MAX_TIMEOUT_SECONDS]."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(timeout).__name__}")
    if not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise ValueError(
            f"{name} must be > 0 and at most {MAX_TIMEOUT_SECONDS:.0f} seconds, got {timeout!r}"
        )
    return float(timeout)


#: An exact tier that decides claims: any claim API (it has ``close``).
Authority = ClaimAPI


@dataclass(frozen=True, slots=True)
class Cached:
    """A PROCESSED record as a cache holds it.

    ``fingerprint_known`` is False when the record was filled from an answer
    that did not carry the fingerprint; such an entry cannot settle a claim
    that brings a fingerprint (the authority has to check it).
    """

    token: int
    result: bytes | None
    fingerprint: bytes | None = None
    fingerprint_known: bool = False


class CacheTier(ABC):
    """A cache of PROCESSED records in front of the authority.

    Subclasses implement :meth:`_get_many` and :meth:`_put_many`; errors
    they raise are caught by the stack, counted, logged and the cache is
    skipped for ``retry_after`` seconds.
    """

    name = "cache"

    @abstractmethod
    def _get_many(self, namespace: bytes, keys: Sequence[bytes]) -> list[Cached | None]:
        """The cached record of each key (None when absent)."""

    @abstractmethod
    def _put_many(
        self, namespace: bytes, entries: Sequence[tuple[bytes, Cached]], ttl: float
    ) -> None:
        """Stores records that the authority holds as PROCESSED, for ``ttl`` seconds."""

    def get_many(self, namespace: bytes, keys: Sequence[bytes]) -> list[Cached | None]:
        """The cached records of checked keys of one namespace."""
        if not keys:
            return []
        found = self._get_many(namespace, keys)
        if len(found) != len(keys):
            raise RuntimeError(f"{self.name}: {len(found)} answers for {len(keys)} keys")
        return found

    def put_many(
        self, namespace: bytes, entries: Sequence[tuple[bytes, Cached]], ttl: float
    ) -> None:
        """Writes PROCESSED records through to the cache."""
        if entries:
            self._put_many(namespace, entries, ttl)

    def close(self) -> None:  # noqa: B027 - a cache without resources needs nothing
        """Releases the cache's connections."""

    def stats(self) -> dict[str, Any]:
        return {}

    #: Exceptions that mean "the cache cannot answer now" (skipped, not raised).
    unavailable: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)
